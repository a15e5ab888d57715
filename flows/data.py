"""The data flow: crawl or read WARC/WET -> extract -> langid -> quality -> dedup
-> balance -> shards, rejected/, manifest.json -> review sample.

Each step is a Prefect task running a Ray Data job and recorded as an MLflow child
run under one parent run. Steps whose inputs and settings are unchanged are
skipped, so re-triggering a flow after a failure resumes where it stopped.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from crawl2chat.infra.config import Config
from crawl2chat.infra.tracking import pipeline_run, setup_tracking
from crawl2chat.tasks import data as t


def resolve_inputs(inputs: list[str]) -> list[str]:
    from crawl2chat.stages.warc_input import list_input_files

    return list_input_files(inputs) if inputs else []


def run_data_pipeline(config: Config) -> dict:
    """Run every data step inside the current flow; returns the manifest."""
    data = config.data
    out = str(Path(data.out).resolve())
    work = str(Path(out) / "work")
    files = resolve_inputs(data.inputs)
    if data.seed_urls or not data.inputs:
        crawl_cfg = data.crawl.model_copy(update={"seed_urls": data.seed_urls or data.crawl.seed_urls})
        files += t.crawl_task(crawl_cfg, out)
    extracted = t.extract_task(files, work, data.extract)
    identified = t.langid_task(extracted, work, data.langid)
    filtered = t.quality_task(identified, work, data.quality)
    deduped = t.dedup_task(filtered, work, data.dedup, data.previous_index)
    balanced = t.balance_task(deduped, work, data.balance)
    manifest = t.write_task(
        [extracted, identified, filtered, deduped, balanced], out, data.shard_bytes, config.model_dump(mode="json")
    )
    t.review_task(out, data.review)
    return manifest


@flow(name="data")
def data_flow(config: Config = Config()) -> dict:
    """Web pages to clean, language-tagged, deduplicated Parquet shards."""
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("data", {"data": config.data.model_dump(mode="json")}):
        return run_data_pipeline(config)
