"""One writer per output folder.

A training run folder, a dataset folder being built and an export folder are
each held by an exclusive lock while something writes them: ``hold_folder(path)``
takes ``fcntl.flock`` on ``.NAME.lock`` beside the folder (beside, so a step
that replaces the folder whole keeps its lock) and writes the holder's pid and
command line into it. A second writer gets :class:`FolderBusy` at once, with a
message naming the holder's pid, or waits for it when ``CRAWL2CHAT_LOCK_WAIT``
is set to a number of seconds.

The kernel drops a flock when its holder dies, however it dies, so a lock left by
a killed process is simply taken over; the pid left in the file is only a label.

Within one process the lock is re-entrant (the training task holds a run folder
and calls the launch that holds it again). A process started on behalf of the
holder (the training script under ``accelerate launch`` of a command that holds
the run folder) finds the holder among its ancestors and proceeds: it is the
holder's own work, not a second writer.
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

WAIT_ENV = "CRAWL2CHAT_LOCK_WAIT"  # seconds a second writer waits for the folder; unset or 0: refuse at once

_held: dict[str, list] = {}  # lock file -> [open file, depth]
_guard = threading.Lock()


class FolderBusy(RuntimeError):
    """Another process is writing the folder."""

    def __init__(self, folder: Path, pid: int | None, holder: str):
        self.folder, self.pid, self.holder = folder, pid, holder
        who = f"process {pid}" if pid else "another process"
        super().__init__(
            f"{folder} is being written by {who}{f' ({holder})' if holder else ''}; wait for it to finish or "
            f"stop it, or set {WAIT_ENV}=SECONDS to wait for it")

    def __reduce__(self):  # rebuilt whole where Ray or Prefect unpickles it, not from the message alone
        return type(self), (self.folder, self.pid, self.holder)


def lock_path(folder: str | os.PathLike) -> Path:
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


def wait_seconds() -> float:
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"{WAIT_ENV}={raw!r} must be 0 or more seconds")
    return value


def read_holder(folder: str | os.PathLike) -> tuple[int | None, str]:
    """The pid and command line last written into a folder's lock file."""
    try:
        text = lock_path(folder).read_text(errors="replace")
    except OSError:
        return None, ""
    first, _, rest = text.partition("\n")
    return (int(first) if first.strip().isdigit() else None), rest.strip()


EXITING_GRACE = 15.0  # seconds a dying holder gets to release its lock


def _holder_exiting(pid: int | None) -> bool:
    """The holder is a zombie, gone, or an orphan re-parented to init: its
    parent died, so its parent-death signal has been sent."""
    if pid is None:
        return False
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return True
        return proc.ppid() in (0, 1)
    except psutil.Error:
        return True


def _ancestor_holds(pid: int | None) -> bool:
    if pid is None:
        return False
    from crawl2chat.stages.lifetime import ancestors

    return pid in ancestors()


@contextmanager
def hold_folder(folder: str | os.PathLike, wait: float | None = None):
    """Hold ``folder`` for writing for the duration of the ``with`` block.

    Raises :class:`FolderBusy` naming the holder when another process has it and
    it is not released within ``wait`` seconds (default ``CRAWL2CHAT_LOCK_WAIT``,
    else 0). Yields the lock file's path."""
    path = acquire(folder, wait)
    try:
        yield path
    finally:
        release(path)


def acquire(folder: str | os.PathLike, wait: float | None = None) -> Path:
    """Take the lock (see :func:`hold_folder`); pair with :func:`release`, or keep it
    for the rest of the process's life."""
    folder = Path(folder).resolve()
    path = lock_path(folder)
    key = str(path)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return path
    wait = wait_seconds() if wait is None else wait
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+", encoding="utf-8")
    deadline, extended = time.monotonic() + wait, False
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pid, holder = read_holder(folder)
            if _ancestor_holds(pid):
                # The folder's holder started this process to do its work.
                f.close()
                with _guard:
                    _held[key] = [None, 1]
                return path
            if time.monotonic() >= deadline and not extended and _holder_exiting(pid):
                # A rank whose launcher was just killed holds the lock until the
                # kernel has finished tearing it down (its parent-death signal
                # is already on its way): a rerun started at once waits for that.
                deadline, extended = time.monotonic() + EXITING_GRACE, True
            if time.monotonic() >= deadline:
                f.close()
                if pid is None:  # the holder is between taking the lock and labelling it
                    time.sleep(0.2)
                    pid, holder = read_holder(folder)
                raise FolderBusy(folder, pid, holder) from None
            time.sleep(min(0.5, max(0.01, deadline - time.monotonic())))
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n{_command_line()[:500]}\n")
    f.flush()
    with _guard:
        _held[key] = [f, 1]
    return path


def _command_line() -> str:
    import psutil

    try:
        return " ".join(psutil.Process().cmdline())
    except psutil.Error:
        return " ".join(sys.argv)


def release(path: Path) -> None:
    key = str(path)
    with _guard:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
    f = entry[0]
    if f is not None:
        # The file stays: a waiter may hold it open, and removing it would let a
        # third process lock a new file of the same name beside the waiter's.
        f.seek(0)
        f.truncate()
        f.close()
