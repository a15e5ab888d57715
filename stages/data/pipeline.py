"""The data stage's steps, each a Ray Data job over Parquet (or the same operations
in this process, for small inputs: :mod:`~crawl2chat.stages.data.engine`).

Every step reads the previous step's output folder, keeps the documents no
earlier step dropped, runs its blocks, and writes all of its rows (kept and
newly dropped, the latter with ``drop_reason``) to ``WORK/<step>/``. A step
writes into a hidden temporary folder and renames it into place only once the
folder holds a ``_SUCCESS.json`` marker, so a killed job never leaves a
half-written step behind. The marker records a fingerprint of the step's inputs
and configuration: a rerun with the same fingerprint skips the step, once the
folder's files match the sizes and sha256 listed in its ``checksums.json``; a
step folder damaged since it was written is named and run again.

The steps: ``extract`` (WARC/WET files -> text documents), ``langid``,
``quality``, ``dedup``, ``balance``, the optional ``augment`` (new rows: augmented
copies of the kept documents), then :func:`write_dataset` (bounded zstd shards,
quarantine of every dropped document, manifest) and :func:`write_review`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from crawl2chat.stages.checksums import folder_damage, write_checksums
from crawl2chat.stages.data.counting import Counted, CountedClass, OnCount, counting, report
from crawl2chat.stages.data.engine import LOCAL, RAY, engine
from crawl2chat.stages.data.extract_pool import extract_in_processes, extract_processes
from crawl2chat.stages.fault_points import kill_point
from crawl2chat.stages.secrets import mask_secrets
from crawl2chat.stages.data.versions import (
    MANIFEST,
    SITE_TEMPLATES,
    VERSIONS_DIR,
    VersionPlan,
    content_digest,
    file_identity,
    read_manifest,
    sha256_file,
    superseded_ids,
    write_json_atomically,
)
from crawl2chat.stages.data.ray_blocks import (
    DEDUP_COLUMNS,
    EXTRACT_COLUMNS,
    LANGID_COLUMNS,
    QUALITY_COLUMNS,
    BlockBatchMapper,
    to_table,
)

MARKER = "_SUCCESS.json"
FILE_STATUS = "_file"  # record_type of the one status row each input file gets
SHARD_COLUMNS = (
    "id", "url", "text", "lang", "lang_score", "quality_score", "source", "host",
    "content_type", "fetched_at", "dup_cluster", "sample_weight", "augmented_from", "augment_method",
)


class NothingUsableError(RuntimeError):
    """Raised when a step leaves no document at all; the message is one plain sentence."""


@dataclass
class StepResult:
    name: str
    out_dir: str
    fingerprint: str
    skipped: bool = False
    rows_in: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    bytes_in: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_libraries(cfg: Any) -> list[str]:
    """The modules the data steps of ``cfg`` (the data settings) import on first use that
    cost a command most (~0.5 s here: datasketch pulls in scipy and redis), for a command
    to import while it waits on something else."""
    modules = ["crawl2chat.stages.data.dedup"]
    if cfg.extract.extractor == "trafilatura":
        modules.append("trafilatura")
    return modules


def fingerprint(*parts: Any) -> str:
    """Stable digest of JSON-able parts (configs, paths, upstream fingerprints)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def files_fingerprint(paths: Sequence[str]) -> list[tuple[str, int, float]]:
    """Identity of input files: path, size and modification time (local files)."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_size, st.st_mtime))
        except OSError:  # remote (fsspec) paths are identified by name
            out.append((p, -1, 0.0))
    return out


def read_marker(step_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((step_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def run_step(
    name: str,
    work_dir: str | Path,
    step_fingerprint: str,
    build: Callable[[str], dict[str, Any]],
) -> StepResult:
    """Run ``build(tmp_dir)`` unless ``WORK/name`` already holds the same fingerprint.

    ``build`` writes the step's Parquet files into ``tmp_dir`` and returns extra
    figures for the marker. Counts of kept and dropped rows are read back from
    the written files, so they are exactly what the next step will see.
    """
    work_dir = Path(work_dir)
    final = work_dir / name
    marker = read_marker(final)
    if marker and marker.get("fingerprint") == step_fingerprint:
        damage = folder_damage(final)
        if damage is None:
            marker["skipped"] = True
            return StepResult(**marker)
        print(f"[data] {damage}: running the {name} step again", flush=True)

    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    try:
        extra = build(str(tmp)) or {}
        tmp.mkdir(parents=True, exist_ok=True)  # a step with no rows writes no files
        counts = count_rows(tmp)
        result = StepResult(
            name=name,
            out_dir=str(final),
            fingerprint=step_fingerprint,
            rows_in=counts["rows"],
            kept=counts["kept"],
            dropped=counts["dropped"],
            bytes_in=counts["text_bytes"],
            seconds=round(time.perf_counter() - start, 3),
            extra=extra,
        )
        write_checksums(tmp)  # sizes and sha256 of the step's files, checked before a rerun skips it
        (tmp / MARKER).write_text(json.dumps(result.to_dict(), indent=2))
        kill_point(f"step:{name}:written")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        kill_point(f"step:{name}:committed")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def count_rows(step_dir: str | Path) -> dict[str, Any]:
    """Kept/dropped counts of a step folder, file-status rows excluded."""
    files = sorted(Path(step_dir).glob("*.parquet"))
    if not files:
        return {"rows": 0, "kept": 0, "dropped": {}, "text_bytes": 0}
    table = pq.read_table(files, columns=["drop_reason", "record_type", "text"])
    docs = table.filter(pc.fill_null(pc.not_equal(table["record_type"], FILE_STATUS), True))
    reasons = Counter(r for r in docs["drop_reason"].to_pylist() if r)
    kept_mask = pc.is_null(docs["drop_reason"])
    text_bytes = pc.sum(pc.binary_length(pc.cast(docs["text"], pa.large_binary()))).as_py() or 0
    return {
        "rows": docs.num_rows,
        "kept": int(pc.sum(pc.cast(kept_mask, pa.int64())).as_py() or 0),
        "dropped": dict(sorted(reasons.items())),
        "text_bytes": int(text_bytes),
    }


def _undropped(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.is_null(batch["drop_reason"]))


# Step folders up to this size are read by the driver (see read_step).
DRIVER_READ_BYTES = 256 << 20


def read_step(step_dir: str, engine_name: str = RAY) -> Any:
    """All rows of a step folder, one block per Parquet file, as a dataset of the named
    engine (:mod:`~crawl2chat.stages.data.engine`).

    A local folder of at most ``DRIVER_READ_BYTES`` is read here with pyarrow and
    handed to Ray as Arrow tables: ``ray.data.read_parquet`` first runs a file-listing
    task and a read task, which on a busy two-core machine took 3 to 12 s per step
    for a few hundred KiB, several times the work of the step itself. The driver
    reads every step folder whole anyway (:func:`count_rows`), so this holds no
    more in its memory than it already does. Larger or remote folders are read by
    Ray's workers as before.
    """
    eng = engine(engine_name)
    files = sorted(Path(step_dir).glob("*.parquet")) if os.path.isdir(step_dir) else []
    if files and sum(f.stat().st_size for f in files) <= DRIVER_READ_BYTES:
        return eng.from_arrow([pq.read_table(f) for f in files])
    return eng.read_parquet(step_dir)


def read_kept(step_dir: str, engine_name: str = RAY) -> Any:
    """The documents of a step folder that no step has dropped."""
    return read_step(step_dir, engine_name).map_batches(_undropped, batch_format="pyarrow")


def _write(ds: Any, out_dir: str) -> None:
    ds.write_parquet(out_dir, compression="zstd")


# --------------------------------------------------------------------------- extract


def extract_files(batch: dict[str, Any], extract_cfg: Any, rows_per_table: int,
                   tally: Any = None, site_templates: dict[str, list[str]] | None = None) -> Iterator[pa.Table]:
    """Each file of ``batch["path"]`` -> tables of its documents, then its status row.
    ``site_templates``: host -> template lines judged by earlier versions (removed too);
    the lines judged in a file's windows go on its status row (``site_template``)."""
    from crawl2chat.stages.data.templates import strip_template_lines
    from crawl2chat.stages.data.warc_input import WarcReader

    found: dict[str, set[str]] = {}

    def finish(docs: list[dict]) -> int:
        """Site template lines out of a window of documents (see stages.data.templates)."""
        if extract_cfg.template_min_share is None:
            return 0
        removed = strip_template_lines(docs, extract_cfg.template_min_pages, extract_cfg.template_min_share,
                                       site_templates, found)
        for doc in docs:
            if doc.get("template_lines") and len(doc["text"].strip()) < max(extract_cfg.min_text_chars, 1):
                doc["drop_reason"] = "extract:template_only"
        return removed

    for path in batch["path"]:
        found = {}
        reader = WarcReader(extract_cfg)
        docs: list[dict] = []
        records = template = 0
        for doc in reader.run(str(path)):
            records += 1
            docs.append(doc)
            if len(docs) >= rows_per_table:
                template += finish(docs)
                yield to_table(docs, EXTRACT_COLUMNS)
                report(tally, "documents", len(docs))
                docs = []
        template += finish(docs)
        errors = "; ".join(str(e.get("error")) for e in reader.file_errors)
        docs.append(
            {
                "id": hashlib.sha256(str(path).encode()).hexdigest()[:16],
                "url": str(path),
                "source": Path(str(path)).name,
                "record_type": FILE_STATUS,
                "text": "",
                "drop_reason": "file:error" if errors else "file:ok",
                "file_error": errors or None,
                "records_read": records,
                "template_lines": template,
                "site_template": json.dumps({h: sorted(lines) for h, lines in sorted(found.items())},
                                            ensure_ascii=False) if found else None,
            }
        )
        yield to_table(docs, EXTRACT_COLUMNS)
        report(tally, "documents", len(docs) - 1)
        report(tally, "files", 1)


