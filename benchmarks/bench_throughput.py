"""Data-stage throughput: crawl2chat's data steps against datatrove, side by side.

One run measures, for each corpus scale (1x, 4x, 16x by default), the same four steps
on the same WARC files in both frameworks:

    extract (WARC -> main text) -> language ID (lid.176, keep score > 0.65)
    -> Gopher quality rules -> MinHash near-dedup (word 5-grams, 14 bands x 8 rows)

and prints, per step, wall time, documents/s, MB/s and peak RSS of the whole process
tree (the driver plus every Ray / multiprocessing worker, RSS summed every 0.2 s),
then the crawl2chat / datatrove ratios and how time and memory grow with scale.
After the per-step run, the whole ``crawl2chat data`` command runs over the same files
with the same step settings, in a fresh project folder, as a user runs it: start-up,
Prefect's flow and task runs, MLflow's records, the steps, balancing, the dataset
version and its review sample; its wall time is set against datatrove's whole run
(``--steps-only`` skips it). The first such command on a machine also builds the
Prefect and MLflow database templates every later project folder starts from (a one-off
~4-9 s), so one untimed command runs first. ``--against-server`` times the whole command
a second time against a ``prefect server start`` the benchmark keeps running on
127.0.0.1 (``PREFECT_API_URL``, as for a user with the Prefect UI open or a scheduled
refresh): the command then starts no API of its own. Last, per input file, the
documents each side got out of extraction (the two WARC readers keep different records).

    /work/main/.venv/bin/python benchmarks/bench_throughput.py                # 1x, 4x, 16x
    /work/main/.venv/bin/python benchmarks/bench_throughput.py --scales 1,4   # quicker

crawl2chat runs in a subprocess of the project venv (``--_side crawl2chat``), datatrove
in a subprocess of a separate venv (``--with-peer`` makes it on first use, see
``benchmarks/peers.py``; ``--bench-python`` points at another one) -- never install
datatrove into the project venv. The same file is the entry point of both subprocesses: only the parent imports
psutil, only each side imports its own framework.

How the two sides are made comparable
-------------------------------------
* crawl2chat's engine (``--engine``): ``auto`` as ``crawl2chat data`` picks it (in this
  process up to ``data.local_max_mb`` of input, else Ray), ``local`` or ``ray`` (a local Ray
  with ``--workers`` CPUs); the JSON result records which one ran.
* Steps are materialised the same way: every step of either side reads the previous
  step's Parquet output and writes its own (crawl2chat's step folders; datatrove
  ParquetReader -> step -> ParquetWriter, one LocalPipelineExecutor per step with
  ``--workers`` processes). MinHash on datatrove is its stages 1-4 (signatures, buckets,
  clusters, filter), timed together as the dedup step.
* Extractor: ``--extractor trafilatura`` (default) runs trafilatura on both sides with the
  options crawl2chat uses (no precision bias, no trafilatura dedup, tables kept; the
  bench venv pins the project's trafilatura version, not the 1.x datatrove asks for).
  ``--extractor resiliparse`` runs crawl2chat's default extractor on crawl2chat and a
  small datatrove ``BaseExtractor`` that calls resiliparse with the same arguments.
* Language ID: both load the lid.176.ftz shipped inside crawl2chat (datatrove's
  LanguageFilter would download lid.176.bin; its model path is pointed at the local file).
  All languages are kept if the top score exceeds 0.65. crawl2chat classifies the first
  2000 characters (its ``prefix_chars``), datatrove the whole text.
* Quality: only crawl2chat's Gopher quality rules are enabled (repetition, C4, FineWeb and
  the classifier are switched off), against datatrove's GopherQualityFilter defaults.
* Dedup: 14 bands x 8 rows over word 5-grams on both. crawl2chat also runs its exact
  (normalised hash) pass, which is part of its dedup step.
* Scaling: copy k of every WARC file gets new WARC-Record-IDs (uuid5 of the original id
  and k) and a different host in WARC-Target-URI (``cK.<host>``); payloads are byte-for-byte
  the same, so at Nx every document has N-1 exact duplicates. This deliberately exercises
  the dedup path (clusters of size N); the kept count after dedup stays roughly constant.
  crawl2chat extracts a body it has extracted lately only once (``stages/data/extract.py``),
  so at Nx its extract step does about one page's work per distinct page. ``--distinct-payloads``
  ends the HTML body of every response in copy k with the comment ``<!-- copy k -->``
  (Content-Length adjusted): every body is then new to both sides and each page is extracted
  again, while the extracted text, and so every later step, stays the same.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# datatrove's venv (its extras pin an old trafilatura and another fastText build: never the project's venv);
# the project's trafilatura goes in over datatrove's pin, so both sides extract with the same version
# (with the HTML cleaner that lxml no longer ships, which trafilatura imports).
DATATROVE_REQUIREMENTS = ["datatrove[io,processing]==0.10.1", "spacy", "psutil", "Resiliparse==2.0.1"]
DATATROVE_OVERRIDES = ["trafilatura==2.3.1", "lxml_html_clean==0.4.6"]
DEFAULT_INPUTS = [
    "/work/shared/data/warc/dolma/*.warc.gz",
    "/work/shared/data/warc/resiliparse/warcfile.warc.gz",
    "/work/shared/data/warc/resiliparse/clueweb-quirk.warc.gz",
]
STEPS = ("extract", "langid", "quality", "dedup")
LANGID_MIN_SCORE = 0.65
MINHASH = {"bands": 14, "rows": 8, "ngram": 5}
# The options crawl2chat's html_to_text passes to trafilatura (stages/data/extract.py).
TRAFILATURA_KW = {"include_comments": False, "include_tables": True, "deduplicate": False,
                  "with_metadata": False}


# --------------------------------------------------------------------------- corpus

_ID_LINE = re.compile(rb"^(WARC-[A-Za-z-]+: *<urn:uuid:)([0-9a-fA-F-]+)(>)", re.MULTILINE)
_URI_LINE = re.compile(rb"^(WARC-Target-URI: *<?[A-Za-z][A-Za-z0-9+.-]*://)", re.MULTILINE)


def _rewrite_headers(data: bytes, k: int) -> bytes:
    """New record ids and hosts for copy ``k``, in WARC header lines only (payload untouched).

    A header line is only rewritten inside a WARC header block, i.e. between a ``WARC/x.y``
    line and the first blank line after it.
    """
    out, pos = [], 0
    for m in re.finditer(rb"(?m)^WARC/[0-9]+\.[0-9]+\r?\n", data):
        if m.start() < pos:
            continue
        end = data.find(b"\r\n\r\n", m.end())
        end = len(data) if end < 0 else end
        head = data[m.start():end]
        head = _ID_LINE.sub(
            lambda g: g.group(1) + str(uuid.uuid5(uuid.NAMESPACE_URL, f"{g.group(2).decode()}/{k}")).encode()
            + g.group(3), head)
        head = _URI_LINE.sub(lambda g: g.group(1) + f"c{k}.".encode(), head)
        out += [data[pos:m.start()], head]
        pos = end
    out.append(data[pos:])
    return b"".join(out)


_CONTENT_LENGTH = re.compile(rb"(?im)^(Content-Length:[ \t]*)(\d+)")
_RECORD_START = re.compile(rb"(?m)^WARC/[0-9]+\.[0-9]+\r?\n")
_HEAD_END = re.compile(rb"\r?\n\r?\n")


def _marked_body(body: bytes, http_head: bytes, mark: bytes) -> bytes | None:
    """``body`` ending in ``mark`` once decoded as its HTTP head says, or None if it cannot be."""
    try:
        if re.search(rb"(?m)^transfer-encoding:[ \t]*chunked", http_head):  # a chunk before the last, empty one
            end = body.rstrip().rfind(b"\n0")
            return None if end < 0 else body[:end + 1] + b"%x\r\n%s\r\n" % (len(mark), mark) + body[end + 1:]
        if body[:2] == b"\x1f\x8b":  # gzip content encoding (some crawls keep the header, not the coding)
            return gzip.compress(gzip.decompress(body) + mark, mtime=0)
        return body + mark
    except (OSError, EOFError):
        return None


def _distinct_bodies(data: bytes, k: int) -> bytes:
    """``data`` (WARC records) with ``<!-- copy k -->`` at the end of the HTML body of every
    response record, the WARC (and any HTTP) Content-Length grown to match."""
    mark = f"\n<!-- copy {k} -->".encode()
    out, pos = [], 0
    while (m := _RECORD_START.search(data, pos)) is not None:
        head_end = data.find(b"\r\n\r\n", m.start())
        length = _CONTENT_LENGTH.search(data, m.start(), head_end) if head_end > 0 else None
        if length is None:
            break
        head, start = data[m.start():head_end], head_end + 4
        block = data[start:start + int(length.group(2))]
        split = _HEAD_END.search(block)
        http_head = block[:split.start()].lower() if split else b""
        if b"warc-type: response" in head.lower() and b"text/html" in http_head:
            body = _marked_body(block[split.end():], http_head, mark)
            if body is not None:
                http = _CONTENT_LENGTH.sub(lambda g: g.group(1) + str(len(body)).encode(), block[:split.end()])
                block = http + body
                head = _CONTENT_LENGTH.sub(lambda g: g.group(1) + str(len(block)).encode(), head, count=1)
        out += [data[pos:m.start()], head, b"\r\n\r\n", block]
        pos = start + int(length.group(2))
    out.append(data[pos:])
    return b"".join(out)


def _gzip_members(raw: bytes):
    while raw:
        d = zlib.decompressobj(31)
        yield d.decompress(raw) + d.flush()
        raw = d.unused_data


def replicate(src: str, dst: str, k: int, distinct_bodies: bool = False) -> None:
    """Copy ``src`` to ``dst`` with the record headers of copy ``k`` (k=0: byte copy), and
    with ``distinct_bodies`` its HTML bodies made distinct (:func:`_distinct_bodies`).

    A gzipped WARC is rewritten member by member, so each record stays its own gzip member.
    """
    if k == 0:
        shutil.copyfile(src, dst)
        return

    def rewrite(data: bytes) -> bytes:
        data = _rewrite_headers(data, k)
        return _distinct_bodies(data, k) if distinct_bodies else data

    raw = Path(src).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        with open(dst, "wb") as f:
            for member in _gzip_members(raw):
                f.write(gzip.compress(rewrite(member), compresslevel=6, mtime=0))
    else:
        Path(dst).write_bytes(rewrite(raw))


def build_corpus(inputs: list[str], scale: int, root: Path, distinct_bodies: bool = False) -> Path:
    corpus = root / f"corpus-{scale}x"
    if corpus.exists():
        shutil.rmtree(corpus)
    corpus.mkdir(parents=True)
    for k in range(scale):
        for src in inputs:
            name = Path(src).name
            stem, dot, ext = name.partition(".")
            replicate(src, str(corpus / f"{stem}-c{k:02d}{dot}{ext}"), k, distinct_bodies)
    return corpus


def corpus_files(corpus: Path) -> list[str]:
    return sorted(str(p) for p in corpus.iterdir() if p.is_file())


_COPY_SUFFIX = re.compile(r"-c\d{2}(?=\.)")


def input_name(path: str) -> str:
    """The input file a corpus copy was made from (``warcfile-c03.warc.gz`` -> ``warcfile.warc.gz``)."""
    return _COPY_SUFFIX.sub("", Path(path).name, count=1)


def per_input_counts(extract_dir: str) -> dict[str, dict]:
    """crawl2chat's extract step, per input file (its copies summed): WARC records read, documents
    kept, and the records dropped by reason."""
    import pyarrow.parquet as pq

    from crawl2chat.stages.data.pipeline import FILE_STATUS

    files = sorted(glob.glob(os.path.join(extract_dir, "*.parquet")))
    out: dict[str, dict] = {}
    if not files:
        return out
    rows = pq.read_table(files, columns=["url", "source", "record_type", "drop_reason", "records_read"]).to_pylist()
    for r in rows:
        if r["record_type"] == FILE_STATUS:
            c = out.setdefault(input_name(r["url"]), {"records": 0, "kept": 0, "dropped": {}})
            c["records"] += r["records_read"] or 0
    for r in rows:
        if r["record_type"] == FILE_STATUS:
            continue
        c = out.setdefault(input_name(r["source"]), {"records": 0, "kept": 0, "dropped": {}})
        if r["drop_reason"]:
            c["dropped"][r["drop_reason"]] = c["dropped"].get(r["drop_reason"], 0) + 1
        else:
            c["kept"] += 1
    return out


# --------------------------------------------------------------------------- RSS sampling


class TreeSampler:
    """Sums the RSS of a process and all its descendants every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.2):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ps = self.psutil
        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except ps.Error:
                procs = []
            for p in procs:
                try:
                    total += p.memory_info().rss
                except ps.Error:
                    pass
            if procs:
                self.samples.append((time.time(), total))
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float | None = None, end: float | None = None) -> int:
        vals = [r for t, r in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        return max(vals, default=0)


def run_sampled(cmd: list[str], log_path: Path, env: dict | None, cwd: Path) -> tuple[int, float, TreeSampler]:
    """Run ``cmd`` in its own session, output to ``log_path``, sampling its process tree's RSS;
    returns its exit status, wall time and the sampler."""
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd),
                                start_new_session=True)
        with TreeSampler(proc.pid) as sampler:
            rc = proc.wait()
        return rc, time.time() - t0, sampler


