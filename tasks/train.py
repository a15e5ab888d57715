"""Prefect tasks of the training stages: prepare on the host, launch under Accelerate, record.

A training stage runs as ``accelerate launch -m crawl2chat.stages.training.<stage>`` in a
subprocess (one process, DDP or FSDP as configured), so the distributed job owns
its processes while this task streams its log, follows ``OUT/metrics.jsonl`` into
MLflow as it grows (a thread polling every second; an MLflow outage buffers the
points and never stops training), and at the end logs the summary, the Hugging Face model
folder, and registers the model with lineage tags.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from crawl2chat.infra.mlflow_datasets import dataset_entity, file_dataset
from crawl2chat.infra.launch import LaunchError, NodeLayout, accelerate_command, run_streaming, simple_launch
from crawl2chat.infra.records import log_record, plot_curves
from crawl2chat.infra.run_folders import DONE_FILE, input_identity, link_latest, recorded_run, run_folder
from crawl2chat.infra.tracking import stage_run
from crawl2chat.infra.progress import StepProgress
from crawl2chat.infra.training_records import MetricsFollower, log_model_folder
from crawl2chat.stages.training.registry import STAGES
from crawl2chat.stages.locks import hold_folder
from crawl2chat.stages.secrets import mask_secrets
from crawl2chat.stages.training.failures import BAD_INPUT, FAILURE_FILE, TRANSIENT, StageFailed, read_failure
from crawl2chat.stages.training.stage import model_damage, script_argv


def launch_stage(module: str, argv: list[str], out: str | Path, num_processes: int = 1,
                 accelerate_config: str | None = None, on_line: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None, node: NodeLayout | None = None, cpu_share: int = 1,
                 meanwhile: Sequence[Callable[[], object]] = (), prepare: Callable[[], object] | None = None) -> int:
    """``accelerate launch -m module argv`` with its output streamed to ``OUT/train.log``
    (``OUT/train-node<r>.log`` for machine r > 0 of a job over several); ``cpu_share``: jobs
    training on this machine's cores at the same time (:func:`accelerate_command`). One
    process is started here as accelerate's simple launcher would start it
    (:func:`~crawl2chat.infra.launch.simple_launch`). ``meanwhile``: work done here while
    the ranks start up (:func:`~crawl2chat.infra.launch.run_streaming`). ``prepare``: the
    stage's host preparation; a process started here does it while the rank imports its
    libraries (:mod:`crawl2chat.stages.start_gate`), a launcher's ranks start after it."""
    import torch

    Path(out).mkdir(parents=True, exist_ok=True)
    cpu = not torch.cuda.is_available()
    cmd = accelerate_command(module, argv, num_processes=num_processes, accelerate_config=accelerate_config,
                             cpu=cpu, node=node, cpu_share=cpu_share)
    # The stage prints its own progress; library progress bars and load reports go unseen.
    quiet = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
    log = "train.log" if node is None or node.rank == 0 else f"train-node{node.rank}.log"
    allocator = training_allocator_env() if cpu else {}
    launcher_env: dict[str, str] = {}
    direct = simple_launch(cmd)
    if direct is not None:  # one process: started here as accelerate's launcher would start it
        cmd, launcher_env = direct
    elif prepare is not None:
        prepare()  # torchrun and DeepSpeed's launcher pass no word on to their ranks
        prepare = None
    return run_streaming(cmd, env={**allocator, **quiet, **(env or {}), **launcher_env}, log_path=Path(out) / log,
                         on_line=on_line, meanwhile=meanwhile, prepare=prepare)


