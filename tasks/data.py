"""Prefect tasks of the data stage: each runs one step and records it in MLflow.

The tasks are thin: the work is in :mod:`crawl2chat.stages`; a task connects to
Ray, opens the step's MLflow child run, logs parameters, counts and artifacts,
and hands the next task a small result (paths and counts, never a dataset).
"""

from __future__ import annotations

import json
import os
import re
import time
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE

from crawl2chat.infra.progress import StepProgress
from crawl2chat.infra.records import log_record, plot_bars
from crawl2chat.infra.tracking import stage_run
from crawl2chat.stages.secrets import mask_secrets
from crawl2chat.stages.data import pipeline as steps
from crawl2chat.stages.data.pipeline import NothingUsableError, StepResult
from crawl2chat.stages.data.versions import VERSIONS_DIR, DamagedDataError, VersionPlan, plan_version
from crawl2chat.stages.resources import exhaustion
from crawl2chat.stages.settings import SettingsError
from crawl2chat.infra.mlflow_datasets import dataset_entity


def metric_name(text: str) -> str:
    """MLflow metric names allow letters, digits and ``_-. /``; drop reasons use ``:``."""
    return re.sub(r"[^A-Za-z0-9_\-. /]", "/", text)


STEP_GOALS = {
    "extract": "Turn WARC/WET records into text documents; count what cannot be used.",
    "langid": "Tag each document with its language (fastText lid.176); drop unsure ones.",
    "quality": "Drop low-quality pages with the Gopher, C4 and FineWeb rules (and the classifier when on).",
    "dedup": "Remove exact and near duplicates (MinHash LSH, connected components on Ray).",
    "balance": "Weight languages (or sources) by w = freq^alpha / size^beta.",
    "augment": "Add augmented copies of kept documents (noise, synonyms, back-translation) as new rows.",
}


def log_step(result: StepResult, params: dict | None = None) -> None:
    mlflow.log_metrics(
        {
            "documents_in": result.rows_in,
            "documents_kept": result.kept,
            "documents_dropped": sum(result.dropped.values()),
            "seconds": result.seconds,
            "text_mb": result.bytes_in / 2**20,
            **({"docs_per_second": result.rows_in / result.seconds} if result.seconds else {}),
            **{f"dropped.{metric_name(r)}": n for r, n in result.dropped.items()},
        }
    )
    mlflow.set_tags({"crawl2chat.skipped": str(result.skipped), "crawl2chat.fingerprint": result.fingerprint})
    log_record(
        STEP_GOALS.get(result.name, result.name),
        params or {},
        {"documents in": result.rows_in, "text MB": round(result.bytes_in / 2**20, 3)},
        {"kept": result.kept, "dropped": sum(result.dropped.values()), "seconds": result.seconds,
         "skipped (already done)": result.skipped, **result.dropped},
    )
    plot_bars(result.dropped, f"{result.name}: documents dropped by reason", f"{result.name}_drop_reasons.png")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{result.name}_result.json"
        path.write_text(json.dumps(mask_secrets(result.to_dict()), indent=2, default=str))
        mlflow.log_artifact(str(path))


def _print_step(result: StepResult) -> None:
    drops = sum(result.dropped.values())
    state = "skipped (already done)" if result.skipped else f"{result.seconds:.1f}s"
    template = sum(f.get("template_lines", 0) for f in result.extra.get("files", []))
    extra = f"  ({template} site template lines removed)" if template else ""
    if repaired := result.extra.get("repaired"):
        extra += f"  ({repaired['documents']} kept without {repaired['lines']} repeated lines)"
    print(f"[data] {result.name:<8} {result.rows_in:>7} in  {result.kept:>7} kept  {drops:>6} dropped  {state}{extra}",
          flush=True)


# A step's errors that its retry would meet again: the input or settings are wrong, the
# folder is damaged, nothing usable is left.
LASTING_ERRORS = (NothingUsableError, DamagedDataError, SettingsError, FileNotFoundError, NotADirectoryError,
                  IsADirectoryError, PermissionError)


