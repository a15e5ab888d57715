"""The full pipeline and the training flows.

``pipeline``: crawl/ingest -> data stage -> tokenizer + pretraining, under one
MLflow parent run with a child run per stage. ``pretrain``: a base model from
existing shards or a text file.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from crawl2chat.flows.data import run_data_pipeline
from crawl2chat.infra.config import Config
from crawl2chat.infra.lineage import input_tags
from crawl2chat.infra.tracking import pipeline_run, setup_tracking
from crawl2chat.tasks.train import pretrain_task


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
def pipeline_flow(config: Config = Config()) -> dict:
    """Every stage end to end: web pages to shards to a base model."""
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("pipeline", {"config": config.model_dump(mode="json")}) as run:
        manifest = run_data_pipeline(config)
        data_out = str(Path(config.data.out).resolve())
        lineage = {"crawl2chat.data_digest": manifest["content_digest"], "crawl2chat.data_path": data_out,
                   **input_tags(data=manifest["mlflow_run_id"])}
        base = _pretrain(config, data_out, lineage)
        return {"data": data_out, "manifest": manifest, "pretrain": base, "run_id": run.info.run_id}


@flow(name="pretrain")
def pretrain_flow(config: Config = Config(), data: str = "runs/data") -> dict:
    """A tokenizer and base model from a data-stage output folder or a plain text file."""
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("pretrain", {"pretrain": config.pretrain.model_dump(mode="json"), "data": data}):
        data = str(Path(data).resolve())
        return _pretrain(config, data, {"crawl2chat.data_path": data})