def extract_step(files: Sequence[str], work_dir: str, extract_cfg: Any, on_count: OnCount | None = None,
                 engine_name: str = RAY, site_templates: dict[str, list[str]] | None = None) -> StepResult:
    """WARC/WET files -> one document per response/conversion record. ``on_count``
    (see :mod:`~crawl2chat.stages.data.counting`) gets the documents read and files finished so far.
    ``site_templates``: the template lines of the versions a refresh extends (host -> lines).
    Every step runs on the engine ``engine_name`` names (:mod:`~crawl2chat.stages.data.engine`);
    the engine is not part of a step's fingerprint: both give the same rows."""
    if not files:
        raise NothingUsableError("No input files were found to read.")
    fp = fingerprint("extract", files_fingerprint(files), extract_cfg.model_dump(),
                     *([site_templates] if site_templates else []))

    def build(tmp: str) -> dict[str, Any]:
        eng = engine(engine_name)
        processes = extract_processes(files, extract_cfg) if engine_name == LOCAL else 1
        with counting(on_count, engine_name) as tally:
            if processes > 1:
                extract_in_processes(files, tmp, extract_cfg, processes, lambda n, k: (
                    report(tally, "documents", n), report(tally, "files", k)), site_templates)
                return {"input_files": len(files), "processes": processes}
            # A few files per task: each Ray task costs a fixed ~0.3-0.4 s to schedule and write its
            # Parquet file, a third of the step at one file per task (64 WARC files on 2 cores:
            # 36.7 s at 64 tasks, 27.7 s at 8). Four tasks per CPU still balance uneven files.
            ds = eng.from_items([{"path": p} for p in files], min(len(files), 4 * eng.cpus()))
            ds = ds.map_batches(
                extract_files,
                batch_size=1,
                batch_format="numpy",
                fn_kwargs={"extract_cfg": extract_cfg, "rows_per_table": 512, "tally": tally,
                           "site_templates": site_templates},
            )
            _write(ds, tmp)
        return {"input_files": len(files)}

    result = run_step("extract", work_dir, fp, build)
    result.extra["files"] = file_statuses(result.out_dir)
    return result