# glibc's malloc, by default, gives freed memory at the top of the heap back to the system and
# serves blocks past an adaptive size with fresh mappings; a training step frees and allocates the
# same activations and gradients every step, so each step faults those pages back in (PPO's CPU
# loop: ~380k minor faults a run, ~150k with these). Fixed thresholds keep the pages mapped for
# the process's life: resident memory stays near its peak instead of falling between steps.
# Set where training runs on the CPU (where it was measured; on a GPU machine the host's memory
# holds offloaded state whose freed pages should go back). Other C libraries ignore the
# variables; a value set in the environment wins.
TRAINING_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def training_allocator_env() -> dict[str, str]:
    """The allocator settings a training process starts with, less those this environment sets."""
    return {k: v for k, v in TRAINING_ALLOCATOR_ENV.items() if k not in os.environ}


def launch_training(stage: str, inputs: dict[str, str], out: str | Path, max_steps: int | None = None,
                    config: str | None = None, overrides: list[str] | None = None, num_processes: int = 1,
                    accelerate_config: str | None = None, on_line: Callable[[str], None] | None = None,
                    env: dict[str, str] | None = None, nodes: int = 1, cpu_share: int = 1,
                    meanwhile: Sequence[Callable[[], object]] = ()) -> int:
    """Run the training stage ``stage`` (see the registry) under ``accelerate launch``;
    a stage that prepares on the host (pretraining's tokenizer and packing, on Ray)
    does that first, or, for one process on this machine, while that process imports
    its libraries (:mod:`crawl2chat.stages.start_gate`). ``nodes`` > 1: over that many machines of the Ray cluster
    (:func:`launch_across_nodes`). ``meanwhile``: work done here while the ranks
    start up, on one machine (:func:`launch_stage`). Raises :class:`StageFailed` with the kind the script
    reported, and :class:`~crawl2chat.stages.locks.FolderBusy` naming the holder's pid
    when another process is writing ``out``."""
    with hold_folder(out):  # one writer per run folder (re-entrant: record_training holds it already)
        if nodes > 1:
            return launch_across_nodes(stage, inputs, out, nodes, max_steps, config, overrides, num_processes,
                                       accelerate_config, env)
        return _launch_training(stage, inputs, out, max_steps, config, overrides, num_processes, accelerate_config,
                                on_line, env, cpu_share=cpu_share, meanwhile=meanwhile)


def _launch_training(stage, inputs, out, max_steps, config, overrides, num_processes, accelerate_config,
                     on_line, env, node: NodeLayout | None = None, prepare: bool = True, cpu_share: int = 1,
                     meanwhile: Sequence[Callable[[], object]] = ()) -> int:
    import importlib

    spec = STAGES[stage]
    argv = script_argv(inputs, out, config, max_steps, overrides)
    Path(out).mkdir(parents=True, exist_ok=True)
    if prepare:
        (Path(out) / FAILURE_FILE).unlink(missing_ok=True)
    prepare_here = None
    if prepare and spec.prepare_on_host:
        from crawl2chat.stages.training.packing import packs_on_ray

        def prepare_data():
            try:
                importlib.import_module(spec.module).prepare_on_host(argv)
            except (ValueError, FileNotFoundError) as e:  # the data cannot make this run: say so, do not retry
                raise StageFailed(stage, BAD_INPUT, str(e).strip().splitlines()[0], Path(out) / "train.log") from e

        on_ray = any(packs_on_ray(v) for v in inputs.values())  # small shards are packed in this process
        if on_ray:
            from crawl2chat.infra.ray_runtime import ensure_ray, release_local_ray

            ensure_ray()
            prepare_data()
            release_local_ray()  # the training processes get the cores a local Ray would keep busy
        else:  # in this process, while the rank starts (launch_stage)
            prepare_here = prepare_data
    try:
        return launch_stage(spec.module, argv, out, num_processes, accelerate_config, on_line, env, node, cpu_share,
                            meanwhile, prepare=prepare_here)
    except LaunchError as e:
        failure = read_failure(out) or {"kind": TRANSIENT, "message": f"the training process exited with status "
                                                                      f"{e.returncode} without reporting why"}
        raise StageFailed(stage, failure["kind"], failure["message"], e.log_path) from e


