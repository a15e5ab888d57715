"""MLflow records of a training run: its metrics file followed as it grows, its model folder logged and registered."""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric


class MetricsFollower:
    """Follows a training run's ``metrics.jsonl`` into an MLflow run while it trains.

    :meth:`start` runs a thread that reads the file's new complete lines every
    ``interval`` seconds and logs their numbers (loss, lr, grad_norm,
    tokens_per_second, evaluation figures, ...), each point with its row's ``step``
    and the time the trainer recorded it (``time``), so the MLflow UI fills in as
    the run goes. :meth:`stop` sends what is left.

    Tracking never stops training: a failed send (the server gone, the store
    locked) keeps its points buffered and is retried at the next poll, so they land
    once the server is back; the training result on disk is what counts. A rerun's
    run holds the earlier attempts' points too, less those of the steps trained again
    after the checkpoint it resumed from: they are held back until this attempt's first
    row says where it starts (its ``resume`` or ``start`` event). After a rollback a
    step can appear twice; MLflow keeps both points, and the later one is the one the
    run continued from.
    """

    SKIP = {"step", "time", "batch_index", "world_size"}  # numbers that are coordinates, not metrics
    BATCH = 900  # MLflow's log_batch takes at most 1000 metrics

    def __init__(self, path: Path, run_id: str, client: mlflow.MlflowClient | None = None, interval: float = 1.0,
                 on_step=None):
        self.path = Path(path)
        self.on_step = on_step  # called with each step row (e.g. an infra.progress.StepProgress)
        self.run_id = run_id
        self.client = client or mlflow.MlflowClient()
        self.interval = interval
        self.offset = 0
        # Rows an earlier attempt of the run left (a resume): sent to MLflow with the rest, so
        # the run holds the whole curve, but not shown again as this attempt's progress.
        self.shown_from = self.path.stat().st_size if self.path.exists() else 0
        self.pending: list[Metric] = []
        # An earlier attempt's points, until this attempt says which steps it trains again.
        self.held: list[Metric] | None = [] if self.shown_from else None
        self.sent = 0
        self.failures = 0  # sends that failed (and were retried)
        self.last_error: str | None = None
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drain_timeout = 0.0

    # ------------------------------------------------------------ reading and sending

    def read(self) -> int:
        """Buffer the metrics of the file's new complete lines; returns how many."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete, _, _ = chunk.rpartition(b"\n")
        if not complete:
            return 0
        start = self.offset
        self.offset += len(complete) + 1
        now = int(time.time() * 1000)
        before = len(self.pending)
        for line in complete.split(b"\n"):
            start += len(line) + 1
            earlier_attempt = start <= self.shown_from
            line = line.decode("utf-8", errors="replace")
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            if row.get("type") == "event":
                self.events.append(row)
                kind, at = row.get("event"), row.get("step")
                if kind in ("resume", "start") and isinstance(at, int):
                    # The steps after a resume's checkpoint, or from a start, are trained again:
                    # the points an attempt before it left for them go.
                    keep = (lambda m: m.step <= at) if kind == "resume" else (lambda m: m.step < at)
                    self.pending = [m for m in self.pending if keep(m)]
                    if self.held is not None:
                        self.held = [m for m in self.held if keep(m)]
                        if not earlier_attempt:
                            self._release()
                continue
            if row.get("type") == "step" and self.on_step is not None and not earlier_attempt:
                try:
                    self.on_step(row)
                except Exception:  # noqa: BLE001 - a display problem never stops tracking
                    self.on_step = None
            step = row.get("step", 0)
            step = int(step) if isinstance(step, (int, float)) and math.isfinite(step) else 0
            t = row.get("time")
            stamp = int(t * 1000) if isinstance(t, (int, float)) and math.isfinite(t) else now
            for key, value in row.items():
                if key in self.SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):  # a NaN or an infinity is no figure
                    metric = Metric(key, float(value), stamp, step)
                    if earlier_attempt and self.held is not None:
                        self.held.append(metric)
                    else:
                        if self.held is not None:  # a step row came first: what it trains is redone
                            self._release(lambda m, first=step: m.step < first)
                        self.pending.append(metric)
        return len(self.pending) - before

    def _release(self, keep=lambda m: True) -> None:
        """Queue the earlier attempt's held points that ``keep`` accepts, ahead of this attempt's."""
        if self.held is not None:
            self.pending[:0] = [m for m in self.held if keep(m)]
            self.held = None

    def flush(self) -> bool:
        """Send the buffered points; True when none is left. A failure keeps them for the next try."""
        while self.pending:
            chunk = self.pending[: self.BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
            except Exception as e:  # noqa: BLE001 - any tracking failure is retried, never raised into training
                self.failures += 1
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if self.last_error is None:
                    print(f"[mlflow] metrics not sent ({error}); {len(self.pending)} points kept, retrying",
                          file=sys.stderr, flush=True)
                self.last_error = error
                return False
            del self.pending[: len(chunk)]
            self.sent += len(chunk)
            if self.last_error is not None:
                print("[mlflow] tracking server reachable again; buffered metrics sent", file=sys.stderr, flush=True)
                self.last_error = None
        return True

    def poll(self) -> bool:
        """Read new lines and send everything buffered; True when nothing is left unsent."""
        with self._lock:
            self.read()
            return self.flush()

    # ------------------------------------------------------------ the thread

    def start(self) -> "MetricsFollower":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="metrics-follower", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
        # Stopping: what the run wrote last, and whatever an outage left buffered; an earlier
        # attempt's points when this attempt wrote nothing of its own.
        with self._lock:
            self.read()
            self._release()
        deadline = time.monotonic() + self._drain_timeout
        while not self.poll() and time.monotonic() < deadline:
            if self._server_gone():  # a server that refuses connections is not waited for
                break
            time.sleep(min(self.interval, max(0.0, deadline - time.monotonic())))

    def _server_gone(self) -> bool:
        from crawl2chat.infra.services import unreachable

        return bool(unreachable(self.client.tracking_uri))

    def stop(self, drain_timeout: float = 60.0) -> bool:
        """Stop following after a last read; keep retrying unsent points for up to
        ``drain_timeout`` seconds. Returns True when every point reached MLflow."""
        if self._thread is None:
            with self._lock:
                self.read()
                self._release()
            return self.poll()
        self._drain_timeout = drain_timeout
        self._stop.set()
        self._thread.join(drain_timeout + 30 * self.interval + 5)
        alive = self._thread.is_alive()
        self._thread = None
        if alive or self.pending:
            print(f"[mlflow] {len(self.pending)} metric points could not be sent to {self.run_id}; "
                  f"they stay in {self.path}", file=sys.stderr, flush=True)
            return False
        return True

    def __enter__(self) -> "MetricsFollower":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def log_model_folder(model_dir: Path, registered_name: str | None, alias: str | None) -> str | None:
    """Log the Hugging Face folder as run artifacts and register it; returns the model URI."""
    mlflow.log_artifacts(str(model_dir), artifact_path="model")
    run_id = mlflow.active_run().info.run_id
    uri = f"runs:/{run_id}/model"
    if not registered_name:
        return uri
    # The folder is a plain Hugging Face model (safetensors), not an MLflow flavour,
    # so the version is created from its artifact location directly.
    client = mlflow.MlflowClient()
    try:
        client.get_registered_model(registered_name)
    except mlflow.exceptions.MlflowException:
        client.create_registered_model(registered_name, description="crawl2chat model (Hugging Face format)")
    version = client.create_model_version(registered_name, source=mlflow.get_artifact_uri("model"), run_id=run_id,
                                          tags={"format": "huggingface"})
    if alias:
        client.set_registered_model_alias(registered_name, alias, version.version)
    return f"models:/{registered_name}/{version.version}"
