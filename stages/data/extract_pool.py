"""The extract step of the local data engine over several processes.

Extraction is the one data step with much work per page (~2.5 ms with
Resiliparse, ~36 ms with Trafilatura, all of it holding the GIL), so on the local
engine a large enough input is split over one process per CPU, each a fresh
``python -m crawl2chat.stages.data.extract_pool`` that reads its share of the
input files and writes their Parquet files into the step's folder, the same
rows one process writes. Fresh processes, not ``multiprocessing``: a spawned
``multiprocessing`` child first re-runs the caller's main script (whatever a
script that calls the steps without a ``__main__`` guard does at import), and a
forked one inherits the locks of a flow's other threads. Each worker dies with
the thread that started it (:mod:`crawl2chat.stages.lifetime`) and carries the
command's lifeline.

Starting a worker costs ~0.5 s of imports. Measured on 2 cores, one process against
two: Trafilatura over 0.8 MB of WARC files 1.8-3.4 s against 2.3-2.5 s, over 3.4 MB
8.9-9.1 s against 6.5-7.7 s; Resiliparse over 13.6 MB 2.4-3.7 s against 2.9-3.0 s;
hence the thresholds below (Resiliparse's is the ``auto`` engine's whole range).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)

EXTRACT_POOL_MIN_MB = {"trafilatura": 2.0, "resiliparse": 32.0}


def extract_processes(files: Sequence[str], extract_cfg: Any) -> int:
    """How many processes the local engine extracts ``files`` with: one, or one per CPU
    (at most one per file) for an input of at least ``EXTRACT_POOL_MIN_MB``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpus < 2 or len(files) < 2:
        return 1
    try:
        mb = sum(os.path.getsize(f) for f in files) / 2**20
    except OSError:  # a remote file: no size to judge by
        return 1
    return min(cpus, len(files)) if mb >= EXTRACT_POOL_MIN_MB[extract_cfg.extractor] else 1


def extract_in_processes(files: Sequence[str], out_dir: str, extract_cfg: Any, processes: int,
                         on_done: Callable[[int, int], None]) -> None:
    """Extract ``files`` into ``out_dir`` with ``processes`` workers, each given every
    ``processes``-th of the input's groups of a few files (four groups per worker);
    ``on_done(documents, files)`` is called as each group is written. What a worker
    prints on stderr (library warnings, a traceback) goes to the log, not the terminal;
    a worker that fails is named with its files and its last line, and the step is then
    not committed."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    n_groups = min(len(files), 4 * processes)
    groups = [list(files[i::n_groups]) for i in range(n_groups)]
    settings = extract_cfg.model_dump(mode="json")
    workers: list = []
    try:
        _run_workers(groups, processes, out_dir, settings, on_done, workers)
    except BaseException:
        for proc, _, _ in workers:  # the step failed here (an interrupt, a broken pipe): stop every worker
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise


def _run_workers(groups: list[list[str]], processes: int, out_dir: str, settings: dict,
                 on_done: Callable[[int, int], None], workers: list) -> None:
    """Start the workers (appended to ``workers`` as they start), follow their progress, and
    raise if one failed."""
    from crawl2chat.stages.lifetime import die_with_parent_preexec

    for share in (groups[i::processes] for i in range(processes)):
        errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks on it
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, text=True, preexec_fn=die_with_parent_preexec())
        proc.stdin.write(json.dumps({"groups": share, "out_dir": out_dir, "extract": settings}))
        proc.stdin.close()
        workers.append((proc, share, errors))
    lock = threading.Lock()

    def follow(proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            documents, done = (int(x) for x in line.split())
            with lock:
                on_done(documents, done)

    readers = [threading.Thread(target=follow, args=(p,), daemon=True) for p, _, _ in workers]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    failed = []
    for proc, share, errors in workers:
        proc.wait()
        errors.seek(0)
        printed = errors.read().strip()
        errors.close()
        if proc.returncode != 0:
            log.error("extract worker (pid %d) exited with status %d:\n%s", proc.pid, proc.returncode, printed)
            failed.append((proc.returncode, share, printed.splitlines()[-1] if printed else ""))
        elif printed:
            log.info("extract worker (pid %d) printed:\n%s", proc.pid, printed)
    if failed:
        status, share, last = failed[0]
        names = ", ".join(Path(f).name for group in share for f in group)
        raise RuntimeError(f"the extract worker for {names} exited with status {status}" + (f": {last}" if last else ""))


def _worker() -> None:
    from crawl2chat.stages.data.pipeline import FILE_STATUS, extract_files
    from crawl2chat.stages.data.settings import ExtractConfig
    from crawl2chat.stages.fault_points import kill_point

    import uuid

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    job = json.loads(sys.stdin.read())
    cfg = ExtractConfig.model_validate(job["extract"])
    for group in job["groups"]:
        prefix, documents = uuid.uuid4().hex[:12], 0
        for i, table in enumerate(extract_files({"path": group}, cfg, 512)):
            pq.write_table(table, f"{job['out_dir']}/{prefix}_{i:06d}.parquet", compression="zstd")
            is_status = pc.fill_null(pc.equal(table["record_type"], FILE_STATUS), False)
            documents += table.num_rows - int(pc.sum(pc.cast(is_status, pa.int64())).as_py() or 0)
        kill_point("extract_pool:group_written")  # a fault drill's worker dies here (as the OOM killer kills one)
        print(documents, len(group), flush=True)


if __name__ == "__main__":
    _worker()