def run_side(cmd: list[str], result_path: Path, log_path: Path, env: dict | None = None) -> dict:
    """Run one side as a subprocess, sampling its process tree; returns its JSON result."""
    rc, wall, sampler = run_sampled(cmd, log_path, env, REPO)
    if rc != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{cmd[0]} {' '.join(cmd[2:6])} ... exited {rc}; log {log_path}:\n{tail}")
    res = json.loads(result_path.read_text())
    res["wall_total"] = wall
    res["peak_rss"] = sampler.peak()
    for step in res["steps"]:
        step["peak_rss"] = sampler.peak(step["t_start"], step["t_end"])
    return res


# --------------------------------------------------------------------------- crawl2chat side


def _set_first(model_cls, tree: dict, candidates: dict[str, list[str]]) -> None:
    """Set a value under the first field name the pydantic model actually has."""
    fields = set(getattr(model_cls, "model_fields", {}))
    for value_key, names in candidates.items():
        for name in names:
            if name in fields:
                tree[name] = MINHASH[value_key]
                break


def step_overrides(extractor: str) -> dict:
    """crawl2chat's settings for the steps datatrove runs: its extractor, language ID at
    datatrove's threshold over every language, Gopher quality alone, MinHash at datatrove's
    bands, rows and n-grams."""
    from crawl2chat.stages.data.settings import DedupConfig

    dedup_over: dict = {}
    _set_first(DedupConfig, dedup_over, {
        "bands": ["num_bands", "bands", "minhash_bands"],
        "rows": ["rows_per_band", "band_rows", "rows", "minhash_rows"],
        "ngram": ["ngram_size", "ngram", "n_grams", "shingle_size", "word_ngrams"],
    })
    return {
        "data": {
            "extract": {"extractor": extractor},
            "langid": {"min_score": LANGID_MIN_SCORE, "languages": None},
            "quality": {
                "gopher_repetition": {"enabled": False},
                "gopher_quality": {"enabled": True},
                "c4": {"enabled": False},
                "fineweb": {"enabled": False},
                "classifier": {"enabled": False},
            },
            "dedup": {"method": "minhash", **dedup_over},
        }
    }


