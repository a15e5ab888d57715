"""The full pipeline and the training flows.

``pipeline``: crawl/ingest -> data stage -> tokenizer + pretraining -> SFT ->
reward model -> PPO (and DPO when enabled), under one MLflow parent run with a
child run per stage. ``pretrain``, ``sft``, ``reward``, ``ppo``, ``dpo``: one
stage from existing inputs.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from crawl2chat.flows.data import run_data_pipeline, with_refresh
from crawl2chat.infra.config import Config
from crawl2chat.infra.lineage import folder_input_tags, model_input_tags
from crawl2chat.infra.tracking import pipeline_run, setup_tracking
from crawl2chat.tasks.data import data_lineage
from crawl2chat.tasks.train import demo_sets_task, dpo_task, ppo_task, pretrain_task, reward_task, sft_task


def _pretrain(config: Config, data: str, lineage: dict[str, str]) -> dict:
    stage = config.pretrain
    return pretrain_task(
        data,
        str(Path(stage.out).resolve()),
        stage.train.model_dump(mode="json"),
        num_processes=stage.num_processes,
        accelerate_config=stage.accelerate_config,
        lineage=lineage,
        registered_name=stage.registered_name,
    )


@flow(name="pipeline")
def pipeline_flow(config: Config = Config(), refresh: bool = False) -> dict:
    """Every stage end to end: web pages to shards to a base model to an aligned policy.

    ``refresh``: add only new or changed pages to the existing dataset as a new
    version. Training stages whose inputs and settings are unchanged are reused.
    """
    config = with_refresh(config, refresh)
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("pipeline", {"config": config.model_dump(mode="json")}) as run:
        manifest = run_data_pipeline(config)
        data_out = str(Path(config.data.out).resolve())
        base = _pretrain(config, data_out, data_lineage(data_out))
        post = run_post_training(config, base, data_out)
        return {"data": data_out, "manifest": manifest, "pretrain": base, **post, "run_id": run.info.run_id}


@flow(name="train")
def train_flow(config: Config = Config(), data: str = "runs/data") -> dict:
    """Every training stage from an existing data-stage folder: base model, SFT, reward model, PPO (DPO)."""
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("train", {"config": config.model_dump(mode="json"), "data": data}) as run:
        data = str(Path(data).resolve())
        base = _pretrain(config, data, data_lineage(data))
        post = run_post_training(config, base, data)
        return {"data": data, "pretrain": base, **post, "run_id": run.info.run_id}


@flow(name="pretrain")
def pretrain_flow(config: Config = Config(), data: str = "runs/data") -> dict:
    """A tokenizer and base model from a data-stage output folder or a plain text file."""
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("pretrain", {"pretrain": config.pretrain.model_dump(mode="json"), "data": data}):
        data = str(Path(data).resolve())
        return _pretrain(config, data, data_lineage(data))


def _stage_kw(stage) -> dict:
    return {"num_processes": stage.num_processes, "accelerate_config": stage.accelerate_config,
            "registered_name": stage.registered_name}


def run_post_training(config: Config, base: dict, shards: str) -> dict:
    """SFT, reward model, PPO (and DPO when enabled) on top of a base model."""
    need_demo = not (config.sft.data and config.reward.data and config.ppo.prompts)
    demo = (demo_sets_task(shards, str(Path(config.demo_sets.out).resolve()), config.demo_sets.examples,
                           config.demo_sets.seed) if need_demo else {})
    sft_data = config.sft.data or demo["sft"]
    pref_data = config.reward.data or demo["preference"]
    prompts = config.ppo.prompts or demo["prompts"]

    base_tags = model_input_tags(base=base)
    sft = sft_task(base["model_dir"], sft_data, str(Path(config.sft.out).resolve()),
                   config.sft.train.model_dump(mode="json"), lineage=base_tags, eval_data=shards, **_stage_kw(config.sft))
    rm = reward_task(base["model_dir"], pref_data, str(Path(config.reward.out).resolve()),
                     config.reward.train.model_dump(mode="json"), lineage=base_tags, **_stage_kw(config.reward))
    policy = ppo_task(sft["model_dir"], rm["model_dir"], prompts, str(Path(config.ppo.out).resolve()),
                      config.ppo.train.model_dump(mode="json"),
                      lineage=model_input_tags(sft=sft, reward=rm), eval_data=shards,
                      **_stage_kw(config.ppo))
    result = {"sft": sft, "reward": rm, "ppo": policy}
    if config.dpo.enabled:
        result["dpo"] = dpo_task(sft["model_dir"], config.dpo.data or pref_data, str(Path(config.dpo.out).resolve()),
                                 config.dpo.train.model_dump(mode="json"), lineage=model_input_tags(sft=sft),
                                 eval_data=shards, **_stage_kw(config.dpo))
    return result


def _single_stage(name: str, config: Config, params: dict, body) -> dict:
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run(name, params):
        return body()


@flow(name="sft")
def sft_flow(config: Config = Config(), base: str = "runs/pretrain/model", data: str = "") -> dict:
    """Supervised fine-tuning of a base model folder on chat data (JSONL or Parquet)."""
    data = data or config.sft.data or ""
    return _single_stage("sft", config, {"base": base, "data": data}, lambda: sft_task(
        str(Path(base).resolve()), str(Path(data).resolve()), str(Path(config.sft.out).resolve()),
        config.sft.train.model_dump(mode="json"), lineage=folder_input_tags(base=base), **_stage_kw(config.sft)))


@flow(name="reward")
def reward_flow(config: Config = Config(), base: str = "runs/pretrain/model", data: str = "") -> dict:
    """A reward model from a base model folder and preference pairs."""
    data = data or config.reward.data or ""
    return _single_stage("reward", config, {"base": base, "data": data}, lambda: reward_task(
        str(Path(base).resolve()), str(Path(data).resolve()), str(Path(config.reward.out).resolve()),
        config.reward.train.model_dump(mode="json"), lineage=folder_input_tags(base=base), **_stage_kw(config.reward)))


@flow(name="ppo")
def ppo_flow(config: Config = Config(), policy: str = "runs/sft/model", reward: str = "runs/reward/model",
             prompts: str = "") -> dict:
    """PPO of an SFT policy against a reward model."""
    prompts = prompts or config.ppo.prompts or ""
    return _single_stage("ppo", config, {"policy": policy, "reward": reward, "prompts": prompts}, lambda: ppo_task(
        str(Path(policy).resolve()), str(Path(reward).resolve()), str(Path(prompts).resolve()),
        str(Path(config.ppo.out).resolve()), config.ppo.train.model_dump(mode="json"),
        lineage=folder_input_tags(sft=policy, reward=reward), **_stage_kw(config.ppo)))


@flow(name="dpo")
def dpo_flow(config: Config = Config(), policy: str = "runs/sft/model", data: str = "") -> dict:
    """DPO of an SFT policy on preference pairs."""
    data = data or config.dpo.data or ""
    return _single_stage("dpo", config, {"policy": policy, "data": data}, lambda: dpo_task(
        str(Path(policy).resolve()), str(Path(data).resolve()), str(Path(config.dpo.out).resolve()),
        config.dpo.train.model_dump(mode="json"), lineage=folder_input_tags(sft=policy), **_stage_kw(config.dpo)))