def site_templates_found(step_dir: str, known: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """``known`` plus the template lines an extract step folder's files judged (host -> lines)."""
    merged: dict[str, set[str]] = {h: set(lines) for h, lines in (known or {}).items()}
    files = sorted(Path(step_dir).glob("*.parquet"))
    # (A step folder an earlier release wrote has no such column.)
    if files and "site_template" in pq.read_schema(files[0]).names:
        for blob in pq.read_table(files, columns=["site_template"])["site_template"].drop_null().to_pylist():
            for host, lines in json.loads(blob).items():
                merged.setdefault(host, set()).update(lines)
    return {h: sorted(lines) for h, lines in sorted(merged.items())}


def file_statuses(step_dir: str) -> list[dict[str, Any]]:
    """Per-input-file status rows written by the extract step."""
    files = sorted(Path(step_dir).glob("*.parquet"))
    if not files:
        return []
    table = pq.read_table(files, columns=["url", "record_type", "drop_reason", "file_error", "records_read",
                                          "template_lines"])
    table = table.filter(pc.equal(table["record_type"], FILE_STATUS))
    rows = [
        {"path": r["url"], "ok": r["drop_reason"] == "file:ok", "error": r["file_error"], "records": r["records_read"],
         "template_lines": r["template_lines"] or 0}
        for r in table.to_pylist()
    ]
    return sorted(rows, key=lambda r: r["path"])


# --------------------------------------------------------------------------- blocks


def _langid_blocks(cfg: Any) -> Callable[[], list]:
    def make() -> list:
        from crawl2chat.stages.data.langid import LanguageId

        return [LanguageId(cfg)]

    return make


def _quality_blocks(cfg: Any) -> Callable[[], list]:
    def make() -> list:
        from crawl2chat.stages.data.quality import build_quality_blocks

        return build_quality_blocks(cfg)

    return make


def block_step(
    name: str,
    upstream: StepResult,
    work_dir: str,
    cfg: Any,
    make_blocks: Callable[[], list],
    columns: Sequence[str],
    identity: Sequence[Any] = (),
    on_count: OnCount | None = None,
    engine_name: str = RAY,
) -> StepResult:
    """Run ``make_blocks()`` over the upstream's kept rows; ``identity`` adds inputs beyond ``cfg``
    (a model file) to the fingerprint; ``on_count`` gets the documents judged so far."""
    fp = fingerprint(name, upstream.fingerprint, cfg.model_dump(), *identity)

    def build(tmp: str) -> dict[str, Any]:
        if upstream.kept == 0:
            return {}
        with counting(on_count, engine_name) as tally:
            ds = read_kept(upstream.out_dir, engine_name).map_batches(
                Counted(BlockBatchMapper(make_blocks, columns), tally), batch_format="pyarrow", batch_size=256
            )
            _write(ds, tmp)
        return {}

    return run_step(name, work_dir, fp, build)


def langid_step(upstream: StepResult, work_dir: str, cfg: Any, on_count: OnCount | None = None,
                engine_name: str = RAY) -> StepResult:
    return block_step("langid", upstream, work_dir, cfg, _langid_blocks(cfg), LANGID_COLUMNS, on_count=on_count,
                      engine_name=engine_name)


def prepare_quality_classifier(cfg: Any, work_dir: str) -> tuple[Any, dict[str, Any], list[Any]]:
    """The quality settings with ``classifier.model`` set, training the classifier when needed.

    A given ``model`` is used as it is; its file identity (size, modification time)
    joins the quality step's fingerprint, so replacing the file reruns the step.
    Otherwise the classifier is trained from the example files into
    ``WORK/models/quality_classifier-<fingerprint>.bin``, the fingerprint covering the
    example files' identities and every training setting: the same files and settings
    reuse the model, a change trains a new one, and each output folder keeps the
    classifier that filtered it. Returns ``(cfg, info for the step marker, extra
    fingerprint parts)``.
    """
    clf = cfg.classifier
    if not clf.enabled:
        return cfg, {}, []
    if clf.model:
        path = os.path.abspath(clf.model)  # Ray workers may run in another folder
        cfg = cfg.model_copy(update={"classifier": clf.model_copy(update={"model": path})})
        return cfg, {"classifier": "given", "model": path}, [files_fingerprint([path])]
    if not (clf.positive_files and clf.negative_files):
        raise ValueError(
            "data.quality.classifier is enabled but has neither `model` nor "
            "positive_files/negative_files to train one from."
        )
    from crawl2chat.stages.data.quality_classifier import train_quality_classifier

    training = clf.model_dump(exclude={"enabled", "model", "threshold"})
    key = fingerprint(
        "quality_classifier", training, files_fingerprint(clf.positive_files), files_fingerprint(clf.negative_files)
    )
    path = Path(work_dir) / "models" / f"quality_classifier-{key}.bin"
    cfg = cfg.model_copy(update={"classifier": clf.model_copy(update={"model": str(path)})})
    if path.is_file():
        return cfg, {"classifier": "reused", "model": str(path)}, []
    return cfg, {"classifier": "trained", "model": str(path), **train_quality_classifier(clf, path)}, []


def quality_step(upstream: StepResult, work_dir: str, cfg: Any, on_count: OnCount | None = None,
                 engine_name: str = RAY) -> StepResult:
    cfg, classifier_info, identity = prepare_quality_classifier(cfg, work_dir)
    result = block_step("quality", upstream, work_dir, cfg, _quality_blocks(cfg), QUALITY_COLUMNS, identity,
                        on_count=on_count, engine_name=engine_name)
    result.extra.update(classifier_info)
    files = sorted(Path(result.out_dir).glob("*.parquet"))
    repeated = pq.read_table(files, columns=["repeated_lines"])["repeated_lines"] if files else pa.array([], pa.int32())
    if pc.count(repeated).as_py():
        # Pages kept once their repeated line runs were removed (gopher_repetition.repair_runs).
        result.extra["repaired"] = {"documents": pc.count(repeated).as_py(), "lines": pc.sum(repeated).as_py()}
    return result


def dedup_step(
    upstream: StepResult,
    work_dir: str,
    cfg: Any,
    previous_index: Sequence[str] = (),
    previous_shards: Sequence[str] = (),
    on_count: OnCount | None = None,
    engine_name: str = RAY,
    captures: StepResult | None = None,
    superseded: Sequence[str] = (),
) -> StepResult:
    """Drop older captures of a page, repeated records (an id read twice, or already in
    ``previous_shards``: the shards of the versions a refresh extends), then exact and
    near duplicates, also of the documents in the ``previous_index`` folders.

    ``captures``: the extract step of this build; a kept document whose URL has a
    newer capture there or among the earlier versions' current documents is dropped as
    ``dedup:older_capture`` (:mod:`~crawl2chat.stages.data.captures`). ``superseded``:
    the earlier versions' superseded-id files; those documents are no longer
    current, so neither their keys nor their captures count.
    ``on_count`` gets the documents whose dedup keys are computed so far."""
    from crawl2chat.stages.data import captures as pages
    from crawl2chat.stages.data.dedup import dedup

    later = [captures.fingerprint if captures else None, files_fingerprint(superseded)]
    fp = fingerprint(
        "dedup", upstream.fingerprint, cfg.model_dump(), list(previous_index), files_fingerprint(previous_shards),
        *(later if any(later) else []),
    )

    def build(tmp: str) -> dict[str, Any]:
        if upstream.kept == 0:
            return {}
        retired = _ids_in(superseded)
        older = set()
        if captures is not None:
            older = pages.older_captures(pages.read_captures(captures.out_dir),
                                         pages.read_documents(previous_shards, retired))
        index_dir = os.path.join(tmp, "_index_work")
        with counting(on_count, engine_name) as tally:
            kept = read_kept(upstream.out_dir, engine_name)
            if older:
                kept = kept.map_batches(_drop_ids, fn_kwargs={"ids": pa.array(sorted(older), pa.string()),
                                                              "reason": pages.OLDER_CAPTURE}, batch_format="pyarrow")
            ds, stats = dedup(kept, cfg, index_dir, list(previous_index), list(previous_shards), tally=tally,
                              retired=retired)
            ds = ds.map_batches(lambda b: to_table(b.to_pylist(), DEDUP_COLUMNS), batch_format="pyarrow")
            _write(ds, tmp)
        # The persisted index sits beside the step output, outside the Parquet glob.
        if os.path.isdir(os.path.join(index_dir, "index")):
            os.replace(os.path.join(index_dir, "index"), os.path.join(tmp, "_index"))
        shutil.rmtree(index_dir, ignore_errors=True)
        return {"dedup": stats}

    return run_step("dedup", work_dir, fp, build)


def _ids_in(files: Sequence[str]) -> frozenset[str]:
    """The ``id`` column of Parquet files (superseded-id lists)."""
    return frozenset(pq.read_table(list(files), columns=["id"])["id"].to_pylist()) if files else frozenset()


def _drop_ids(batch: pa.Table, ids: pa.Array, reason: str) -> pa.Table:
    hit = pc.fill_null(pc.is_in(batch["id"], value_set=ids), False)
    reasons = pc.if_else(pc.and_(hit, pc.is_null(batch["drop_reason"])), pa.scalar(reason, pa.string()),
                         batch["drop_reason"])
    return batch.set_column(batch.column_names.index("drop_reason"), "drop_reason", reasons)


# --------------------------------------------------------------------------- write


def _group_sizes(step_dir: str, by: str, unit: str) -> tuple[dict[str, int], dict[str, float]]:
    files = sorted(Path(step_dir).glob("*.parquet"))
    if not files:
        return {}, {}
    column = "source" if by == "source" else "lang"
    table = pq.read_table(files, columns=["drop_reason", column, "text"])
    table = table.filter(pc.is_null(table["drop_reason"]))
    keys = [k or "unknown" for k in table[column].to_pylist()]
    lengths = pc.binary_length(pc.cast(table["text"], pa.large_binary())).to_pylist()
    docs: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for key, length in zip(keys, lengths):
        docs[key] += 1
        sizes[key] += float(length) if unit == "bytes" else 1.0
    return dict(docs), dict(sizes)


def _apply_balance(batch: pa.Table, by: str, weights: dict[str, float], mode: str, seed: int) -> pa.Table:
    from crawl2chat.stages.data.balance import keep_document

    docs = batch.to_pylist()
    column = "source" if by == "source" else "lang"
    top = max(weights.values(), default=1.0)
    out = []
    for doc in docs:
        weight = weights.get(doc.get(column) or "unknown", 1.0) if by != "none" else 1.0
        doc["sample_weight"] = weight
        if mode == "sample" and not keep_document(doc["id"], weight / top, seed):
            doc["drop_reason"] = "balance:downsampled"
        out.append(doc)
    schema = pa.schema(list(to_table([], DEDUP_COLUMNS).schema) + [("sample_weight", pa.float64())])
    return pa.Table.from_pylist(out, schema=schema)


def balance_step(upstream: StepResult, work_dir: str, cfg: Any, prior: dict[str, Any] | None = None,
                 on_count: OnCount | None = None, engine_name: str = RAY) -> StepResult:
    """Compute per-group weights and mark thinned documents (they are quarantined too);
    ``on_count`` gets the documents weighted so far.

    ``prior`` holds the group counts of the versions a refresh extends
    (``{"docs": ..., "sizes": ...}``): weights follow the whole dataset, not
    only the pages this version adds.
    """
    from crawl2chat.stages.data.balance import group_weights

    prior = prior or {}
    fp = fingerprint("balance", upstream.fingerprint, cfg.model_dump(), prior)

    def build(tmp: str) -> dict[str, Any]:
        new_docs, new_sizes = _group_sizes(upstream.out_dir, cfg.by, cfg.size_unit)
        docs = dict(Counter(prior.get("docs", {})) + Counter(new_docs))
        sizes = {k: prior.get("sizes", {}).get(k, 0.0) + new_sizes.get(k, 0.0) for k in docs}
        weights = group_weights(docs, sizes, cfg.alpha, cfg.beta) if cfg.by != "none" else {}
        if upstream.kept:
            with counting(on_count, engine_name) as tally:
                ds = read_kept(upstream.out_dir, engine_name).map_batches(
                    Counted(_apply_balance, tally),
                    batch_format="pyarrow",
                    fn_kwargs={"by": cfg.by, "weights": weights, "mode": cfg.mode, "seed": cfg.seed},
                )
                _write(ds, tmp)
        return {"groups": docs, "group_sizes": sizes, "version_groups": new_docs, "sample_weights": weights}

    return run_step("balance", work_dir, fp, build)


def augment_step(upstream: StepResult, work_dir: str, cfg: Any, on_count: OnCount | None = None,
                 engine_name: str = RAY) -> StepResult:
    """Add augmented copies of the upstream's kept documents (:mod:`~crawl2chat.stages.data.augment`).

    Runs after dedup and balance, so the copies are neither deduplicated against
    their sources nor counted in the language weights; each copy carries its
    source's ``sample_weight``. The step folder holds the upstream's kept rows
    followed, batch by batch, by the new ones; its record counts the rows added
    per method (``extra["augmented"]``). Settings that cannot work (a missing or
    malformed word list, a model folder without ``config.json``) are refused
    before any work, naming the setting. ``on_count`` gets the source documents processed so far."""
    from crawl2chat.stages.data.augment import AugmentBatch, prepare

    cfg, identity = prepare(cfg)
    fp = fingerprint("augment", upstream.fingerprint, cfg.model_dump(), *identity)

    def build(tmp: str) -> dict[str, Any]:
        if upstream.kept == 0:
            return {"augmented": {}, "documents_added": 0, "source_documents": 0}
        files = sorted(Path(upstream.out_dir).glob("*.parquet"))
        names = pq.ParquetFile(files[0]).schema_arrow.names
        # One worker: back-translation models are loaded once; the other methods are cheap.
        with counting(on_count, engine_name) as tally:
            ds = read_kept(upstream.out_dir, engine_name).map_batches(
                CountedClass, fn_constructor_args=(AugmentBatch, (cfg, names), tally), batch_format="pyarrow",
                batch_size=cfg.back_translation.batch_size * 4 if cfg.back_translation.enabled else 256,
                **({"compute": _one_actor()} if engine_name == RAY else {}),
            )
            _write(ds, tmp)
        written = sorted(Path(tmp).glob("*.parquet"))
        table = pq.read_table(written, columns=["augmented_from", "augment_method"]) if written else None
        methods = Counter(m for m in (table["augment_method"].to_pylist() if table else []) if m)
        sources = len({s for s in (table["augmented_from"].to_pylist() if table else []) if s})
        return {"augmented": dict(sorted(methods.items())), "documents_added": sum(methods.values()),
                "source_documents": sources, "methods": cfg.methods()}

    return run_step("augment", work_dir, fp, build)


def _one_actor() -> Any:
    import ray

    return ray.data.ActorPoolStrategy(size=1)


def _with_shard_columns(batch: pa.Table) -> pa.Table:
    """The shard columns, those a step did not write (augment's, when it did not run) as nulls."""
    columns = {}
    for name in SHARD_COLUMNS:
        columns[name] = batch[name] if name in batch.column_names else pa.nulls(batch.num_rows, pa.string())
    return pa.table(columns)


def _combined(batch: pa.Table) -> pa.Table:
    """One contiguous chunk per column, so the Parquet pages written do not depend on
    how the rows were chunked in memory."""
    return batch.combine_chunks()


def _first_id(path: Path) -> str:
    ids = pq.read_table(path, columns=["id"]).column(0)
    return ids[0].as_py() if len(ids) else ""


def _rename_in_order(folder: Path, prefix: str, key: Callable[[Path], Any] | None = None) -> list[Path]:
    parts = sorted(folder.glob("*.parquet"), key=key)
    named = []
    for i, part in enumerate(parts):
        target = folder / f"{prefix}-{i:05d}.parquet"
        os.replace(part, target)
        named.append(target)
    return named


def write_dataset(
    steps: Sequence[StepResult],
    out_dir: str,
    shard_bytes: int,
    config: dict[str, Any],
    plan: VersionPlan | None = None,
    engine_name: str = RAY,
) -> dict[str, Any]:
    """Commit a dataset version: its shards, the quarantine of what it dropped, its manifest.

    ``steps`` are the step results in order; the last one holds the kept
    documents. Without a ``plan`` the version is ``v0001`` of a new chain. The
    version's files are written to a temporary folder and moved into ``shards/``
    and ``rejected/`` under names carrying the version; the manifest, renamed
    into place last, commits them. Earlier versions' files are never touched.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = plan or VersionPlan("v0001", str(out / "work"), [], False, "")
    version, base = plan.name, plan.base or {}
    last = steps[-1]
    tmp = out / f".write.tmp-{uuid.uuid4().hex[:8]}"
    (tmp / "shards").mkdir(parents=True)
    (tmp / "rejected").mkdir(parents=True)
    try:
        if last.kept:
            n_shards = max(1, -(-last.bytes_in // max(shard_bytes, 1)))
            eng = engine(engine_name)
            ds = read_kept(last.out_dir, engine_name).map_batches(_with_shard_columns, batch_format="pyarrow")
            # Sorted by id and cut into runs of exactly ``rows`` documents, in order: the same
            # documents make byte-identical shards (and so the same content digest) however
            # the steps' blocks arrived, which is what a rerun after a kill is compared on.
            rows = max(1, -(-last.kept // n_shards))
            with eng.preserving_order():
                (ds.sort("id").repartition(target_num_rows_per_block=rows, strict=True)
                 .map_batches(_combined, batch_format="pyarrow", batch_size=None)
                 .write_parquet(str(tmp / "shards"), compression="zstd"))
        new_shards = _rename_in_order(tmp / "shards", f"{version}-shard", key=_first_id)

        # Step folders differ in columns, so each is mapped to the quarantine schema first.
        rejected = [
            read_step(s.out_dir, engine_name).map_batches(_rejected_rows, batch_format="pyarrow")
            for s in steps
            if sum(s.dropped.values())
        ]
        if rejected:
            quarantine = rejected[0].union(*rejected[1:]) if len(rejected) > 1 else rejected[0]
            quarantine.write_parquet(str(tmp / "rejected"), compression="zstd")
        new_rejected = _rename_in_order(tmp / "rejected", f"{version}-rejected")

        shard_info = [
            {"path": f"shards/{p.name}", "rows": pq.ParquetFile(p).metadata.num_rows, "bytes": p.stat().st_size,
             "sha256": sha256_file(p), "version": version}
            for p in new_shards
        ]
        shards = list(base.get("shards", [])) + shard_info
        version_dir = tmp / "version"
        version_dir.mkdir()
        superseded = list(base.get("superseded", []))
        replaced = _superseded_rows(out, base, steps)
        if replaced.num_rows:
            pq.write_table(replaced, version_dir / "superseded.parquet")
            superseded.append(f"{VERSIONS_DIR}/{version}/superseded.parquet")
        n_superseded = int(base.get("documents_superseded", 0)) + replaced.num_rows
        indexes = list(base.get("dedup_indexes", []))
        dedup = next((s for s in steps if s.name == "dedup"), None)
        if dedup and os.path.isdir(os.path.join(dedup.out_dir, "_index")):
            shutil.copytree(os.path.join(dedup.out_dir, "_index"), version_dir / "dedup_index")
            indexes.append(f"{VERSIONS_DIR}/{version}/dedup_index")
        drops: Counter[str] = Counter()
        for s in steps:
            drops.update(s.dropped)
        files = next((s.extra.get("files") for s in steps if s.name == "extract"), []) or []
        extract = next((s for s in steps if s.name == "extract"), None)
        templates = site_templates_found(extract.out_dir, plan.site_templates) if extract else plan.site_templates
        if templates:
            (version_dir / SITE_TEMPLATES).write_text(json.dumps(templates, ensure_ascii=False, indent=1))
        balance = next((s.extra for s in steps if s.name == "balance"), {})
        augment = next((s.extra for s in steps if s.name == "augment"), None)
        manifest = {
            "version": version,
            "base_version": base.get("version"),
            "refresh": plan.refresh,
            "versions": list(base.get("versions", [])) + [version],
            "documents_kept": sum(s["rows"] for s in shards) - n_superseded,
            "version_documents_kept": sum(s["rows"] for s in shard_info),
            "version_documents_superseded": replaced.num_rows,
            "documents_superseded": n_superseded,
            "superseded": superseded,
            "documents_dropped": sum(drops.values()),
            "drop_reasons": dict(sorted(drops.items())),
            "steps": [s.to_dict() for s in steps],
            "files": files,
            "unreadable_files": [f for f in files if not f["ok"]],
            "input_files": list(base.get("input_files", [])) + [file_identity(f["path"], out) for f in files],
            "shards": shards,
            "rejected": list(base.get("rejected", [])) + [f"rejected/{p.name}" for p in new_rejected],
            "dedup_indexes": indexes,
            "site_templates": f"{VERSIONS_DIR}/{version}/{SITE_TEMPLATES}" if templates else None,
            "balance_groups": {"docs": balance.get("groups", {}), "sizes": balance.get("group_sizes", {})},
            "augmented": (
                {"version_documents_added": augment.get("documents_added", 0),
                 "by_method": augment.get("augmented", {}), "source_documents": augment.get("source_documents", 0)}
                if augment is not None else None
            ),
            "content_digest": content_digest(shards, superseded),
            "build_fingerprint": plan.fingerprint,
            "config": mask_secrets(config),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (version_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        if manifest["documents_kept"] == 0:  # nothing to read: the current version stays current
            failed = _keep_failed_build(out, version, version_dir, new_rejected)
            raise NothingUsableError(_nothing_left_sentence(manifest, read_manifest(out), failed))
        kill_point("write:staged")
        for name, new_files in (("shards", new_shards), ("rejected", new_rejected)):
            target = out / name
            target.mkdir(exist_ok=True)
            for stale in target.glob(f"{version}-*.parquet"):  # left by a killed build of this version
                stale.unlink()
            for f in new_files:
                os.replace(f, target / f.name)
        kill_point("write:files_moved")
        final_version = out / VERSIONS_DIR / version
        final_version.parent.mkdir(exist_ok=True)
        if final_version.exists():
            shutil.rmtree(final_version)
        os.replace(version_dir, final_version)
        kill_point("write:version_renamed")
        write_json_atomically(out / MANIFEST, manifest)
    except OSError as e:
        if e.filename is None and e.errno is not None:  # a failed write() names no file: name the version's
            raise type(e)(e.errno, e.strerror, str(tmp)) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


FAILED_DIR = "failed"  # builds that kept no document: their manifest and quarantine, never current


def _keep_failed_build(out: Path, version: str, version_dir: Path, rejected: Sequence[Path]) -> Path:
    """Move a build that kept nothing (its manifest: each file's error, the drop counts;
    its quarantine) to ``OUT/failed/VERSION-TIME/`` instead of committing it."""
    target = out / FAILED_DIR / f"{version}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(version_dir, target)
    if rejected:
        (target / "rejected").mkdir()
        for f in rejected:
            os.replace(f, target / "rejected" / f.name)
    return target


def _superseded_rows(out: Path, base: dict[str, Any], steps: Sequence[StepResult]) -> pa.Table:
    """``id, url`` of the earlier versions' current documents whose page this version
    captured again, newer (:mod:`~crawl2chat.stages.data.captures`): the newest capture
    stands for the page, kept or not, unless it duplicates that very document."""
    from crawl2chat.stages.data import captures as pages

    extract = next((s for s in steps if s.name == "extract"), None)
    if not base.get("shards") or extract is None:
        return pages.superseded_documents(pages.empty(), pages.empty(), (), {})
    old = pages.read_documents([out / s["path"] for s in base["shards"]], superseded_ids(out, base))
    known = pq.read_table([out / s["path"] for s in base["shards"]], columns=["id"])["id"].to_pylist()
    duplicate_of: dict[str, str] = {}
    dedup = next((s for s in steps if s.name == "dedup"), None)
    files = sorted(Path(dedup.out_dir).glob("*.parquet")) if dedup else []
    if files:
        rows = pq.read_table(files, columns=["id", "dup_cluster"])
        rows = rows.filter(pc.invert(pc.is_null(rows["dup_cluster"])))
        duplicate_of = dict(zip(rows["id"].to_pylist(), rows["dup_cluster"].cast(pa.string()).to_pylist()))
    return pages.superseded_documents(pages.read_captures(extract.out_dir), old, set(known), duplicate_of)


def _nothing_left_sentence(manifest: dict[str, Any], current: dict[str, Any] | None, failed: Path) -> str:
    """One sentence: what left nothing (each unreadable file and its error, or the top drop
    reasons), that nothing was committed, and where the build's record is."""
    files = manifest["files"]
    if files and not any(f["records"] for f in files):
        what = f"No document could be read from the input ({input_problems(files)})"
    else:
        top = ", ".join(f"{r} ({n})" for r, n in Counter(manifest["drop_reasons"]).most_common(3))
        what = f"Every document was dropped (top reasons: {top or 'none'})"
    kept = (f"{current['version']} stays the current version" if current and current.get("version")
            else "no version was made")
    return f"{what}; nothing was committed ({kept}), and this build's manifest and quarantine are in {failed}."


def input_problems(files: Sequence[dict[str, Any]], shown: int = 3) -> str:
    """``name: error`` of the first ``shown`` of a manifest's file entries, for a terminal."""
    named = "; ".join(f"{Path(f['path']).name}: {_first_line(f.get('error')) or 'no records'}" for f in files[:shown])
    return named + (f"; and {len(files) - shown} more" if len(files) > shown else "")


def _first_line(text: str | None, limit: int = 120) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    line = line.split(", first line: ")[0]  # warcio quotes the file's first bytes: noise on a terminal
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _rejected_rows(batch: pa.Table) -> pa.Table:
    not_status = pc.fill_null(pc.not_equal(batch["record_type"], FILE_STATUS), True)
    batch = batch.filter(pc.and_(pc.invert(pc.is_null(batch["drop_reason"])), not_status))
    step = pc.utf8_slice_codeunits(batch["drop_reason"], 0, 64)
    return pa.table(
        {
            "id": batch["id"],
            "url": batch["url"],
            "reason": step,
            "source": batch["source"],
            "lang": batch["lang"] if "lang" in batch.column_names else pa.nulls(batch.num_rows, pa.string()),
            "text": batch["text"],
            # A duplicate names the document its cluster kept (a repeated record: its own id),
            # so later stages can pair the two (free positives for the contrastive stage).
            "dup_cluster": (batch["dup_cluster"].cast(pa.string()) if "dup_cluster" in batch.column_names
                            else pa.nulls(batch.num_rows, pa.string())),
        }
    )
