"""The data steps on both engines (stages.data.engine): Ray Data and in-process give the same version."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crawl2chat.stages.data import extract_pool, pipeline as steps
from crawl2chat.stages.data.engine import LOCAL, RAY, LocalEngine, choose
from crawl2chat.stages.data.warc_input import list_input_files
from crawl2chat.stages.settings import load_config


def _inputs(shared: Path) -> list[str]:
    warc = shared / "warc"
    return list_input_files([
        str(warc / "dolma"),  # English pages
        str(warc / "resiliparse" / "warcfile.warc.gz"),  # Chinese
        str(warc / "resiliparse" / "clueweb-quirk.warc.gz"),  # Japanese
        str(warc / "resiliparse" / "clipped.warc.gz"),  # truncated gzip
        str(warc / "warcio" / "example-bad.warc.gz.bad"),  # not per-record gzip
    ])


def _build(cfg, files: list[str], out: Path, engine: str, previous: dict | None = None, until: str | None = None):
    work, d = str(out / "work"), cfg.data
    previous = previous or {}
    results = [steps.extract_step(files, work, d.extract, engine_name=engine)]
    results.append(steps.langid_step(results[-1], work, d.langid, engine_name=engine))
    results.append(steps.quality_step(results[-1], work, d.quality, engine_name=engine))
    results.append(steps.dedup_step(results[-1], work, d.dedup, previous.get("index", ()), previous.get("shards", ()),
                                    engine_name=engine))
    if until == "dedup":
        return results
    results.append(steps.balance_step(results[-1], work, d.balance, engine_name=engine))
    manifest = steps.write_dataset(results, str(out), d.shard_bytes, cfg.model_dump(mode="json"), engine_name=engine)
    return results, manifest


def _rows(step_dir: str) -> list[tuple]:
    """Every row of a step folder as (id, drop_reason, dup_cluster, text digest), sorted."""
    table = pq.read_table(sorted(Path(step_dir).glob("*.parquet")))
    cluster = table["dup_cluster"].to_pylist() if "dup_cluster" in table.column_names else [None] * table.num_rows
    return sorted(
        (i, r, c, hashlib.sha256((t or "").encode()).hexdigest()[:12])
        for i, r, c, t in zip(table["id"].to_pylist(), table["drop_reason"].to_pylist(), cluster,
                              table["text"].to_pylist())
    )


def _sha(paths) -> list[str]:
    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in sorted(paths)]


def test_both_engines_build_the_same_version(shared_data, ray_local, tmp_path):
    """Real WARC files (English, Chinese, Japanese, a truncated and a malformed file): every step
    folder holds the same rows on both engines, and the versions have byte-identical shards.
    Shards of ``data.shard_bytes`` are cut the same on both. Then a second build over more
    files, deduplicated against the first version's index and shards, gives the same decisions
    on both engines too."""
    files = _inputs(shared_data)
    built = {}
    for engine in (RAY, LOCAL):
        out = tmp_path / engine
        cfg = load_config(overrides={"data.out": str(out), "data.shard_bytes": 20_000})
        built[engine] = _build(cfg, files, out, engine)
    (ray_steps, ray_manifest), (local_steps, local_manifest) = built[RAY], built[LOCAL]
    assert ray_manifest["documents_kept"] > 10 and ray_manifest["documents_dropped"] > 0
    for a, b in zip(ray_steps, local_steps):
        assert (a.name, a.kept, a.dropped, a.fingerprint) == (b.name, b.kept, b.dropped, b.fingerprint)
        assert _rows(a.out_dir) == _rows(b.out_dir), a.name
    assert ray_steps[3].extra["dedup"] == local_steps[3].extra["dedup"]
    assert local_manifest["content_digest"] == ray_manifest["content_digest"]
    assert local_manifest["drop_reasons"] == ray_manifest["drop_reasons"]
    assert _sha((tmp_path / LOCAL / "shards").glob("*.parquet")) == _sha((tmp_path / RAY / "shards").glob("*.parquet"))
    bytes_kept = local_steps[-1].bytes_in
    assert len(local_manifest["shards"]) == -(-bytes_kept // 20_000) > 1
    quarantine = {e: sorted(tuple(r.values()) for r in pq.read_table(
        sorted((tmp_path / e / "rejected").glob("*.parquet")), columns=["id", "reason"]).to_pylist())
        for e in (RAY, LOCAL)}
    assert quarantine[RAY] == quarantine[LOCAL] and len(quarantine[RAY]) == ray_manifest["documents_dropped"]

    # Against an earlier version: its dedup index (near and exact duplicates) and its shards (repeated records).
    v1 = tmp_path / "v1"
    _build(load_config(overrides={"data.out": str(v1)}), files[:1], v1, RAY)
    previous = {"index": [str(v1 / "versions" / "v0001" / "dedup_index")],
                "shards": [str(p) for p in sorted((v1 / "shards").glob("*.parquet"))]}
    again = {}
    for engine in (RAY, LOCAL):
        cfg = load_config(overrides={"data.out": str(tmp_path / f"again-{engine}")})
        again[engine] = _build(cfg, files, tmp_path / f"again-{engine}", engine, previous, until="dedup")[-1]
    assert again[RAY].dropped == again[LOCAL].dropped and again[RAY].dropped.get("dedup:repeated_record")
    assert again[RAY].kept < ray_steps[3].kept
    assert _rows(again[RAY].out_dir) == _rows(again[LOCAL].out_dir)


def test_local_groups_unions_and_cuts_mean_what_ray_data_means():
    eng = LocalEngine()
    ds = eng.from_arrow([pa.table({"k": [2, 1, 2], "v": ["a", "b", "c"]}), pa.table({"k": [1, 3], "v": ["d", "e"]})])
    seen = ds.groupby("k", num_partitions=4).map_groups(
        lambda g: pa.table({"k": [g["k"][0].as_py()], "vs": ["".join(sorted(g["v"].to_pylist()))]}),
        batch_format="pyarrow").take_all()
    assert seen == [{"k": 1, "vs": "bd"}, {"k": 2, "vs": "ac"}, {"k": 3, "vs": "e"}]  # whole groups, key order
    # A union of tables with different columns: the missing ones are nulls.
    other = eng.from_arrow([pa.table({"k": [4], "w": [1.5]})])
    rows = ds.union(other).groupby("k").map_groups(lambda g: g, batch_format="pyarrow").take_all()
    assert rows[-1] == {"k": 4, "v": None, "w": 1.5} and rows[0]["w"] is None
    # Exact cuts after a sort, batches of the asked size, generators' tables as blocks.
    cut = ds.sort("v").repartition(target_num_rows_per_block=2, strict=True)
    assert [b.num_rows for b in cut.blocks] == [2, 2, 1] and cut.take_all()[0]["v"] == "a"
    sizes = []
    ds.map_batches(lambda b: sizes.append(b.num_rows) or b, batch_size=2, batch_format="pyarrow")
    assert sizes == [2, 1, 2]

    def split(batch):
        for i in range(len(batch["v"])):
            yield {"v": [batch["v"][i]]}

    assert ds.map_batches(split, batch_size=None, batch_format="numpy").count() == 5


def test_local_write_skips_empty_blocks_and_joins_small_ones(tmp_path, monkeypatch):
    from crawl2chat.stages.data import engine as engine_module

    ds = LocalEngine().from_arrow([pa.table({"a": pa.array([], pa.int64())}), pa.table({"a": [1, 2]}),
                                   pa.table({"a": [3]}), pa.table({"a": [None, 4]})])
    ds.write_parquet(str(tmp_path / "out"), compression="zstd")
    written = list((tmp_path / "out").glob("*.parquet"))
    assert len(written) == 1 and pq.read_table(written[0])["a"].to_pylist() == [1, 2, 3, None, 4]
    # Past the size a file holds, the next block starts a new file; the blocks keep their order.
    monkeypatch.setattr(engine_module, "WRITE_FILE_BYTES", 20)  # blocks of 16, 8 and 17 bytes
    ds.write_parquet(str(tmp_path / "cut"), compression="zstd")
    written = sorted((tmp_path / "cut").glob("*.parquet"))
    assert [pq.read_table(f)["a"].to_pylist() for f in written] == [[1, 2], [3], [None, 4]]


def test_auto_picks_local_for_small_inputs_only(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    small = tmp_path / "a.warc.gz"
    small.write_bytes(b"x" * 1000)
    assert choose("auto", [str(small)], 1.0) == LOCAL
    assert choose("auto", [str(small)], 0.0005) == RAY  # 1000 bytes > 0.0005 MB
    assert choose("auto", ["s3://bucket/crawl.warc.gz"], 1.0) == RAY  # size unknown here
    assert choose("ray", [str(small)], 1.0) == RAY and choose("local", ["s3://b/x.warc.gz"], 1.0) == LOCAL
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert choose("auto", [str(small)], 1.0) == RAY  # a named cluster is used


def test_auto_builds_larger_inputs_in_process_on_fewer_cpus(tmp_path, monkeypatch):
    """Unset, the in-process limit is 32 MB x 8 / CPUs, at least 32 MB: a 100 MB input is built
    in process on 2 CPUs (limit 128 MB) and on Ray from 4 (64 MB)."""
    from crawl2chat.stages.data import engine

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert [engine.default_local_max_mb(c) for c in (1, 2, 4, 8, 64)] == [256.0, 128.0, 64.0, 32.0, 32.0]
    big = tmp_path / "big.warc.gz"
    with open(big, "wb") as f:
        f.truncate(100 * 2**20)  # sparse: 100 MB as the size the rule reads
    assert load_config().data.local_max_mb is None
    monkeypatch.setattr(engine, "usable_cpus", lambda: 2)
    assert choose("auto", [str(big)], None) == LOCAL
    assert choose("auto", [str(big)], 50.0) == RAY  # a set limit is the limit
    monkeypatch.setattr(engine, "usable_cpus", lambda: 4)
    assert choose("auto", [str(big)], None) == RAY
    assert choose("auto", [str(big)], 200.0) == LOCAL


def test_engine_setting_is_refused_when_unknown():
    with pytest.raises(Exception, match="engine"):
        load_config(overrides={"data.engine": "spark"})


NEEDS_TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: the extract step uses no pool")


@NEEDS_TWO_CPUS
def test_extract_in_a_pool_of_processes_gives_the_same_rows(shared_data, tmp_path, monkeypatch):
    """The local engine's extract step over a pool of processes (used above EXTRACT_POOL_MIN_MB,
    here forced) writes the rows one process writes."""
    files = _inputs(shared_data)
    cfg = load_config(overrides={"data.out": str(tmp_path)}).data
    one = steps.extract_step(files, str(tmp_path / "one"), cfg.extract, engine_name=LOCAL)
    assert "processes" not in one.extra
    monkeypatch.setitem(extract_pool.EXTRACT_POOL_MIN_MB, cfg.extract.extractor, 0.0)
    counted: list[dict] = []
    pooled = steps.extract_step(files, str(tmp_path / "pool"), cfg.extract, counted.append, engine_name=LOCAL)
    assert pooled.extra["processes"] == min(len(os.sched_getaffinity(0)), len(files)) > 1
    assert _rows(one.out_dir) == _rows(pooled.out_dir) and pooled.kept == one.kept > 0
    assert pooled.extra["files"] == one.extra["files"]
    assert counted[-1] == {"documents": one.rows_in, "files": len(files)}


POOL_DRIVER = textwrap.dedent("""
    import sys
    from crawl2chat.stages.data import extract_pool, pipeline as steps
    from crawl2chat.stages.settings import load_config
    extract_pool.EXTRACT_POOL_MIN_MB["trafilatura"] = 0.0
    cfg = load_config(overrides={"data.extract.extractor": "trafilatura"}).data
    steps.extract_step(sys.argv[2:] * 50, sys.argv[1], cfg.extract, engine_name="local")
