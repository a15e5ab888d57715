"""The full pipeline and the training flows.

``pipeline``: crawl/ingest -> data stage -> tokenizer + pretraining -> SFT ->
reward model -> PPO (and DPO when enabled), under one MLflow parent run with a
child run per stage. ``train``: every training stage from an existing dataset.
One single-stage flow per entry of the training registry
(:data:`crawl2chat.stages.training.registry.STAGES`): ``pretrain_flow``,
``sft_flow``, ``reward_flow``, ``ppo_flow``, ``dpo_flow``, each taking the
settings and the stage's inputs as parameters.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from prefect import Flow, flow
from prefect.futures import wait

from crawl2chat.flows.data import run_data_pipeline, with_refresh
from crawl2chat.infra.lineage import folder_input_tags, model_input_tags
from crawl2chat.infra.console import keep_run_traces
from crawl2chat.infra.tracking import pipeline_run, setup_tracking
from crawl2chat.stages.settings import Config, SettingsError
from crawl2chat.stages.training.models import model_folder_problem
from crawl2chat.stages.training.registry import STAGES, TrainingStage
from crawl2chat.tasks.data import data_lineage
from crawl2chat.tasks.train import demo_sets_task, questions_task, showcase_task, training_task


def train(config: Config, stage: str, inputs: dict[str, str], lineage: dict[str, str],
          eval_data: str | None = None, cpu_share: int = 1, submit: bool = False):
    """Run one training stage with its section of the settings, as a Prefect task
    (``submit``: started in the background; returns its future)."""
    section = getattr(config, stage)
    task = training_task(stage)
    settings = section.train.model_dump(mode="json")
    # A folder named by a setting keys the run by what it resolves to (runs/mlm/model -> the run
    # folder it links to now), so a retrained encoder or tokenizer is not taken for the old one.
    folders = {}
    for name, role in STAGES[stage].folder_settings:
        if settings.get(name):
            settings[name] = folders[role] = str(Path(settings[name]).resolve())
    lineage = {**lineage, **folder_input_tags(**folders)}
    return (task.submit if submit else task)(
        stage, {name: str(Path(path).resolve()) for name, path in inputs.items()}, str(Path(section.out).resolve()),
        settings, num_processes=section.num_processes, nodes=section.nodes,
        accelerate_config=section.accelerate_config, lineage=lineage, registered_name=section.registered_name,
        eval_data=eval_data, cpu_share=cpu_share, minutes=getattr(section, "minutes", None))


def side_by_side(config: Config, *stages: str) -> bool:
    """Whether these stages train at the same time on this machine's CPU, each rank on
    its share of the cores: each is one process on one machine, and no GPU is visible
    (a GPU or a multi-process job keeps the machine to itself). Their start-up,
    imports and evaluations then overlap instead of queueing."""
    import torch

    return not torch.cuda.is_available() and all(
        getattr(config, s).num_processes == 1 and getattr(config, s).nodes == 1 for s in stages)


@flow(name="pipeline")
def pipeline_flow(config: Config = Config(), refresh: bool = False) -> dict:
    """Every stage end to end: web pages to shards to a base model to an aligned policy.

    ``refresh``: add only new or changed pages to the existing dataset as a new
    version. Training stages whose inputs and settings are unchanged are reused.
    """
    config = with_refresh(config, refresh)
    keep_run_traces(config.home)
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("pipeline", {"config": config.model_dump(mode="json")}) as run:
        manifest = run_data_pipeline(config)
        data_out = str(Path(config.data.out).resolve())
        base = train(config, "pretrain", {"data": data_out}, data_lineage(data_out))
        post = run_post_training(config, base, data_out)
        return {"data": data_out, "manifest": manifest, "pretrain": base, **post, "run_id": run.info.run_id}


@flow(name="train")
def train_flow(config: Config = Config(), data: str = "runs/data") -> dict:
    """Every training stage from an existing data-stage folder: base model, SFT, reward model, PPO (DPO)."""
    keep_run_traces(config.home)
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("train", {"config": config.model_dump(mode="json"), "data": data}) as run:
        data = str(Path(data).resolve())
        base = train(config, "pretrain", {"data": data}, data_lineage(data))
        post = run_post_training(config, base, data)
        return {"data": data, "pretrain": base, **post, "run_id": run.info.run_id}


def run_post_training(config: Config, base: dict, shards: str) -> dict:
    """SFT, reward model, PPO (and DPO when enabled) on top of a base model."""
    need_demo = not (config.sft.data and config.reward.data and config.ppo.prompts)
    demo = (demo_sets_task(shards, str(Path(config.demo_sets.out).resolve()), config.demo_sets.examples,
                           config.demo_sets.seed, base_model=base["model_dir"]) if need_demo else {})
    sft_data = config.sft.data or demo["sft"]
    pref_data = config.reward.data or demo["preference"]
    prompts = config.ppo.prompts or demo["prompts"]

    base_tags = model_input_tags(base=base)
    sft_inputs, rm_inputs = {"base": base["model_dir"], "data": sft_data}, {"base": base["model_dir"], "data": pref_data}
    if side_by_side(config, "sft", "reward"):  # both start from the base model alone
        share = 2  # the two stages below split the cores
        futures = [train(config, "sft", sft_inputs, base_tags, eval_data=shards, cpu_share=share, submit=True),
                   train(config, "reward", rm_inputs, base_tags, cpu_share=share, submit=True)]
        wait(futures)  # both end (a failed one does not leave the other running) before either is read
        sft, rm = (f.result() for f in futures)
    else:
        sft = train(config, "sft", sft_inputs, base_tags, eval_data=shards)
        rm = train(config, "reward", rm_inputs, base_tags)
    policy = train(config, "ppo", {"policy": sft["model_dir"], "reward": rm["model_dir"], "prompts": prompts},
                   model_input_tags(sft=sft, reward=rm), eval_data=shards)
    result = {"sft": sft, "reward": rm, "ppo": policy}
    chain = {"base": base["model_dir"], "sft": sft["model_dir"], "ppo": policy["model_dir"]}
    if demo.get("questions"):
        result["questions"] = questions_task(chain, demo["questions"])
    if demo.get("showcase"):
        result["showcase"] = showcase_task(chain, demo["showcase"])
    if config.dpo.enabled:
        result["dpo"] = train(config, "dpo", {"policy": sft["model_dir"], "data": config.dpo.data or pref_data},
                              model_input_tags(sft=sft), eval_data=shards)
    return result


def stage_inputs(stage: TrainingStage, config: Config, given: dict[str, str]) -> dict[str, str]:
    """The stage's inputs: given values, else the stage's settings field that supplies one."""
    section = getattr(config, stage.name)
    inputs = {}
    for item in stage.inputs:
        value = given.get(item.name) or (getattr(section, item.setting) if item.setting else None)
        if not value:
            where = f" or the setting {stage.name}.{item.setting}" if item.setting else ""
            raise SettingsError(f"{stage.name}: no {item.name} given (the --{item.name} option{where})")
        kind = "reward" if item.model_role == "reward" else "causal"
        if item.model_role and (problem := model_folder_problem(value, kind)):
            raise SettingsError(f"{stage.name}: --{item.name}: {problem}")
        inputs[item.name] = value
    return inputs


def _single_stage_flow(stage: TrainingStage):
    """A flow ``<stage>`` taking ``config`` and the stage's inputs as parameters
    (defaults: where the pipeline leaves them), so the Prefect UI renders a form."""

    def run_stage(config: Config = Config(), **given: str) -> dict:
        keep_run_traces(config.home)
        inputs = stage_inputs(stage, config, given)
        setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
        with pipeline_run(stage.name, {stage.name: getattr(config, stage.name).model_dump(mode="json"), **inputs}):
            # The runs that made its input models, and a dataset's version run for a stage that reads one.
            lineage = folder_input_tags(**{i.model_role: inputs[i.name] for i in stage.inputs if i.model_role})
            if stage.prepare_on_host:
                lineage.update(data_lineage(str(Path(inputs["data"]).resolve())))
            return train(config, stage.name, inputs, lineage)

    params = [inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=Config(), annotation=Config)]
    params += [inspect.Parameter(i.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=i.default, annotation=str)
               for i in stage.inputs]
    run_stage.__signature__ = inspect.Signature(params, return_annotation=dict)
    run_stage.__annotations__ = {"config": Config, **{i.name: str for i in stage.inputs}, "return": dict}
    run_stage.__name__ = run_stage.__qualname__ = f"{stage.name}_flow"
    run_stage.__doc__ = stage.goal
    return flow(name=stage.name, description=stage.goal)(run_stage)


@functools.cache
def stage_flow(name: str) -> Flow:
    """The single-stage flow of ``name``, built when first asked for: Prefect derives each
    flow's parameter form from the whole settings model (a fraction of a second apiece),
    which a command running one stage, or none, should not pay for every stage."""
    return _single_stage_flow(STAGES[name])


def __getattr__(attr: str):
    """``<stage>_flow`` as a module attribute, so a deployment's entrypoint can name each
    (flows/pipeline.py:sft_flow); ``STAGE_FLOWS``: every one by stage name."""
    if attr == "STAGE_FLOWS":
        return {name: stage_flow(name) for name in STAGES}
    if attr.endswith("_flow") and attr[: -len("_flow")] in STAGES:
        return stage_flow(attr[: -len("_flow")])
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