def retry_unless_lasting(task, task_run, state) -> bool:  # noqa: ARG001 - Prefect's retry_condition_fn signature
    """Retry a data step once, unless its error lasts (:data:`LASTING_ERRORS`) or it ran out
    of disk space, a file size limit or memory (:func:`~crawl2chat.stages.resources.exhaustion`):
    those fail again until someone fixes or frees something."""
    try:
        state.result()
    except LASTING_ERRORS:
        return False
    except BaseException as e:  # noqa: BLE001 - the step's own error decides
        return exhaustion(e) is None
    return False


CRAWL_MARKER = "_SUCCESS.json"  # in OUT/crawl: the settings of the last finished crawl


@task(name="crawl", retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_lasting,
      cache_policy=NO_CACHE)
def crawl_task(crawl_cfg: Any, out_dir: str, refresh: bool = False, only_input: bool = False) -> list[str]:
    """Crawl the seed URLs (or the local documentation server) into WARC files.

    A finished crawl with the same settings is not repeated unless ``refresh``
    asks for a re-crawl (conditional requests: only new and changed pages are
    downloaded again); the pages it could not fetch for a passing reason (the site
    down or overloaded, a connection cut) are asked for again, with the links of
    what they then give. Returns every WARC file of the crawl folder; with
    ``only_input`` (no other input), a crawl that leaves none raises
    NothingUsableError saying why its pages were not fetched.
    """
    from crawl2chat.stages.data.crawl import crawl, why_nothing_fetched
    from crawl2chat.stages.data.local_site import PydocSite

    params = crawl_cfg.model_dump()
    crawl_dir = Path(out_dir) / "crawl"
    marker = crawl_dir / CRAWL_MARKER
    settings = json.dumps(params, sort_keys=True, default=str)
    try:
        done = json.loads(marker.read_text())
        finished = done.get("settings") == settings
    except (OSError, ValueError, AttributeError):
        done, finished = {}, False
    only = [tuple(entry) for entry in done.get("retry", [])] if finished and not refresh else None
    if finished and not refresh and not only:
        warcs = sorted(str(p) for p in (crawl_dir / "warc").glob("*.warc.gz"))
        print(f"[data] crawl    already done with these settings ({len(warcs)} WARC files); "
              "--refresh re-crawls", flush=True)
        return warcs
    if only:
        print(f"[data] crawl    asking again for the {len(only)} pages the last crawl could not fetch "
              "(--refresh re-crawls every page)", flush=True)
    progress = StepProgress("data", None, unit="pages")  # max_pages is a cap, not the site's size

    def on_page(result) -> None:
        progress({"step": result.pages_fetched, "megabytes": result.bytes_fetched / 2**20})

    with stage_run("crawl", {"crawl": params, "refresh": refresh}):
        if crawl_cfg.seed_urls:
            result = crawl(crawl_cfg, crawl_dir, on_page, only)
        else:
            # The site keeps its address (or, when that port is taken, its recorded
            # identity through site_aliases) between runs, so a refresh finds its pages unchanged.
            with PydocSite(identity_file=crawl_dir / PydocSite.IDENTITY_FILE) as site:
                # The documentation server runs on this machine for this job alone:
                # no politeness gap is owed to it.
                cfg = crawl_cfg.model_copy(
                    update={
                        "seed_urls": [site.url],
                        "per_host_delay_s": 0.0,
                        "site_aliases": {**crawl_cfg.site_aliases, **site.aliases},
                        # Test suites, IDE internals and codec tables are slow to render and
                        # teach little; a user's own patterns replace these.
                        "exclude_url_patterns": crawl_cfg.exclude_url_patterns or list(PydocSite.LOW_VALUE_PAGES),
                    }
                )
                print(f"[data] crawling the local Python documentation server at {site.url}", flush=True)
                result = crawl(cfg, crawl_dir, on_page, only)
        progress.close()
        report = result.to_dict()
        mlflow.log_metrics(
            {
                "pages_fetched": result.pages_fetched,
                "pages_not_modified": result.pages_not_modified,
                "pages_gone": result.pages_gone,
                "mb_fetched": result.bytes_fetched / 2**20,
                **{f"skipped.{metric_name(k)}": v for k, v in result.skipped.items()},
            }
        )
        mlflow.log_dict(mask_secrets(report), "crawl_report.json")
        print(crawl_summary(result, crawl_dir), flush=True)
    warcs = sorted(str(p) for p in (crawl_dir / "warc").glob("*.warc.gz"))
    if result.pages_fetched + result.pages_not_modified + result.pages_gone == 0 and only is None:
        # Nothing answered (a site down, robots.txt unreachable): not done, the next run crawls again.
        if only_input and not warcs:
            raise NothingUsableError(f"The crawl got no page ({why_nothing_fetched(result)}); nothing was built, "
                                     f"see {crawl_dir / 'crawl_report.json'}.")
        print("[data] crawl    got no page; not marked done, the next run crawls again", flush=True)
    else:
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(json.dumps({"settings": settings, "finished_at": time.time(),
                                   "retry": [list(entry) for entry in result.retry]}))
        os.replace(tmp, marker)
        if result.retry:
            print(f"[data] crawl    {len(result.retry)} pages could not be fetched for now; the next run "
                  "asks for them again", flush=True)
    # Every WARC file of the crawl folder: earlier crawls' pages stay part of the corpus.
    return warcs