def set_flags(tree: dict, prefix: str = "") -> list[str]:
    """Nested settings -> the command line's ``--set KEY.PATH=VALUE`` flags (values as YAML)."""
    flags = []
    for key, value in tree.items():
        if isinstance(value, dict):
            flags += set_flags(value, f"{prefix}{key}.")
        else:
            flags += ["--set", f"{prefix}{key}={json.dumps(value)}"]
    return flags


def whole_command(files: list[str], folder: Path, extractor: str, engine: str, log_path: Path,
                  env: dict) -> dict:
    """The whole ``crawl2chat data`` command over ``files``, as a user runs it, in a fresh project
    folder, with the steps set as on the per-step side: start-up, the Prefect flow run and its
    tasks, MLflow's run records, the steps, balancing, the dataset version, the review sample.
    Wall time and the peak RSS of its process tree."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd = [str(Path(sys.executable).with_name("crawl2chat")), "data", "--out", str(folder / "data"),
           *[f"--input={f}" for f in files], *set_flags(step_overrides(extractor)),
           "--set", f"data.engine={engine}"]
    rc, wall, sampler = run_sampled(cmd, log_path, env, folder)
    if rc != 0:
        raise RuntimeError(f"crawl2chat data exited {rc}; log {log_path}:\n{log_path.read_text(errors='replace')[-3000:]}")
    manifest = json.loads((folder / "data" / "manifest.json").read_text())
    return {"wall_total": wall, "peak_rss": sampler.peak(), "final_kept": manifest["documents_kept"]}


def start_server(root: Path, env: dict) -> tuple[subprocess.Popen, dict]:
    """``prefect server start`` on 127.0.0.1 with its database under ``root``, kept running for
    the whole commands timed against it; returns the process and their environment. The server
    runs in a session of its own (stopped whole by ``stop_group``) and dies with the benchmark."""
    sys.path.insert(0, str(REPO / "tests"))
    from live_services import start_prefect_server

    home = root / "prefect-server"
    home.mkdir(parents=True, exist_ok=True)
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    proc, api = start_prefect_server(dict(server_env, PREFECT_HOME=str(home), PREFECT_UI_ENABLED="false"), root,
                                     die_with_parent=True)
    print(f"Prefect server for --against-server: {api}", flush=True)
    return proc, dict(env, PREFECT_API_URL=api)


def crawl2chat_side(args: argparse.Namespace) -> None:
    t_import = time.time()
    from crawl2chat.stages.settings import load_config
    from crawl2chat.infra.ray_runtime import ensure_ray
    from crawl2chat.stages.data import pipeline as dp

    overrides = step_overrides(args.extractor)
    cfg = load_config(overrides=overrides)
    files = corpus_files(Path(args.corpus))
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    from crawl2chat.stages.data.engine import choose

    args.engine = choose(args.engine, files, cfg.data.local_max_mb)
    t_ray = time.time()
    if args.engine == "ray":
        ensure_ray(num_cpus=args.workers)
    t_ready = time.time()

    steps = []

    def timed(name, fn):
        t0 = time.time()
        res = fn()
        t1 = time.time()
        steps.append({"name": name, "t_start": t0, "t_end": t1, "seconds": t1 - t0,
                      "rows_in": res.rows_in, "kept": res.kept, "bytes_in": res.bytes_in,
                      "dropped": res.dropped})
        return res

    ex = timed("extract", lambda: dp.extract_step(files, str(work), cfg.data.extract, engine_name=args.engine))
    steps[-1]["docs"] = ex.kept  # documents produced
    steps[-1]["bytes"] = sum(os.path.getsize(f) for f in files)  # WARC bytes read (gzipped)
    up = ex
    for name, fn, c in (("langid", dp.langid_step, cfg.data.langid),
                        ("quality", dp.quality_step, cfg.data.quality),
                        ("dedup", dp.dedup_step, cfg.data.dedup)):
        prev_kept = up.kept
        up = timed(name, lambda: fn(up, str(work), c, engine_name=args.engine))
        steps[-1]["docs"] = prev_kept  # documents in
        steps[-1]["bytes"] = up.bytes_in  # text bytes of those documents
    out = {"steps": steps, "engine": args.engine, "startup": {"imports": t_ray - t_import, "ray_init": t_ready - t_ray},
           "final_kept": up.kept, "dedup_config": cfg.data.dedup.model_dump(),
           "per_input": per_input_counts(ex.out_dir)}
    Path(args.result).write_text(json.dumps(out, default=str))
    import ray

    ray.shutdown()


# --------------------------------------------------------------------------- datatrove side


def _parquet_stats(folder: str) -> tuple[int, int]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(folder, "**", "*.parquet"), recursive=True))
    if not files:
        return 0, 0
    t = pq.read_table(files, columns=["text"])
    return t.num_rows, int(pc.sum(pc.binary_length(t["text"].cast("large_binary"))).as_py() or 0)


def _datatrove_per_input(extract_dir: str) -> dict[str, dict]:
    """Datatrove's documents out of extraction per input file (its copies summed), from the
    ``file_path`` its reader adds to each document's metadata."""
    import pyarrow.parquet as pq

    files = sorted(glob.glob(os.path.join(extract_dir, "**", "*.parquet"), recursive=True))
    out: dict[str, dict] = {}
    if files:
        for meta in pq.read_table(files, columns=["metadata"])["metadata"].to_pylist():
            c = out.setdefault(input_name((meta or {}).get("file_path") or "?"), {"kept": 0})
            c["kept"] += 1
    return out


