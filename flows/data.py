"""The data flow: crawl or read WARC/WET -> extract -> langid -> quality -> dedup
-> balance -> (augment) -> shards, rejected/, manifest.json -> review sample.

Each step is a Prefect task running a Ray Data job (or, for a small input, the same
operations in this process: :mod:`~crawl2chat.stages.data.engine`) and recorded as
an MLflow child run under one parent run. Steps whose inputs and settings are unchanged are
skipped, so re-triggering a flow after a failure resumes where it stopped.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from crawl2chat.stages.data.engine import choose as choose_engine, local_limit_mb
from crawl2chat.stages.data.versions import remove_leftovers
from crawl2chat.stages.locks import hold_folder
from crawl2chat.stages.settings import Config, apply_profile
from crawl2chat.infra.console import keep_run_traces
from crawl2chat.infra.tracking import pipeline_run, setup_tracking
from crawl2chat.tasks import data as t


def build_settings(data) -> dict:
    """The data settings that shape a version's content (not where it is written)."""
    exclude = {"out", "inputs", "seed_urls", "refresh", "crawl", "review", "engine", "local_max_mb"}
    if not data.augment.enabled:  # augmentation off: versions built before it existed stay up to date
        exclude.add("augment")
    return data.model_dump(mode="json", exclude=exclude)


def engine_line(engine: str, setting: str, local_max_mb: float | None) -> str:
    """How the build line names the engine and why it was picked."""
    if engine == "local":
        if setting != "auto":
            return "in this process"
        return (f"in this process (input up to data.local_max_mb, {local_limit_mb(local_max_mb):g} MB here; "
                f"data.engine=ray to use Ray)")
    return "on Ray"


def with_refresh(config: Config, refresh: bool) -> Config:
    """The configuration with ``data.refresh`` switched on by a flow's ``refresh`` parameter."""
    if not refresh:
        return config
    return config.model_copy(update={"data": config.data.model_copy(update={"refresh": True})})


def run_data_pipeline(config: Config) -> dict:
    """Build the next dataset version inside the current flow; returns its manifest.

    With ``data.refresh`` only the input files no earlier version has read go
    through the steps (a re-crawl's new WARC files), deduplicated against every
    earlier version; otherwise every input file is read into a new chain. A
    build whose inputs and settings equal the current version's does nothing.
    The folder is held for the whole build
    (:func:`~crawl2chat.stages.locks.hold_folder`): a second build of it is
    refused with the holder's pid.
    """
    embedded_site = not (config.data.inputs or config.data.seed_urls or config.data.crawl.seed_urls)
    data, changed = apply_profile(config.data, embedded_site)
    config = config.model_copy(update={"data": data})
    if changed:
        print(f"[data] rule profile '{data.profile}': {len(changed)} settings relaxed for documentation pages "
              "(listed in review.md)", flush=True)
    out = str(Path(data.out).resolve())
    with hold_folder(out):  # one build at a time per data folder
        removed = remove_leftovers(out)
        if removed:
            print(f"[data] removed {len(removed)} temporary files left by an interrupted build in {out}", flush=True)
        return _build(config, out)


def _build(config: Config, out: str) -> dict:
    data = config.data
    files = t.list_inputs(data.inputs)
    if data.seed_urls or not data.inputs:
        crawl_cfg = data.crawl.model_copy(update={"seed_urls": data.seed_urls or data.crawl.seed_urls})
        files += t.crawl_task(crawl_cfg, out, data.refresh, only_input=not files)
    plan = t.plan_version_task(out, files, build_settings(data), data.refresh, data.previous_index)
    if plan.up_to_date:
        manifest = t.current_version_task(out, plan)
        if not (Path(out) / "review.md").exists():  # a build killed between its commit and its review
            t.review_task(out, data.review)
        return manifest
    what = f"refresh: {len(plan.files)} new input files" if plan.refresh else f"{len(plan.files)} input files"
    engine = choose_engine(data.engine, plan.files, data.local_max_mb)
    where = engine_line(engine, data.engine, data.local_max_mb)
    print(f"[data] building {plan.name} ({what}) -> {out} [{where}]", flush=True)
    work = plan.work_dir
    extracted = t.extract_task(plan.files, work, data.extract, engine, plan.site_templates)
    identified = t.langid_task(extracted, work, data.langid, engine)
    filtered = t.quality_task(identified, work, data.quality, engine)
    deduped = t.dedup_task(filtered, work, data.dedup, plan.previous_index, plan.previous_shards, engine,
                           extracted, plan.previous_superseded)
    balanced = t.balance_task(deduped, work, data.balance, (plan.base or {}).get("balance_groups"), engine)
    results = [extracted, identified, filtered, deduped, balanced]
    if data.augment.enabled:
        results.append(t.augment_task(balanced, work, data.augment, engine))
    manifest = t.write_task(results, out, data.shard_bytes, config.model_dump(mode="json"), plan, engine)
    t.review_task(out, data.review)
    return manifest


@flow(name="data")
def data_flow(config: Config = Config(), refresh: bool = False) -> dict:
    """Web pages to clean, language-tagged, deduplicated Parquet shards, as a new dataset version.

    ``refresh``: re-crawl with conditional requests and add only new or changed
    pages, deduplicated against every earlier version (same as ``data.refresh``).
    """
    config = with_refresh(config, refresh)
    keep_run_traces(config.home)
    setup_tracking(config.home, config.tracking.experiment, config.tracking.uri)
    with pipeline_run("data", {"data": config.data.model_dump(mode="json")}):
        return run_data_pipeline(config)