def crawl_summary(result, crawl_dir: Path) -> str:
    """``[data] crawl  7 pages fetched, 0 unchanged, 1 WARC files; not fetched: connection_error 20,
    off_domain 4 (see .../crawl_report.json)``."""
    gone = f", {result.pages_gone} gone (404/410)" if result.pages_gone else ""
    line = (f"[data] crawl    {result.pages_fetched:>7} pages fetched, {result.pages_not_modified} unchanged{gone}, "
            f"{len(result.warc_paths)} WARC files")
    if result.skipped:
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(result.skipped.items(), key=lambda kv: -kv[1]))
        line += f"; not fetched: {reasons} (see {crawl_dir / 'crawl_report.json'})"
    return line


def _step_task(name: str):
    def decorate(fn):
        return task(name=name, retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_lasting,
                    cache_policy=NO_CACHE)(fn)

    return decorate


def _recorded_step(name: str, params: dict, run: Callable[[Callable[[dict], None]], StepResult],
                   extra_logging: Callable[[StepResult], None] | None = None,
                   total: int | None = None, files: int | None = None, then: str | None = None,
                   engine: str = "ray") -> StepResult:
    """Run one data step inside its MLflow child run and print its line; ``engine``
    (:mod:`~crawl2chat.stages.data.engine`) is where its dataset operations run.

    ``run`` gets the step's ``on_count``: while the job runs, the documents it has
    processed (of ``total``, when known; and input files done, of ``files``) are
    shown as a progress line (:class:`~crawl2chat.infra.progress.StepProgress`),
    with their rate and the time left; ``then`` says what the step does once every
    document is counted. A step that is already done shows none."""
    if engine == "ray":
        # Imported here: a build the in-process engine runs never imports Ray (~0.5 s of its start).
        from crawl2chat.infra.ray_runtime import ensure_ray

        ensure_ray()
    progress = StepProgress("data", total, unit="documents", label=name)

    def files_note(done: int) -> str | None:
        return f"{done}/{files} files" if files is not None else None

    def on_count(counts: dict) -> None:
        done = counts.get("documents", 0)
        note = then if then and total and done >= total else files_note(counts.get("files", 0))
        progress({"step": done, "note": note})

    with stage_run(name, params):
        try:
            result = run(on_count)
        except BaseException:
            progress.close()  # the error's own lines start on a line of their own
            raise
        if not result.skipped:
            # The exact count (the last reads of the tally may miss a batch's late report).
            final = result.rows_in if total is None else total
            progress.finish({"step": final, "note": files_note(files or 0)})
        log_step(result, params)
        mlflow.set_tag("crawl2chat.data_engine", engine)
        if extra_logging:
            extra_logging(result)
    _print_step(result)
    return result


@_step_task("extract")
def extract_task(files: Sequence[str], work_dir: str, extract_cfg: Any, engine: str = "ray",
                 site_templates: dict | None = None) -> StepResult:
    def log_files(result: StepResult) -> None:
        mlflow.log_metric("unreadable_files", len([f for f in result.extra.get("files", []) if not f["ok"]]))

    return _recorded_step("extract", {"extract": extract_cfg.model_dump(), "input_files": len(files)},
                          lambda on_count: steps.extract_step(list(files), work_dir, extract_cfg, on_count, engine,
                                                              site_templates),
                          log_files, files=len(files), engine=engine)