def datatrove_side(args: argparse.Namespace) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                          MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.extractors.base import BaseExtractor
    from datatrove.pipeline.filters import GopherQualityFilter, LanguageFilter
    from datatrove.pipeline.readers import ParquetReader, WarcReader
    from datatrove.pipeline.writers import ParquetWriter
    from datatrove.utils.hashing import HashConfig

    class Resiliparse(BaseExtractor):
        """resiliparse main-content extraction with crawl2chat's arguments."""

        name = "⛏ Resiliparse"
        _requires_dependencies = ["resiliparse"]

        def __init__(self, timeout: float = 1):  # abstract in datatrove's BaseExtractor
            super().__init__(timeout)

        def extract(self, text: str) -> str:
            from resiliparse.extract.html2text import extract_plain_text

            return extract_plain_text(text, preserve_formatting=True, main_content=True, alt_texts=False)

    files = corpus_files(Path(args.corpus))
    n_files = len(files)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    W = args.workers
    logs = str(work / "logs")
    d = {s: str(work / s) for s in STEPS}
    # Same timeout headroom on both sides: crawl2chat has no per-document extraction timeout.
    if args.extractor == "trafilatura":
        # datatrove itself passes include_comments=False and deduplicate=...
        kw = {k: v for k, v in TRAFILATURA_KW.items() if k not in ("include_comments", "deduplicate")}
        extractor = Trafilatura(favour_precision=False, deduplicate=False, timeout=60, **kw)
    else:
        extractor = Resiliparse(timeout=60)
    lang = LanguageFilter(languages=None, language_threshold=LANGID_MIN_SCORE)
    lang.model.MODEL_URL = args.lid_model  # local lid.176.ftz, copied into datatrove's cache (no download)
    mh = MinhashConfig(n_grams=MINHASH["ngram"], num_buckets=MINHASH["bands"],
                       hashes_per_bucket=MINHASH["rows"], hash_config=HashConfig(precision=64))

    def writer(step):
        return ParquetWriter(d[step], compression="zstd")

    def run(name, pipeline, tasks, workers=W):
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(workers, tasks),
                              logging_dir=f"{logs}/{name}", skip_completed=False).run()

    steps = []

    def timed(name, fn):
        t0 = time.time()
        fn()
        t1 = time.time()
        steps.append({"name": name, "t_start": t0, "t_end": t1, "seconds": t1 - t0})

    t0 = time.time()
    timed("extract", lambda: run("extract", [
        WarcReader(str(args.corpus), glob_pattern="*.warc*"), extractor, writer("extract")], n_files))
    docs, _ = _parquet_stats(d["extract"])
    steps[-1].update(docs=docs, bytes=sum(os.path.getsize(f) for f in files), kept=docs)
    prev = "extract"
    for name, step in (("langid", lang), ("quality", GopherQualityFilter())):
        n_in, b_in = _parquet_stats(d[prev])
        n_tasks = max(1, len(glob.glob(f"{d[prev]}/*.parquet")))
        timed(name, lambda: run(name, [ParquetReader(d[prev]), step, writer(name)], n_tasks))
        steps[-1].update(docs=n_in, bytes=b_in, kept=_parquet_stats(d[name])[0])
        prev = name

    n_in, b_in = _parquet_stats(d[prev])
    n_tasks = max(1, len(glob.glob(f"{d[prev]}/*.parquet")))
    sigs, buckets, clusters = (str(work / x) for x in ("mh_sigs", "mh_buckets", "mh_remove"))

    def dedup():
        run("mh1", [ParquetReader(d[prev]), MinhashDedupSignature(output_folder=sigs, config=mh)], n_tasks)
        run("mh2", [MinhashDedupBuckets(input_folder=sigs, output_folder=buckets, config=mh)], mh.num_buckets)
        run("mh3", [MinhashDedupCluster(input_folder=buckets, output_folder=clusters, config=mh)], 1)
        run("mh4", [ParquetReader(d[prev]), MinhashDedupFilter(input_folder=clusters), writer("dedup")],
            n_tasks)

    timed("dedup", dedup)
    steps[-1].update(docs=n_in, bytes=b_in, kept=_parquet_stats(d["dedup"])[0])
    out = {"steps": steps, "startup": {"imports": t0 - args.t_start, "ray_init": 0.0},
           "final_kept": steps[-1]["kept"], "per_input": _datatrove_per_input(d["extract"])}
    Path(args.result).write_text(json.dumps(out, default=str))


