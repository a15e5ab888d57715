"""Documents counted while a data step's Ray Data job (or in-process job) runs.

A step's work happens in Ray worker processes, so the driver cannot see how far
it got. Each step wraps its per-document function (:class:`Counted`,
:class:`CountedClass`): once a batch is done, the worker adds its row count to a
small tally actor (one short call per batch, waited for, so the total read when
the job has ended is complete). While the job
runs, :func:`counting` reads the tally every ``every`` seconds on the driver and
hands the number to the caller's ``on_count``; the caller decides how to show it
(the Prefect tasks draw a progress line). Without ``on_count`` there is no tally
and the wrapped functions count nothing. A step run in this process (the ``local``
data engine) counts into a plain locked object instead of an actor.

What is counted, per step: extract, the documents read out of the input files
(and files finished); langid, quality and balance, the documents each has
judged; dedup, the documents whose keys (exact hash and LSH bands) are computed,
the per-document part of the step (the groupbys that follow work on buckets and
clusters, not documents); augment, the source documents processed.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

OnCount = Callable[[dict[str, int]], None]


class _Tally:
    """Running totals by name (``documents``, ``files``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + int(n)

    def read(self) -> dict[str, int]:
        return dict(self.counts)


def batch_rows(batch: Any) -> int:
    """Rows of a ``map_batches`` batch (an Arrow table, a pandas frame or a dict of columns)."""
    if hasattr(batch, "num_rows"):
        return int(batch.num_rows)
    if isinstance(batch, dict):
        return len(next(iter(batch.values()), ()))
    return len(batch)


class _LocalTally:
    """The tally of a step run in this process (the ``local`` data engine): no actor to call."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, name: str, n: int) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + int(n)

    def read(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)


def report(tally: Any, name: str, n: int) -> None:
    """Add ``n`` to the tally (from a Ray worker) and wait until it is recorded: calls from
    different workers are not ordered with the driver's last read, so a batch whose count
    were still in flight when its job ended would be missing from the final figure. A
    tally of ``None`` counts nothing."""
    if tally is None or not n:
        return
    if isinstance(tally, _LocalTally):
        tally.add(name, n)
    else:
        import ray

        ray.get(tally.add.remote(name, n))


class Counted:
    """A ``map_batches`` function that counts each input batch's rows once ``fn`` is done with it."""

    def __init__(self, fn: Callable, tally: Any, name: str = "documents"):
        self.fn, self.tally, self.name = fn, tally, name

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(batch, *args, **kwargs)
        report(self.tally, self.name, batch_rows(batch))
        return out


class CountedClass:
    """The same for a callable class run on an actor pool: built with
    ``fn_constructor_args=(cls, cls_args, tally)``."""

    def __init__(self, cls: type, cls_args: tuple, tally: Any, name: str = "documents"):
        self.inner, self.tally, self.name = cls(*cls_args), tally, name

    def __call__(self, batch: Any) -> Any:
        out = self.inner(batch)
        report(self.tally, self.name, batch_rows(batch))
        return out


@contextmanager
def counting(on_count: OnCount | None, engine_name: str = "ray", every: float = 1.0) -> Iterator[Any]:
    """A tally for the step's functions (``None`` when ``on_count`` is ``None``): an actor
    for steps on Ray, a plain object for steps run in this process (``engine_name``
    ``local``); its counts go to ``on_count`` at the start (``{}``), every ``every``
    seconds while the block runs, and once more when it ends without an error. A count
    that cannot be read is skipped, never an error of the step."""
    if on_count is None:
        yield None
        return
    local = engine_name == "local"
    if local:
        tally = _LocalTally()
    else:
        import ray  # imported here: a step run in this process never needs it

        tally = ray.remote(num_cpus=0)(_Tally).remote()
    stop = threading.Event()
    on_count({})  # the step starts: nothing counted yet

    def send() -> None:
        try:
            on_count(tally.read() if local else ray.get(tally.read.remote(), timeout=30))
        except Exception as e:  # noqa: BLE001 - a progress line is not worth failing a step
            log.debug("progress count not read: %s", e)

    def poll() -> None:
        while not stop.wait(every):
            send()

    thread = threading.Thread(target=poll, name="crawl2chat-step-progress", daemon=True)
    thread.start()
    try:
        yield tally
        stop.set()
        thread.join()
        send()
    finally:
        stop.set()
        thread.join()
        if not local:
            ray.kill(tally)