def launch_across_nodes(stage: str, inputs: dict[str, str], out: str | Path, nodes: int,
                        max_steps: int | None = None, config: str | None = None, overrides: list[str] | None = None,
                        num_processes: int = 1, accelerate_config: str | None = None,
                        env: dict[str, str] | None = None, placement: str = "STRICT_SPREAD") -> int:
    """The training stage over ``nodes`` machines of the Ray cluster this process is
    connected to (``RAY_ADDRESS``): a placement group reserves one slot on each of
    ``nodes`` different machines (``STRICT_SPREAD``), the first machine's address and a
    free port there become the rendezvous, and a Ray task on each machine runs
    ``accelerate launch`` with its machine rank (``num_processes`` in total, split
    evenly). Preparation (tokenizer, packing) runs here first, once. ``out`` must be a
    folder every machine sees (a shared filesystem): the ranks read the prepared data
    and write checkpoints there; machine r > 0 logs to ``OUT/train-node<r>.log``.
    A failed launcher cancels the others; the error is the first one raised."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from crawl2chat.infra.ray_runtime import ensure_ray

    from crawl2chat.stages.settings import SettingsError

    if num_processes % nodes:
        raise SettingsError(f"num_processes={num_processes} must split evenly over nodes={nodes}")
    spec = STAGES[stage]
    argv = script_argv(inputs, out, config, max_steps, overrides)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / FAILURE_FILE).unlink(missing_ok=True)
    ensure_ray()
    if spec.prepare_on_host:
        import importlib

        importlib.import_module(spec.module).prepare_on_host(argv)
    machines = len({n["NodeID"] for n in ray.nodes() if n.get("Alive")})
    if placement == "STRICT_SPREAD" and machines < nodes:
        raise SettingsError(f"nodes={nodes} needs {nodes} machines in the Ray cluster; it has {machines} "
                            f"(start Ray on more machines, or lower nodes)")
    group = placement_group([{"CPU": 1}] * nodes, strategy=placement)
    try:
        ray.get(group.ready(), timeout=120)
        on = [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(nodes)]
        remote = ray.remote(num_cpus=1, max_retries=0)
        main_ip, main_port = ray.get(remote(_rendezvous_address).options(scheduling_strategy=on[0]).remote())
        launchers = [remote(_launch_node).options(scheduling_strategy=on[i]).remote(
            stage, inputs, str(out), max_steps, config, overrides, num_processes, accelerate_config, env,
            NodeLayout(nodes, i, main_ip, main_port)) for i in range(nodes)]
        try:
            pending = list(launchers)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done[0])  # the first failure raises here
        except BaseException:
            for ref in launchers:
                ray.cancel(ref, force=True)
            raise
    finally:
        remove_placement_group(group)
    return 0


def _rendezvous_address() -> tuple[str, int]:
    """This machine's address in the Ray cluster and a port free on it."""
    import socket

    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return ip, sock.getsockname()[1]


def _launch_node(stage, inputs, out, max_steps, config, overrides, num_processes, accelerate_config, env,
                      node: NodeLayout) -> int:
    return _launch_training(stage, inputs, out, max_steps, config, overrides, num_processes, accelerate_config,
                            None, env, node=node, prepare=False)



# Lines of a Python traceback as the interpreter prints it: its header, the chained
# exceptions' joins, and everything indented under them up to the exception's own line.
TRACEBACK_START = "Traceback (most recent call last):"
TRACEBACK_JOINS = ("During handling of the above exception, another exception occurred:",
                   "The above exception was the direct cause of the following exception:")