# --------------------------------------------------------------------------- report


def _mb(b: float) -> float:
    return b / 1e6


def print_scale(scale: int, c2c: dict | None, dt: dict | None, corpus_bytes: int, n_files: int,
                command: dict | None = None, command_server: dict | None = None) -> None:
    print(f"\n=== scale {scale}x: {n_files} WARC files, {_mb(corpus_bytes):.1f} MB gzipped ===")
    hdr = f"{'step':<9}{'side':<11}{'docs':>7}{'kept':>7}{'wall s':>9}{'docs/s':>9}{'MB/s':>8}{'peak RSS MB':>13}"
    print(hdr)
    print("-" * len(hdr))
    sides = [("crawl2chat", c2c), ("datatrove", dt)]
    for i, name in enumerate(STEPS):
        for side, res in sides:
            if not res:
                continue
            s = res["steps"][i]
            sec = max(s["seconds"], 1e-9)
            print(f"{name:<9}{side:<11}{s['docs']:>7}{s['kept']:>7}{s['seconds']:>9.2f}{s['docs'] / sec:>9.1f}"
                  f"{_mb(s['bytes']) / sec:>8.2f}{_mb(s['peak_rss']):>13.0f}")
    for side, res in sides:
        if res:
            st = res["startup"]
            steps_s = sum(s["seconds"] for s in res["steps"])
            print(f"{'TOTAL':<9}{side:<11}{res['steps'][0]['docs']:>7}{res['final_kept']:>7}{res['wall_total']:>9.2f}"
                  f"{'':>9}{_mb(corpus_bytes) / res['wall_total']:>8.2f}{_mb(res['peak_rss']):>13.0f}"
                  f"   (steps {steps_s:.1f}s, imports {st['imports']:.1f}s, ray init {st['ray_init']:.1f}s"
                  + (f", engine {res['engine']})" if res.get("engine") else ")"))
    if c2c and dt:
        print("ratio crawl2chat/datatrove (time <1 and docs/s >1 favour crawl2chat):")
        for i, name in enumerate(STEPS):
            a, b = c2c["steps"][i], dt["steps"][i]
            rt = a["seconds"] / max(b["seconds"], 1e-9)
            ra = (a["docs"] / max(a["seconds"], 1e-9)) / max(b["docs"] / max(b["seconds"], 1e-9), 1e-9)
            rm = a["peak_rss"] / max(b["peak_rss"], 1)
            print(f"  {name:<9} time x{rt:.2f}   docs/s x{ra:.2f}   peak RSS x{rm:.2f}")
        print(f"  {'TOTAL':<9} time x{c2c['wall_total'] / dt['wall_total']:.2f}   "
              f"peak RSS x{c2c['peak_rss'] / max(dt['peak_rss'], 1):.2f}")
        print_per_input(c2c.get("per_input") or {}, dt.get("per_input") or {})
    if command:
        print(f"whole command: crawl2chat data {command['wall_total']:.2f} s, {command['final_kept']} documents kept, "
              f"peak RSS {_mb(command['peak_rss']):.0f} MB (start-up, Prefect flow and task runs, MLflow records, "
              "the steps above, balancing, the dataset version and its review)"
              + (f"; datatrove's whole run {dt['wall_total']:.2f} s: x{command['wall_total'] / dt['wall_total']:.2f}"
                 if dt else ""))
    if command_server:
        print(f"whole command against a running Prefect server: crawl2chat data {command_server['wall_total']:.2f} s, "
              f"peak RSS {_mb(command_server['peak_rss']):.0f} MB"
              + (f"; datatrove's whole run {dt['wall_total']:.2f} s: x{command_server['wall_total'] / dt['wall_total']:.2f}"
                 if dt else ""))


