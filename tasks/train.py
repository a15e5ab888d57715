"""Prefect tasks of the training stages: prepare on the host, launch under Accelerate, record.

A training stage runs as ``accelerate launch -m crawl2chat.stages.<stage>`` in a
subprocess (one process, DDP or FSDP as configured), so the distributed job owns
its processes while this task streams its log, follows ``OUT/metrics.jsonl`` into
MLflow as it grows, and at the end logs the summary, the Hugging Face model
folder, and registers the model with lineage tags.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from crawl2chat.infra.launch import accelerate_command, run_streaming
from crawl2chat.infra.tracking import stage_run


class MetricsFollower:
    """Logs new complete lines of a training run's ``metrics.jsonl`` to the active MLflow run.

    After a resume or a rollback a step can appear twice; MLflow keeps both
    points, and the later one is the one the run continued from.
    """

    KEYS = ("loss", "lr", "grad_norm", "tokens_per_second", "mfu", "val_loss", "val_bpb",
            "reward_mean", "kl", "clip_fraction", "entropy", "value_loss", "response_length",
            "accuracy", "eval_accuracy", "eval_reward_accuracy")

    def __init__(self, path: Path, run_id: str):
        self.path = path
        self.run_id = run_id
        self.offset = 0
        self.client = mlflow.MlflowClient()
        self.events: list[dict] = []

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete, _, _ = chunk.rpartition("\n")
        if not complete:
            return
        self.offset += len(complete.encode("utf-8")) + 1
        metrics = []
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("type") == "event":
                self.events.append(row)
                continue
            step = int(row.get("step", 0))
            for key in self.KEYS:
                value = row.get(key)
                if isinstance(value, (int, float)) and value == value:  # skip NaN
                    metrics.append(Metric(key, float(value), now, step))
        for i in range(0, len(metrics), 900):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 900])


def launch_stage(module: str, argv: list[str], out: str | Path, num_processes: int = 1,
                 accelerate_config: str | None = None, on_line: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None) -> int:
    """``accelerate launch -m module argv`` with its output streamed to ``OUT/train.log``."""
    import torch

    cmd = accelerate_command(module, argv, num_processes=num_processes, accelerate_config=accelerate_config,
                             cpu=not torch.cuda.is_available())
    return run_streaming(cmd, env=env, log_path=Path(out) / "train.log", on_line=on_line)


def run_pretraining(data: str, out: str, preset: str | None = None, max_steps: int | None = None,
                    num_processes: int = 1, config: str | None = None, overrides: list[str] | None = None,
                    accelerate_config: str | None = None, on_line: Callable[[str], None] | None = None,
                    env: dict[str, str] | None = None) -> int:
    """Tokenizer and packed tokens on the host (Ray lives here, not inside the
    distributed job), then the training script under ``accelerate launch``."""
    from crawl2chat.infra.ray_runtime import ensure_ray
    from crawl2chat.stages.pretrain import MODULE, parse_args, prepare_data, resolve_config, script_args

    argv = script_args(data, out, preset, max_steps, config, overrides)
    cfg = resolve_config(parse_args(argv))
    Path(out).mkdir(parents=True, exist_ok=True)
    if Path(data).is_dir():
        ensure_ray()
    prepare_data(cfg, data, out)
    return launch_stage(MODULE, argv, out, num_processes, accelerate_config, on_line, env)


def _progress_printer(stage: str, follower: MetricsFollower | None, every: int = 20) -> Callable[[str], None]:
    """Echo the script's own lines with a stage prefix, and follow the metrics file."""
    count = {"n": 0}

    def on_line(line: str) -> None:
        count["n"] += 1
        if line.strip():
            print(f"[{stage}] {line}", flush=True)
        if follower and count["n"] % every == 0:
            follower.poll()

    return on_line


def log_model_folder(model_dir: Path, registered_name: str | None, alias: str | None) -> str | None:
    """Log the Hugging Face folder as run artifacts and register it; returns the model URI."""
    mlflow.log_artifacts(str(model_dir), artifact_path="model")
    run_id = mlflow.active_run().info.run_id
    uri = f"runs:/{run_id}/model"
    if not registered_name:
        return uri
    # The folder is a plain Hugging Face model (safetensors), not an MLflow flavour,
    # so the version is created from its artifact location directly.
    client = mlflow.MlflowClient()
    try:
        client.get_registered_model(registered_name)
    except mlflow.exceptions.MlflowException:
        client.create_registered_model(registered_name, description="crawl2chat model (Hugging Face format)")
    version = client.create_model_version(registered_name, source=mlflow.get_artifact_uri("model"), run_id=run_id,
                                          tags={"format": "huggingface"})
    if alias:
        client.set_registered_model_alias(registered_name, alias, version.version)
    return f"models:/{registered_name}/{version.version}"


@task(name="pretrain", retries=0, cache_policy=NO_CACHE)
def pretrain_task(data: str, out: str, settings: dict[str, Any], num_processes: int = 1,
                  accelerate_config: str | None = None, lineage: dict[str, str] | None = None,
                  registered_name: str | None = "crawl2chat-base") -> dict:
    """Tokenizer + base model from the data stage's shards (or a text file)."""
    import yaml

    out_path = Path(out)
    out_path.mkdir(parents=True, exist_ok=True)
    config_file = out_path / "pretrain_config.yaml"
    config_file.write_text(yaml.safe_dump(settings, sort_keys=False))
    with stage_run("pretrain", {"pretrain": settings, "num_processes": num_processes,
                                "data": data}, tags=lineage) as run:
        follower = MetricsFollower(out_path / "metrics.jsonl", run.info.run_id)
        run_pretraining(data, out, config=str(config_file), num_processes=num_processes,
                        accelerate_config=accelerate_config, on_line=_progress_printer("pretrain", follower))
        follower.poll()
        summary = json.loads((out_path / "metrics.json").read_text())
        mlflow.log_metrics({k: float(v) for k, v in summary.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
        mlflow.log_artifact(str(out_path / "metrics.json"))
        mlflow.log_artifacts(str(Path(summary["tokenizer"])), artifact_path="tokenizer")
        mlflow.set_tags({"crawl2chat.tokenizer": summary["tokenizer"], "crawl2chat.model_dir": summary["model_dir"]})
        summary["model_uri"] = log_model_folder(Path(summary["model_dir"]), registered_name, "current")
        summary["run_id"] = run.info.run_id
    print(f"[pretrain] val_loss {summary.get('val_loss'):.3f}  val_bpb {summary.get('val_bpb'):.3f}  "
          f"{summary.get('tokens_per_second', 0):.0f} tokens/s -> {summary['model_dir']}", flush=True)
    return summary