""")


@NEEDS_TWO_CPUS
def test_extract_pool_dies_with_its_parent(shared_data, tmp_path):
    """SIGKILL of the process running the extract step (which extracts too): its workers exit too."""
    import psutil

    driver = subprocess.Popen([sys.executable, "-c", POOL_DRIVER, str(tmp_path / "work"), *_inputs(shared_data)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    children: list = []
    while time.monotonic() < deadline:
        children = psutil.Process(driver.pid).children(recursive=True)
        workers = [c for c in children if "crawl2chat.stages.data.extract_pool" in c.cmdline()]
        if len(workers) >= len(os.sched_getaffinity(0)) - 1:
            break
        time.sleep(0.1)
    assert len(workers) == len(os.sched_getaffinity(0)) - 1, [c.cmdline() for c in children]
    time.sleep(1)  # the pool's processes at work
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=30)
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert alive == [], [p.cmdline() for p in alive]
    assert not (tmp_path / "work" / "extract").exists()  # nothing committed


def _distinct_warcs(folder: Path, pages: list[int]) -> list[str]:
    """WARC files of ``pages[i]`` HTML pages each, no two bodies alike (so every page is
    extracted: a repeated body would be looked up)."""
    import io
    import random

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    rng = random.Random(5)
    words = "river bridge market stone guild wool salt timber valley harbour ledger museum square".split()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f, n_pages in enumerate(pages):
        path = folder / f"pages-{f:02d}.warc.gz"
        with open(path, "wb") as out:
            writer = WARCWriter(out, gzip=True)
            for p in range(n_pages):
                paras = "".join(f"<p>{' '.join(rng.choices(words, k=40))} {f}-{p}-{i}.</p>" for i in range(30))
                body = f"<html><body><nav>Home About</nav><article>{paras}</article></body></html>".encode()
                http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
                writer.write_record(writer.create_warc_record(f"http://site{f}.example.org/{p}", "response",
                                                              payload=io.BytesIO(body), length=len(body),
                                                              http_headers=http))
        paths.append(str(path))
    return paths


@NEEDS_TWO_CPUS
def test_a_failing_extract_worker_is_named_and_nothing_is_committed(tmp_path, monkeypatch):
    """A worker killed while it works (the OOM killer's way) ends the step with an error naming
    its files; the step folder is not committed and a rerun builds it."""
    cfg = load_config(overrides={"data.out": str(tmp_path), "data.extract.extractor": "trafilatura"}).data
    monkeypatch.setitem(extract_pool.EXTRACT_POOL_MIN_MB, cfg.extract.extractor, 0.0)
    # The step's own process takes the largest file first and is still at it (~3.5 s on 2 cores)
    # when the worker is ready for a group (~1 s).
    files = _distinct_warcs(tmp_path / "in", [1200] + [10] * 6)
    monkeypatch.setenv("CRAWL2CHAT_KILL_AT", "extract_pool:group_written")
    with pytest.raises(RuntimeError, match=r"the extract worker for .*\.warc.* exited with status -9"):
        steps.extract_step(files, str(tmp_path / "work"), cfg.extract, engine_name=LOCAL)
    assert not (tmp_path / "work" / "extract").exists()
    monkeypatch.delenv("CRAWL2CHAT_KILL_AT")
    again = steps.extract_step(files, str(tmp_path / "work"), cfg.extract, engine_name=LOCAL)
    assert not again.skipped and again.kept > 0 and again.extra["processes"] == min(
        len(os.sched_getaffinity(0)), len(files))