def print_per_input(c2c: dict[str, dict], dt: dict[str, dict]) -> None:
    """Documents out of extraction per input file on both sides, with what crawl2chat read and
    dropped: the two WARC readers keep different records, and a file one side reads nothing
    from is work only the other side does."""
    print("extraction per input file (copies summed): records read and documents kept by crawl2chat "
          "(dropped, by reason), documents kept by datatrove")
    for name in sorted(set(c2c) | set(dt)):
        a, b = c2c.get(name, {}), dt.get(name, {})
        drops = ", ".join(f"{k} {v}" for k, v in sorted(a.get("dropped", {}).items()))
        line = (f"  {name:<32} crawl2chat {a.get('records', 0):>6} read {a.get('kept', 0):>6} kept"
                f"{f' ({drops})' if drops else ''};  datatrove {b.get('kept', 0):>6} kept")
        if a.get("records", 0) and not b.get("kept", 0):
            line += "  <- datatrove's reader yields nothing from this file"
        print(line)


def print_growth(results: dict[int, dict]) -> None:
    scales = sorted(results)
    if len(scales) < 2:
        return
    base = scales[0]
    print(f"\n=== growth with corpus size (relative to {base}x) ===")
    print(f"{'side':<11}{'metric':<22}" + "".join(f"{f'{s}x':>12}" for s in scales))
    for side in ("crawl2chat", "datatrove"):
        if not all(results[s].get(side) for s in scales):
            continue
        r = {s: results[s][side] for s in scales}
        rows = [("total wall s", [r[s]["wall_total"] for s in scales]),
                ("steps wall s", [sum(x["seconds"] for x in r[s]["steps"]) for s in scales])]
        rows += [(f"  {n} s", [r[s]["steps"][i]["seconds"] for s in scales]) for i, n in enumerate(STEPS)]
        rows += [("peak RSS MB", [_mb(r[s]["peak_rss"]) for s in scales])]
        for label, vals in rows:
            print(f"{side:<11}{label:<22}" + "".join(f"{v:>12.1f}" for v in vals))
        t = [r[s]["wall_total"] for s in scales]
        m = [r[s]["peak_rss"] for s in scales]
        print(f"{side:<11}{'time / time@base':<22}" + "".join(f"{v / t[0]:>12.2f}" for v in t))
        print(f"{side:<11}{'RSS / RSS@base':<22}" + "".join(f"{v / m[0]:>12.2f}" for v in m))