def _progress_printer(stage: str) -> Callable[[str], None]:
    """Echo the script's own lines with a stage prefix (the metrics file is followed
    by a :class:`MetricsFollower` thread, not from here). A failing script's traceback
    stays in ``OUT/train.log``: the script's last line and the command's say what failed."""

    from crawl2chat.infra.console import is_chatter, verbose

    in_trace = False

    def on_line(line: str) -> None:
        nonlocal in_trace
        if not verbose():
            if line.startswith(TRACEBACK_START) or line.strip() in TRACEBACK_JOINS:
                in_trace = True
                return
            if in_trace:
                # Indented frames, blank lines, then the unindented "Error: message" ends it.
                in_trace = not line.strip() or line[:1].isspace()
                return
        # The closing JSON summary is printed by the task in a line of its own; library
        # notices stay in OUT/train.log.
        if line.strip() and not line.startswith("{") and not is_chatter(line):
            print(f"[{stage}] {line}", flush=True)

    return on_line


def _figures(summary: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a summary (a figure that could not be measured is no metric)."""
    return {k: float(v) for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def evaluation_metrics(result: dict) -> dict[str, float]:
    """An evaluation's finite figures under the metric names runs record: ``eval.<section>.<key>``."""
    return {f"eval.{section}.{key}": float(value)
            for section in ("lm", "mc", "policy") for key, value in (result.get(section) or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


def log_evaluation(result: dict) -> dict[str, float]:
    """Evaluation figures as ``eval.*`` metrics, generations as a table, the whole as JSON."""
    flat = evaluation_metrics(result)
    mlflow.log_metrics(flat)
    if result.get("split"):  # which documents were evaluated: the model's held-out split, or "all"
        mlflow.set_tag("crawl2chat.eval_split", result["split"])
    generations = result.get("generations") or []
    if generations:
        mlflow.log_table({"prompt": [g["prompt"] for g in generations],
                          "completion": [g["completion"] for g in generations]}, "eval/generations.json")
    mlflow.log_dict(result, "eval/evaluation.json")
    return flat


def evaluate_causal_lm(model_dir: str, eval_data: str | None, chat: bool) -> dict:
    """Bits per byte, perplexity and multiple choice on the documents of ``eval_data``
    held out by the split recorded with the model (the base model's, carried by every
    later stage), plus sample generations; ``result["split"]`` names the split."""
    from crawl2chat.stages.inference.evaluate import evaluate_model

    return evaluate_model(model_dir, eval_data, mc_tasks=50 if eval_data else 0, max_docs=200, max_tokens=50_000,
                          chat=chat)


def log_data_inputs(inputs: dict[str, str], identities: dict[str, str]) -> None:
    """Data files and dataset versions among a stage's inputs as MLflow dataset inputs
    (model folders are linked by run tags instead)."""
    from crawl2chat.stages.data.versions import read_manifest

    for role, path in inputs.items():
        if not path:
            continue
        if Path(path).is_file():
            mlflow.log_input(file_dataset(path, identities[role].removeprefix("sha256:")), context=role)
        elif manifest := read_manifest(path):
            mlflow.log_input(dataset_entity(manifest, path), context=role)


def record_training(stage: str, out: str, settings: dict[str, Any], launch: Callable[[str, Callable, str], Any],
                    inputs: dict[str, str], lineage: dict[str, str] | None, registered_name: str | None,
                    extra_artifacts: Callable[[dict], None] | None = None,
                    evaluate: Callable[[dict], dict] | None = None,
                    params: dict[str, Any] | None = None, launch_key: dict[str, Any] | None = None) -> dict:
    """Run one training stage inside its MLflow child run: settings file, launch, metrics,
    model folder, registration, lineage tags. Returns the stage's summary.

    ``inputs`` (role -> path) are logged as parameters (with ``params``) and key
    the run folder (:func:`run_folder`): a re-triggered pipeline finds its
    finished stages and reuses them (unless the model's files fail their
    checksums). The run folder is held (:func:`hold_folder`) throughout.
    """
    identities = {role: input_identity(path) for role, path in sorted(inputs.items()) if path}
    run_dir = run_folder(out, stage, inputs, identities, settings, launch_key)
    with hold_folder(run_dir):  # one writer per run folder, from the reuse check to the done marker
        return _record_training(stage, out, run_dir, settings, launch, inputs, identities, lineage, registered_name,
                                extra_artifacts, evaluate, params)


def _record_training(stage, out, run_dir, settings, launch, inputs, identities, lineage, registered_name,
                     extra_artifacts, evaluate, params) -> dict:
    import yaml

    done = recorded_run(run_dir)
    if done and (damage := model_damage(run_dir / "model")):
        print(f"[{stage}] {damage}; training again", flush=True)
        done = None
    if done:
        link_latest(out, run_dir)
        print(f"[{stage}] already trained on these inputs with these settings: {done['model_dir']} "
              f"(MLflow run {done['run_id']})", flush=True)
        return done
    config_file = run_dir / f"{stage}_config.yaml"
    config_file.write_text(yaml.safe_dump(settings, sort_keys=False))
    with stage_run(stage, {stage: settings, **inputs, **(params or {})}, tags=lineage) as run:
        log_data_inputs(inputs, identities)
        mlflow.set_tag("crawl2chat.run_key", run_dir.name)
        # Step metrics reach MLflow while the run trains, each with its own step and time;
        # a tracking outage buffers them and never stops the training.
        progress = StepProgress(stage, settings.get("max_steps"))
        with MetricsFollower(run_dir / "metrics.jsonl", run.info.run_id, on_step=progress):
            launch(str(config_file), _progress_printer(stage), str(run_dir))
        progress.close()
        summary = json.loads((run_dir / "metrics.json").read_text())
        mlflow.log_metrics(_figures(summary))
        mlflow.log_artifact(str(run_dir / "metrics.json"))
        if summary.get("split"):  # the held-out split the stage made (pretraining)
            mlflow.set_tag("crawl2chat.split", summary["split"])
        if extra_artifacts:
            extra_artifacts(summary)
        model_dir = run_dir / "model"
        summary["model_dir"] = str(model_dir)
        mlflow.set_tag("crawl2chat.model_dir", str(model_dir))
        summary["model_uri"] = log_model_folder(model_dir, registered_name, "current")
        summary["run_id"] = run.info.run_id
        from crawl2chat.stages.training.trainer import read_metrics

        rows = read_metrics(run_dir / "metrics.jsonl")
        plot_curves(rows, ("loss", "val_loss"), f"{stage}: loss", f"{stage}_loss.png")
        plot_curves(rows, ("reward_mean", "kl"), f"{stage}: reward and KL", f"{stage}_reward_kl.png")
        if evaluate:
            # The last step of every training stage: the model as a user would judge it.
            try:
                summary["eval"] = log_evaluation(evaluate(summary))
            except Exception as e:  # noqa: BLE001 - a failed evaluation is recorded, the model stays
                mlflow.set_tag("crawl2chat.eval_error", f"{type(e).__name__}: {e}"[:5000])
                print(f"[{stage}] evaluation failed: {type(e).__name__}: {e}", flush=True)
        log_record(STAGES[stage].goal, settings, {**inputs, **(params or {})},
                   _figures({**summary, **summary.get("eval", {})}))
    summary["tracking_uri"] = mask_secrets(mlflow.get_tracking_uri())  # a server password stays out of the run folder
    # Written last and renamed into place: its presence means trained and recorded.
    tmp = run_dir / f".{DONE_FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, run_dir / DONE_FILE)
    link_latest(out, run_dir)
    return summary


def retry_transient(task, task_run, state) -> bool:  # noqa: ARG001 - Prefect's retry_condition_fn signature
    """Retry a training launch that died of something passing (a killed process, a lost
    peer, an out-of-memory kill); the retry resumes from the newest checkpoint. The
    script's own report decides: bad input and divergence are not retried."""
    try:
        state.result()
    except StageFailed as e:
        return not e.permanent
    except Exception:  # noqa: BLE001 - anything raised on this side is not the launch's
        return False
    return False


def _evaluation(stage: str, inputs: dict[str, str], settings: dict[str, Any],
                eval_data: str | None) -> Callable[[dict], dict] | None:
    """The end-of-stage evaluation the registry names for ``stage``."""
    kind = STAGES[stage].evaluation
    if kind == "lm":
        return lambda s: evaluate_causal_lm(s["model_dir"], inputs["data"], chat=False)
    if kind == "chat":
        return lambda s: evaluate_causal_lm(s["model_dir"], eval_data, chat=True)
    if kind == "policy":
        return lambda s: _evaluate_policy(s["model_dir"], inputs["policy"], inputs["reward"], inputs["prompts"],
                                          eval_data)
    return None


def _evaluation_imports(stage: str) -> list[Callable[[], object]]:
    """What the stage's end-of-stage evaluation imports to load the model (~3 s on a small
    CPU), to do while the training processes start up instead of after they end."""
    import functools
    import importlib

    if STAGES[stage].evaluation is None:
        return []
    from crawl2chat.stages.inference.generation import MODEL_MODULES

    return [functools.partial(importlib.import_module, name) for name in MODEL_MODULES]


def _evaluate_policy(policy_dir: str, parent_dir: str, reward_dir: str, prompts_file: str,
                     eval_data: str | None, n_prompts: int = 16) -> dict:
    """A policy's LM figures plus its win rate against its SFT parent under the reward model."""
    from crawl2chat.stages.inference.evaluate import prompt_texts, win_rate

    result = evaluate_causal_lm(policy_dir, eval_data, chat=True)
    prompts = prompt_texts(prompts_file)[-n_prompts:]  # the last prompts: not among the earliest rollouts
    result["policy"] = win_rate(policy_dir, parent_dir, reward_dir, prompts, max_new_tokens=16)
    return result


SIZING_FILE = "sizing.json"


def sized_settings(stage: str, out: str, settings: dict[str, Any], minutes: float,
                   num_processes: int = 1) -> dict[str, Any]:
    """``settings`` with ``max_steps`` lowered to the steps that fit in ``minutes`` here
    (:mod:`crawl2chat.stages.training.sizing`). The decision is kept in
    ``OUT/sizing.json`` under the other settings' digest, so a rerun or a resume on the
    same folder trains the same steps (and finds its run folder) however the machine's
    speed varies; new settings or minutes are timed anew."""
    import hashlib

    path = Path(out) / SIZING_FILE
    basis = {k: v for k, v in settings.items() if k != "max_steps"}
    key = hashlib.sha256(json.dumps([basis, settings["max_steps"], minutes, num_processes], sort_keys=True,
                                    default=str).encode()).hexdigest()[:16]
    path.parent.mkdir(parents=True, exist_ok=True)
    with hold_folder(path.parent, wait=120):  # one writer of sizing.json; no two timings at once
        record = _sizing_record(path, key, settings, minutes, num_processes)
    fit = ("all of them fit" if record["steps"] >= record["max_steps"]
           else f"{record['steps']} fit, of max_steps {record['max_steps']} (remove {SIZING_FILE} to time again, "
                f"or --set {stage}.minutes=null to train them all)")
    print(f"[{stage}] {record['minutes']:g} minutes of training steps at {record['step_seconds']:.2f} s a step "
          f"(timed here, {path}): {fit}", flush=True)
    return {**settings, "max_steps": record["steps"]}


def _sizing_record(path: Path, key: str, settings: dict[str, Any], minutes: float, num_processes: int) -> dict:
    from crawl2chat.stages.training.sizing import steps_within, time_train_step

    records = json.loads(path.read_text()) if path.is_file() else {}
    record = records.get(key)
    if record is None:
        vocab = int(settings["vocab_size"])
        if settings.get("tokenizer") and (Path(settings["tokenizer"]) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(str(Path(settings["tokenizer"]) / "tokenizer.json")).get_vocab_size()
        step_seconds = time_train_step(settings, vocab, num_processes)
        if steps_within(minutes, step_seconds, int(settings["max_steps"]), 1) < int(settings["max_steps"]):
            # Fewer steps than asked for: timed once more, the faster reading kept (a busy moment
            # of the machine would otherwise shorten this folder's runs for good).
            step_seconds = min(step_seconds, time_train_step(settings, vocab, num_processes))
        least = 2 * int(settings.get("warmup_steps") or 0) or 1
        record = {"steps": steps_within(minutes, step_seconds, int(settings["max_steps"]), least),
                  "step_seconds": step_seconds, "minutes": minutes, "max_steps": settings["max_steps"]}
        tmp = path.with_name(f".{SIZING_FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({**records, key: record}, indent=2) + "\n")
        os.replace(tmp, path)
    return record


def launch_key(num_processes: int, nodes: int, accelerate_config: str | None) -> dict[str, Any] | None:
    """What of a launch keys its run folder: anything but one plain process (whose runs keep
    the keys they had before launches were part of it)."""
    if num_processes == 1 and nodes == 1 and not accelerate_config:
        return None
    return {"num_processes": num_processes, "nodes": nodes, "accelerate_config": accelerate_config}


def train_stage(stage: str, inputs: dict[str, str], out: str, settings: dict[str, Any], num_processes: int = 1,
                accelerate_config: str | None = None, lineage: dict[str, str] | None = None,
                registered_name: str | None = None, eval_data: str | None = None, nodes: int = 1,
                cpu_share: int = 1, minutes: float | None = None) -> dict:
    """One training stage of the registry, recorded: launch, metrics, model, registration,
    evaluation. ``nodes`` > 1: launched over that many machines of the Ray cluster.
    ``cpu_share``: stages training side by side on this machine's CPU (each rank takes
    that share of the cores). ``minutes``: ``max_steps`` lowered to what fits in that
    many minutes of this machine (:func:`sized_settings`)."""
    spec = STAGES[stage]
    if minutes is not None:
        settings = sized_settings(stage, out, settings, minutes, num_processes)

    def launch(config_file: str, on_line: Callable, run_dir: str) -> None:
        if nodes > 1:
            print(f"[{stage}] launching {num_processes} processes over {nodes} machines of the Ray cluster; "
                  f"their output is in {run_dir}/train*.log", flush=True)
        launch_training(stage, inputs, run_dir, config=config_file, on_line=on_line, num_processes=num_processes,
                        accelerate_config=accelerate_config, nodes=nodes, cpu_share=cpu_share,
                        meanwhile=_evaluation_imports(stage))

    def artifact_dirs(summary: dict) -> None:
        for key in spec.artifact_dirs:
            mlflow.log_artifacts(summary[key], artifact_path=key)
            mlflow.set_tag(f"crawl2chat.{key}", summary[key])

    summary = record_training(stage, out, settings, launch, inputs, lineage, registered_name, artifact_dirs,
                              evaluate=_evaluation(stage, inputs, settings, eval_data),
                              params={"num_processes": num_processes, "nodes": nodes, "cpu_share": cpu_share,
                                      **({"minutes": minutes} if minutes is not None else {})},
                              launch_key=launch_key(num_processes, nodes, accelerate_config))
    print(f"[{stage}] {spec.report(summary)} -> {summary['model_dir']}", flush=True)
    return summary


# One Prefect task for every training stage; ``training_task(name)`` names its runs after the stage.
_train_task = task(train_stage, name="train-stage", retries=1, retry_delay_seconds=10,
                   retry_condition_fn=retry_transient, cache_policy=NO_CACHE)


def training_task(stage: str):
    return _train_task.with_options(name=stage)


@task(name="demo-sets", retries=0, cache_policy=NO_CACHE)
def demo_sets_task(shards_dir: str, out: str, examples: int, seed: int, base_model: str | None = None) -> dict[str, str]:
    """Small SFT, preference and prompt sets derived from the crawled corpus itself: never
    from documents the base model's split holds out, drawn by the balance weights."""
    from crawl2chat.stages.training.chat_data import derive_demo_sets
    from crawl2chat.stages.training.heldout import read_split

    split = read_split(base_model) if base_model else None
    with stage_run("demo-sets", {"examples": examples, "seed": seed, "shards": shards_dir}):
        paths = derive_demo_sets(shards_dir, out, n=examples, seed=seed, split=split)
        summary = json.loads(Path(paths["summary"]).read_text())
        mlflow.set_tag("crawl2chat.split", summary["split"])
        mlflow.log_metrics({k: v for k, v in summary.items() if k.startswith("share.")})
        for path in paths.values():
            mlflow.log_artifact(path, artifact_path="demo_sets")
    print(f"[demo-sets] SFT, preference and prompt sets -> {out}", flush=True)
    return paths


def _evaluated(kind: str, models: dict[str, str], questions_file: str, **params: Any) -> Path:
    """Where the result of the ``kind`` evaluation of these models (the run folders their
    paths resolve to) on this questions file's content is kept: a rerun whose stages
    were all reused reads it instead of generating again."""
    import hashlib

    key = json.dumps({"kind": kind, "models": {name: str(Path(m).resolve()) for name, m in models.items()},
                      "questions": hashlib.sha256(Path(questions_file).read_bytes()).hexdigest(), **params},
                     sort_keys=True)
    return Path(questions_file).parent / "evaluations" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _keep(path: Path, result: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


@task(name="questions", retries=0, cache_policy=NO_CACHE)
def questions_task(models: dict[str, str], questions_file: str) -> dict[str, dict]:
    """Each model on held-out reference questions as multiple choice (the page's own
    answer among other pages' answers; :func:`question_accuracy`): whether the chain's
    stages make the right answer more likely, in one figure per model."""
    from crawl2chat.stages.inference.evaluate import question_accuracy

    kept = _evaluated("questions", models, questions_file)
    if kept.exists():
        print(f"[questions] these models were scored on these questions already ({kept})", flush=True)
        return json.loads(kept.read_text())
    rows = [json.loads(line) for line in Path(questions_file).read_text().splitlines() if line.strip()]
    result = {name: question_accuracy(model_dir, rows) for name, model_dir in models.items()}
    with stage_run("questions", {"models": models, "questions": questions_file}):
        mlflow.log_metrics({f"{name}.{key}": float(value) for name, figures in result.items()
                            for key, value in figures.items()})
    _keep(kept, result)
    return result


@task(name="showcase", retries=0, cache_policy=NO_CACHE)
def showcase_task(models: dict[str, str], questions_file: str, max_new_tokens: int = 40,
                  repetition_penalty: float = 1.2) -> list[dict]:
    """The same held-out questions answered by each model (greedy, with the
    repetition penalty ``crawl2chat chat`` uses), side by side, with the page's
    own answer: what the chain taught, in a form a person reads."""
    from crawl2chat.stages.inference.evaluate import sample_generations

    kept = _evaluated("showcase", models, questions_file, max_new_tokens=max_new_tokens,
                      repetition_penalty=repetition_penalty)
    if kept.exists():
        print(f"[showcase] these models answered these questions already ({kept})", flush=True)
        return json.loads(kept.read_text())
    rows = [json.loads(line) for line in Path(questions_file).read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows]
    answers = {name: [g["completion"].strip() for g in sample_generations(
        model_dir, prompts, chat=True, max_new_tokens=max_new_tokens, repetition_penalty=repetition_penalty)]
               for name, model_dir in models.items()}
    table = [{"prompt": p, "reference": r.get("reference", ""), **{name: answers[name][i] for name in models}}
             for i, (p, r) in enumerate(zip(prompts, rows))]
    with stage_run("showcase", {"models": models, "questions": questions_file}):
        mlflow.log_table({k: [row[k] for row in table] for k in table[0]}, "showcase.json")
    _keep(kept, table)
    return table
