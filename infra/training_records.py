"""MLflow records of a training run: its metrics file followed as it grows, its model folder logged and registered."""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric


class MetricsFollower:
    """Logs new complete lines of a training run's ``metrics.jsonl`` to the active MLflow run.

    After a resume or a rollback a step can appear twice; MLflow keeps both
    points, and the later one is the one the run continued from.
    """

    KEYS = ("loss", "lr", "grad_norm", "tokens_per_second", "mfu", "val_loss", "val_bpb",
            "reward_mean", "kl", "clip_fraction", "entropy", "value_loss", "response_length",
            "accuracy", "eval_accuracy", "eval_reward_accuracy", "kl_coef", "eos_rate", "policy_loss",
            "approx_kl", "value_clip_fraction", "reward_accuracy", "chosen_reward", "rejected_reward")

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