@_step_task("langid")
def langid_task(upstream: StepResult, work_dir: str, cfg: Any, engine: str = "ray") -> StepResult:
    return _recorded_step("langid", {"langid": cfg.model_dump()},
                          lambda on_count: steps.langid_step(upstream, work_dir, cfg, on_count, engine),
                          total=upstream.kept, engine=engine)


@_step_task("quality")
def quality_task(upstream: StepResult, work_dir: str, cfg: Any, engine: str = "ray") -> StepResult:
    def log_classifier(result: StepResult) -> None:
        """The fastText classifier used (given, trained or reused) and, when trained, its accuracy."""
        if "classifier" in result.extra:
            mlflow.set_tags({"crawl2chat.quality_classifier": result.extra["classifier"],
                             "crawl2chat.quality_classifier_model": result.extra["model"]})
            mlflow.log_metrics({f"classifier.{k}": float(v) for k, v in result.extra.items()
                                if isinstance(v, (int, float)) and not isinstance(v, bool)})

    return _recorded_step("quality", {"quality": cfg.model_dump()},
                          lambda on_count: steps.quality_step(upstream, work_dir, cfg, on_count, engine),
                          log_classifier, total=upstream.kept, engine=engine)


@_step_task("dedup")
def dedup_task(upstream: StepResult, work_dir: str, cfg: Any, previous_index: Sequence[str],
               previous_shards: Sequence[str] = (), engine: str = "ray", captures: StepResult | None = None,
               superseded: Sequence[str] = ()) -> StepResult:
    def log_stats(result: StepResult) -> None:
        stats = result.extra.get("dedup", {})
        mlflow.log_metrics({k: float(v) for k, v in stats.items() if isinstance(v, (int, float))})
        sizes = {f"size {k}": v for k, v in sorted((stats.get("cluster_size_histogram") or {}).items(),
                                                     key=lambda kv: int(kv[0]))}
        plot_bars(sizes, "dedup: clusters by size", "dedup_cluster_sizes.png")

    return _recorded_step("dedup", {"dedup": cfg.model_dump(), "previous_index": list(previous_index),
                                    "previous_shards": len(previous_shards)},
                          lambda on_count: steps.dedup_step(upstream, work_dir, cfg, previous_index, previous_shards,
                                                            on_count, engine, captures, superseded),
                          log_stats, total=upstream.kept, then="keys computed; grouping duplicates", engine=engine)


@_step_task("balance")
def balance_task(upstream: StepResult, work_dir: str, cfg: Any, prior: dict | None = None,
                 engine: str = "ray") -> StepResult:
    return _recorded_step("balance", {"balance": cfg.model_dump()},
                          lambda on_count: steps.balance_step(upstream, work_dir, cfg, prior, on_count, engine),
                          lambda result: mlflow.log_dict(result.extra, "balance.json"), total=upstream.kept,
                          engine=engine)


@_step_task("augment")
def augment_task(upstream: StepResult, work_dir: str, cfg: Any, engine: str = "ray") -> StepResult:
    def log_added(result: StepResult) -> None:
        mlflow.log_metrics({"documents_added": float(result.extra.get("documents_added", 0)),
                            "source_documents": float(result.extra.get("source_documents", 0)),
                            **{f"added.{metric_name(m)}": float(n)
                               for m, n in (result.extra.get("augmented") or {}).items()}})
        print(f"[data] augment  added {result.extra.get('documents_added', 0)} rows "
              f"{result.extra.get('augmented') or {}}", flush=True)

    return _recorded_step("augment", {"augment": cfg.model_dump()},
                          lambda on_count: steps.augment_step(upstream, work_dir, cfg, on_count, engine), log_added,
                          total=upstream.kept, engine=engine)


def list_inputs(inputs: Sequence[str]) -> list[str]:
    """The WARC/WET files named by files, folders and fsspec URLs."""
    from crawl2chat.stages.data.warc_input import list_input_files

    return list_input_files(list(inputs)) if inputs else []


@task(name="plan-version", cache_policy=NO_CACHE)
def plan_version_task(out_dir: str, files: Sequence[str], settings: dict, refresh: bool,
                      extra_index: Sequence[str]) -> VersionPlan:
    """Which files the next dataset version reads, and what it extends."""
    return plan_version(out_dir, list(files), settings, refresh, list(extra_index))


RUN_FILE = "mlflow_run.json"  # beside a version's manifest: the write run that committed it