def resolve_inputs(patterns: list[str]) -> list[str]:
    out: list[str] = []
    for p in patterns:
        hits = sorted(glob.glob(p)) if any(ch in p for ch in "*?[") else ([p] if os.path.exists(p) else [])
        out += [h for h in hits if os.path.isfile(h)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", action="append", help="WARC file or glob (repeatable); default: the "
                    "dolma and resiliparse samples under /work/shared/data/warc")
    ap.add_argument("--scales", default="1,4,16", help="comma-separated replication factors")
    ap.add_argument("--extractor", choices=["trafilatura", "resiliparse"], default="trafilatura")
    ap.add_argument("--engine", choices=["auto", "ray", "local"], default="auto",
                    help="crawl2chat's data engine: Ray Data on --workers CPUs, in-process (one core), or as "
                         "`crawl2chat data` picks it (auto: in-process up to data.local_max_mb of input)")
    ap.add_argument("--distinct-payloads", action="store_true",
                    help="make every copy's HTML bodies distinct, so no page's extraction is reused")
    ap.add_argument("--workers", type=int, default=2, help="Ray CPUs / datatrove worker processes")
    ap.add_argument("--bench-python", default=None, help="python of a datatrove venv (default: the peer venv "
                    "benchmarks/peers.py keeps)")
    ap.add_argument("--with-peer", action="store_true", help="create the datatrove venv if it does not exist")
    ap.add_argument("--sides", default="crawl2chat,datatrove")
    ap.add_argument("--work-dir", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--json", default=None, help="also write all figures to this JSON file")
    ap.add_argument("--retries", type=int, default=1, help="rerun a side that fails this many times")
    ap.add_argument("--against-server", action="store_true",
                    help="also time the whole command against a running Prefect server on 127.0.0.1")
    ap.add_argument("--steps-only", action="store_true",
                    help="skip timing the whole `crawl2chat data` command (start-up, Prefect, MLflow, versions)")
    # internal: one side's run
    ap.add_argument("--_side", choices=["crawl2chat", "datatrove"], help=argparse.SUPPRESS)
    ap.add_argument("--_corpus", dest="corpus", help=argparse.SUPPRESS)
    ap.add_argument("--_work", dest="work", help=argparse.SUPPRESS)
    ap.add_argument("--_result", dest="result", help=argparse.SUPPRESS)
    ap.add_argument("--_lid", dest="lid_model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.t_start = T_START

    if args._side == "crawl2chat":
        return crawl2chat_side(args)
    if args._side == "datatrove":
        return datatrove_side(args)

    inputs = resolve_inputs(args.input or DEFAULT_INPUTS)
    if not inputs:
        sys.exit("no input WARC files found; pass --input PATH")
    scales = [int(s) for s in args.scales.split(",") if s.strip()]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if "datatrove" in sides and args.bench_python is None:
        sys.path.insert(0, str(HERE))
        from peers import PeerMissing, peer_python

        try:
            args.bench_python = str(peer_python("datatrove", DATATROVE_REQUIREMENTS, args.with_peer, DATATROVE_OVERRIDES))
        except PeerMissing as e:
            sys.exit(f"{e}, or pass --sides crawl2chat")
    if "datatrove" in sides and not os.path.exists(args.bench_python):
        sys.exit(f"{args.bench_python} not found: pass --with-peer or --sides crawl2chat")
    from crawl2chat.stages.data.langid import bundled_model_path

    lid = bundled_model_path()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-throughput-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0", TQDM_DISABLE="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("RAY_ADDRESS", None)  # always a local Ray of --workers CPUs
    print(f"inputs: {len(inputs)} files ({', '.join(Path(p).name for p in inputs)})")
    print(f"extractor: {args.extractor}; workers: {args.workers}; MinHash {MINHASH['bands']} bands x "
          f"{MINHASH['rows']} rows, word {MINHASH['ngram']}-grams; scratch: {root}")
    if "datatrove" in sides:
        v = subprocess.run([args.bench_python, "-c", "from importlib.metadata import version as v; "
                            "print(v('datatrove'), v('trafilatura'))"],
                           capture_output=True, text=True)
        print(f"datatrove {v.stdout.split()[0] if v.returncode == 0 else '?'}, trafilatura "
              f"{v.stdout.split()[-1] if v.returncode == 0 else '?'} in {args.bench_python}")
    results: dict[int, dict] = {}
    server = None
    try:
        if args.against_server and "crawl2chat" in sides and not args.steps_only:
            server, server_env = start_server(root, env)
        for scale in scales:
            corpus = build_corpus(inputs, scale, root, args.distinct_payloads)
            files = corpus_files(corpus)
            corpus_bytes = sum(os.path.getsize(f) for f in files)
            results[scale] = {"files": len(files), "bytes": corpus_bytes}
            for side in sides:
                py = sys.executable if side == "crawl2chat" else args.bench_python
                res_path = root / f"{side}-{scale}x.json"
                cmd = [py, str(Path(__file__).resolve()), "--_side", side, "--_corpus", str(corpus),
                       "--_work", str(root / f"work-{side}-{scale}x"), "--_result", str(res_path),
                       "--_lid", lid, "--extractor", args.extractor, "--workers", str(args.workers),
                       "--engine", args.engine]
                for attempt in range(args.retries + 1):
                    try:
                        results[scale][side] = run_side(cmd, res_path, root / f"{side}-{scale}x.log", env)
                        break
                    except RuntimeError as e:
                        last = str(e).strip().splitlines()[-1]
                        print(f"  [{scale}x] {side} FAILED (attempt {attempt + 1}): {last}", flush=True)
                if side in results[scale]:
                    print(f"  [{scale}x] {side}: {results[scale][side]['wall_total']:.1f}s", flush=True)
            if "crawl2chat" in sides and not args.steps_only:
                try:
                    if scale == scales[0]:
                        warm = whole_command(files, root / "command-first", args.extractor, args.engine,
                                             root / "command-first.log", env)
                        print(f"  [{scale}x] crawl2chat data, first command on this machine (untimed warm-up): "
                              f"{warm['wall_total']:.1f}s", flush=True)
                    results[scale]["command"] = whole_command(files, root / f"command-{scale}x", args.extractor,
                                                              args.engine, root / f"command-{scale}x.log", env)
                    print(f"  [{scale}x] crawl2chat data (the whole command): "
                          f"{results[scale]['command']['wall_total']:.1f}s", flush=True)
                except RuntimeError as e:
                    print(f"  [{scale}x] crawl2chat data FAILED: {str(e).strip().splitlines()[0]}", flush=True)
                if server is not None:
                    try:
                        results[scale]["command_server"] = whole_command(
                            files, root / f"command-server-{scale}x", args.extractor, args.engine,
                            root / f"command-server-{scale}x.log", server_env)
                        print(f"  [{scale}x] crawl2chat data against the running Prefect server: "
                              f"{results[scale]['command_server']['wall_total']:.1f}s", flush=True)
                    except RuntimeError as e:
                        print(f"  [{scale}x] crawl2chat data against the server FAILED: "
                              f"{str(e).strip().splitlines()[0]}", flush=True)
            print_scale(scale, results[scale].get("crawl2chat"), results[scale].get("datatrove"),
                        corpus_bytes, len(files), results[scale].get("command"), results[scale].get("command_server"))
            sys.stdout.flush()
        print_growth(results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    finally:
        if server is not None:
            from live_services import stop_group

            stop_group(server)
        if not args.keep and not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)


T_START = time.time()

if __name__ == "__main__":
    main()
