"""The extract step of the local data engine over several processes.

Extraction is the one data step with much work per page (~2.5 ms with
Resiliparse, ~36 ms with Trafilatura, all of it holding the GIL), so on the local
engine a large enough input is split over one process per CPU: the step's own
process and fresh ``python -m crawl2chat.stages.data.extract_pool`` workers.
Each takes the input's groups of a few files one at a time from one queue, the
step's process from its own thread and a worker through its stdin, and writes
their Parquet files into the step's folder, the same rows one process writes;
a worker still starting leaves its groups to the others. Fresh processes, not
``multiprocessing``: a spawned ``multiprocessing`` child first re-runs the
caller's main script (whatever a script that calls the steps without a
``__main__`` guard does at import), and a forked one inherits the locks of a
flow's other threads. Each worker dies with the thread that started it
(:mod:`crawl2chat.stages.lifetime`) and carries the command's lifeline.

Starting a worker costs ~0.5 s of imports, paid while the step's process
already extracts. Measured on 2 cores, the step's process alone against it and
one worker (inputs whose every body is distinct): Trafilatura over 0.8 MB of WARC
files 2.3 s against 1.5-1.8 s; Resiliparse over 3.4 MB 0.9 s against 1.2 s,
over 6.8 MB 1.6-2.2 s against 1.5-1.7 s, over 13.6 MB 3.0-3.6 s against
1.8-2.8 s; hence the thresholds below.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

from crawl2chat.stages.data.engine import usable_cpus

log = logging.getLogger(__name__)

EXTRACT_POOL_MIN_MB = {"trafilatura": 0.5, "resiliparse": 6.0}


def extract_processes(files: Sequence[str], extract_cfg: Any) -> int:
    """How many processes the local engine extracts ``files`` with: one, or one per CPU
    (at most one per file) for an input of at least ``EXTRACT_POOL_MIN_MB``."""
    cpus = usable_cpus()
    if cpus < 2 or len(files) < 2:
        return 1
    try:
        mb = sum(os.path.getsize(f) for f in files) / 2**20
    except OSError:  # a remote file: no size to judge by
        return 1
    return min(cpus, len(files)) if mb >= EXTRACT_POOL_MIN_MB[extract_cfg.extractor] else 1


def write_group(group: Sequence[str], out_dir: str, extract_cfg: Any,
                site_templates: dict[str, list[str]] | None = None) -> int:
    """Extract one group of files into ``out_dir`` (Parquet files of up to 512 rows); the
    number of documents written (file-status rows not counted)."""
    import uuid

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from crawl2chat.stages.data.pipeline import FILE_STATUS, extract_files

    prefix, documents = uuid.uuid4().hex[:12], 0
    for i, table in enumerate(extract_files({"path": list(group)}, extract_cfg, 512, site_templates=site_templates)):
        pq.write_table(table, f"{out_dir}/{prefix}_{i:06d}.parquet", compression="zstd")
        is_status = pc.fill_null(pc.equal(table["record_type"], FILE_STATUS), False)
        documents += table.num_rows - int(pc.sum(pc.cast(is_status, pa.int64())).as_py() or 0)
    return documents


def extract_in_processes(files: Sequence[str], out_dir: str, extract_cfg: Any, processes: int,
                         on_done: Callable[[int, int], None],
                         site_templates: dict[str, list[str]] | None = None) -> None:
    """Extract ``files`` into ``out_dir`` with this process and ``processes - 1`` workers,
    all taking the input's groups of a few files (four groups per process) from one queue;
    ``on_done(documents, files)`` is called as each group is written. What a worker prints on
    stderr (library warnings, a traceback) goes to the log, not the terminal; a worker that
    fails is named with its files and its last line, and the step is then not committed."""
    from crawl2chat.stages.lifetime import die_with_parent_preexec

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    n_groups = min(len(files), 4 * processes)
    # Largest groups first, so the last ones to finish are small (files of unknown size count as 0).
    queue = deque(sorted((list(files[i::n_groups]) for i in range(n_groups)), key=_size, reverse=True))
    lock = threading.Lock()
    job = json.dumps({"out_dir": out_dir, "extract": extract_cfg.model_dump(mode="json"),
                      "site_templates": site_templates})
    workers: list[_Worker] = []
    try:
        for _ in range(processes - 1):
            errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks on it
            proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=errors, text=True, preexec_fn=die_with_parent_preexec())
            workers.append(_Worker(proc, errors, queue, lock, on_done, job))
        while True:
            with lock:
                group = queue.popleft() if queue else None
            if group is None or any(w.stopped_early() for w in workers):  # the step fails: no more work
                break
            documents = write_group(group, out_dir, extract_cfg, site_templates)
            with lock:
                on_done(documents, len(group))
        for worker in workers:
            worker.reader.join()
        _raise_if_failed(workers)
    except BaseException:
        for worker in workers:  # the step failed here (an interrupt, a broken pipe): stop every worker
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait()
        raise


def _size(group: Sequence[str]) -> int:
    return sum(os.path.getsize(f) if os.path.exists(f) else 0 for f in group)


class _Worker:
    """One worker process and the thread that hands it groups from the queue, one at a time,
    and reports each it finishes."""

    def __init__(self, proc: subprocess.Popen, errors: Any, queue: deque, lock: threading.Lock,
                 on_done: Callable[[int, int], None], job: str):
        self.proc, self.errors, self.done, self.lost, self.finished = proc, errors, [], None, False
        self.reader = threading.Thread(target=self._follow, args=(queue, lock, on_done, job), daemon=True)
        self.reader.start()

    def stopped_early(self) -> bool:
        return not self.reader.is_alive() and not self.finished

    def _follow(self, queue: deque, lock: threading.Lock, on_done: Callable[[int, int], None], job: str) -> None:
        stdin, given = self.proc.stdin, None
        try:
            stdin.write(job + "\n")
            stdin.flush()
            if self.proc.stdout.readline().strip() != "ready":  # it failed to start; its exit status tells why
                raise BrokenPipeError
            while True:  # a group at a time, once the worker is ready: one still starting claims none
                with lock:
                    given = queue.popleft() if queue else None
                if given is None:
                    break
                stdin.write(json.dumps(given) + "\n")
                stdin.flush()
                line = self.proc.stdout.readline()
                if not line:  # the worker died on this group
                    raise BrokenPipeError
                documents, done = (int(x) for x in line.split())
                self.done.append(given)
                given = None
                with lock:
                    on_done(documents, done)
            stdin.close()
            self.finished = True
        except Exception:  # noqa: BLE001 - the worker is gone, or talks nonsense: it is stopped here
            self.lost = given  # the group it had, if any
            if self.proc.poll() is None:
                self.proc.kill()
        self.proc.wait()


def _raise_if_failed(workers: list[_Worker]) -> None:
    failed = []
    for worker in workers:
        worker.errors.seek(0)
        printed = worker.errors.read().strip()
        worker.errors.close()
        pid, status = worker.proc.pid, worker.proc.returncode
        if status != 0 or not worker.finished:
            log.error("extract worker (pid %d) exited with status %d:\n%s", pid, status, printed)
            failed.append((status, [worker.lost] if worker.lost else worker.done, printed))
        elif printed:
            log.info("extract worker (pid %d) printed:\n%s", pid, printed)
    if failed:
        status, groups, printed = failed[0]
        names = ", ".join(Path(f).name for group in groups for f in group)
        last = printed.splitlines()[-1] if printed else ""
        who = f"the extract worker for {names}" if names else "an extract worker, before it took any file,"
        raise RuntimeError(f"{who} exited with status {status}" + (f": {last}" if last else ""))


def _worker() -> None:
    from crawl2chat.stages.data.settings import ExtractConfig
    from crawl2chat.stages.fault_points import kill_point

    # Its stdout is the talk with the step's process alone: whatever a library prints goes to stderr.
    talk = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    job = json.loads(sys.stdin.readline())
    cfg = ExtractConfig.model_validate(job["extract"])
    from crawl2chat.stages.data import pipeline  # noqa: F401 - imported before it says it is ready
    from crawl2chat.stages.data.extract import warm_up

    warm_up(cfg.extractor)  # ready once warm: until then the queue's groups go to processes already extracting
    print("ready", file=talk, flush=True)
    for line in sys.stdin:
        group = json.loads(line)
        documents = write_group(group, job["out_dir"], cfg, job.get("site_templates"))
        kill_point("extract_pool:group_written")  # a fault drill's worker dies here (as the OOM killer kills one)
        print(documents, len(group), file=talk, flush=True)


if __name__ == "__main__":
    _worker()