def version_run_id(out_dir: str | Path, version: str | None) -> str | None:
    """The MLflow run that committed a dataset version, when this folder recorded it."""
    try:
        return json.loads((Path(out_dir) / VERSIONS_DIR / str(version) / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return None


@task(name="current-version", cache_policy=NO_CACHE)
def current_version_task(out_dir: str, plan: VersionPlan) -> dict:
    """The current version already is this build: report it."""
    manifest = dict(plan.up_to_date or {})
    why = "no new input files" if plan.refresh else "same inputs and settings"
    print(f"[data] {out_dir} is up to date at {manifest.get('version')} ({why}): "
          f"{manifest.get('documents_kept')} documents", flush=True)
    return manifest


def data_lineage(data: str) -> dict[str, str]:
    """Lineage tags of a training stage reading a data-stage folder: its path, version, digest and write run."""
    from crawl2chat.infra.lineage import input_tags, known_run
    from crawl2chat.stages.data.versions import read_manifest

    manifest = read_manifest(data) if Path(data).is_dir() else None
    if not manifest:
        return {"crawl2chat.data_path": data}
    return {"crawl2chat.data_path": data, "crawl2chat.data_digest": manifest.get("content_digest", ""),
            "crawl2chat.data_version": str(manifest.get("version")),
            **input_tags(data=known_run(version_run_id(data, manifest.get("version"))))}


def log_dataset(manifest: dict, out_dir: str, context: str) -> None:
    """The dataset version as an MLflow dataset input of the active run (digest, source, size)."""
    mlflow.log_input(dataset_entity(manifest, out_dir), context=context)


@_step_task("write")
def write_task(results: Sequence[StepResult], out_dir: str, shard_bytes: int, config: dict,
               plan: VersionPlan | None = None, engine: str = "ray") -> dict:
    if engine == "ray":
        from crawl2chat.infra.ray_runtime import ensure_ray

        ensure_ray()
    with stage_run("write", {"shard_bytes": shard_bytes, "out": out_dir}) as run:
        try:
            manifest = steps.write_dataset(list(results), out_dir, shard_bytes, config, plan, engine)
        finally:
            manifest_path = Path(out_dir) / "manifest.json"
            if manifest_path.exists():
                mlflow.log_artifact(str(manifest_path))
        version_dir = Path(out_dir) / VERSIONS_DIR / manifest["version"]
        (version_dir / RUN_FILE).write_text(json.dumps({"run_id": run.info.run_id,
                                                        "tracking_uri": mask_secrets(mlflow.get_tracking_uri())}))
        mlflow.set_tags({"crawl2chat.data_version": manifest["version"],
                         "crawl2chat.data_base_version": str(manifest.get("base_version"))})
        mlflow.log_metric("version_documents_kept", manifest["version_documents_kept"])
        log_dataset(manifest, out_dir, context="output")
        mlflow.log_metrics(
            {"documents_kept": manifest["documents_kept"], "documents_dropped": manifest["documents_dropped"],
             "shards": len(manifest["shards"])}
        )
        mlflow.set_tag("crawl2chat.data_digest", manifest["content_digest"])
        plot_bars(manifest["drop_reasons"], "all steps: documents dropped by reason", "drop_reasons.png")
        log_record("Write the kept documents as bounded zstd Parquet shards; quarantine every dropped one.",
                   {"shard_bytes": shard_bytes, "out": out_dir},
                   {"steps": len(results), "input files": len(manifest["files"]),
                    "unreadable files": len(manifest["unreadable_files"])},
                   {"documents kept": manifest["documents_kept"], "documents dropped": manifest["documents_dropped"],
                    "shards": len(manifest["shards"]), "content digest": manifest["content_digest"]})
    print(f"[data] write    {manifest['version']}: {manifest['version_documents_kept']} new documents, "
          f"{manifest['documents_kept']} in {len(manifest['shards'])} shards -> {out_dir}/manifest.json", flush=True)
    return manifest


@_step_task("review")
def review_task(out_dir: str, cfg: Any) -> str:
    from crawl2chat.stages.data.review import write_review

    with stage_run("review", {"review": cfg.model_dump()}):
        path = write_review(out_dir, cfg)
        mlflow.log_artifact(str(path))
    print(f"[data] review sample -> {path}", flush=True)
    return str(path)
