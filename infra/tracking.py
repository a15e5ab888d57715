"""MLflow wiring: where runs go and how a stage's run is opened.

With no tracking server configured, runs go to SQLite under the project folder
(``<home>/mlflow.db``, artifacts beside it), which needs no service. Set
``MLFLOW_TRACKING_URI`` (or ``tracking.uri`` in the config) to use a server.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import mlflow

from crawl2chat.infra.services import require, unreachable
from crawl2chat.infra.sqlite_templates import copy_template, save_template, template_path
from crawl2chat.stages.secrets import mask_secrets


# mlflow.set_tracking_uri writes the URI it is given back into os.environ, so the
# user's own MLFLOW_TRACKING_URI is read once, before this process sets any: a
# long-lived process (a flow server, a test session) running flows with different
# homes would otherwise send every later run to the first one's store.
_USER_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI")


def tracking_uri(home: str | Path, configured: str | None = None) -> str:
    uri = configured or _USER_TRACKING_URI
    if uri:
        return uri
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a plain ``sqlite:///PATH`` store URI, else None."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return None
    return Path(uri[len("sqlite:///"):])


def _mlflow_template() -> Path:
    return template_path(f"mlflow-{mlflow.__version__}")


def _without_experiments(con) -> None:
    # The default experiment's artifact folder is the creating process's ./mlruns: MLflow
    # makes it again, for the new folder, when it opens a store without it.
    con.execute("DELETE FROM experiment_tags")
    con.execute("DELETE FROM experiments")


SERVER_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def tracking_lost(error: BaseException) -> str | None:
    """One sentence when ``error`` (or an error it was raised from) is the tracking server no
    longer answering; None otherwise."""
    from mlflow.exceptions import MlflowException

    uri = mlflow.get_tracking_uri()
    seen: BaseException | None = error
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, (MlflowException, ConnectionError)) or type(seen).__module__.startswith(
                ("requests", "urllib3")):
            why = unreachable(uri)
            if why:
                return (f"The MLflow tracking server at {uri} stopped answering ({why}); the work done is kept "
                        "on disk, and rerunning the command once the server answers records it without redoing it.")
        seen = seen.__cause__ or seen.__context__
    return None


def setup_tracking(home: str | Path, experiment: str, configured: str | None = None) -> str:
    """Point MLflow at the store and make sure the experiment exists (artifacts under home).
    A new SQLite store starts from the machine's migrated template
    (:mod:`crawl2chat.infra.sqlite_templates`) instead of MLflow's migration chain."""
    uri = tracking_uri(home, configured)
    require("MLflow tracking server", uri, "tracking.uri" if configured else "MLFLOW_TRACKING_URI")
    if uri.startswith(("http://", "https://")):
        # A server that goes away costs each call MLflow's whole retry schedule (7 retries with
        # doubling waits: ~4 minutes), and a stage makes dozens after training: fewer and
        # shorter retries, so a lost server is said within a minute (unless set otherwise).
        for name, value in SERVER_RETRIES.items():
            os.environ.setdefault(name, value)
    db = _sqlite_file(uri)
    fresh = db is not None and not db.exists() and not copy_template(_mlflow_template(), db)
    mlflow.set_tracking_uri(uri)
    existing = mlflow.get_experiment_by_name(experiment)  # opens (and, when fresh, migrates) the store
    if fresh:
        save_template(db, _mlflow_template(), scrub=_without_experiments)
    if existing is None:
        artifact_location = None
        if uri.startswith("sqlite:"):
            artifact_location = (Path(home).resolve() / "mlartifacts").as_uri()
        mlflow.create_experiment(experiment, artifact_location=artifact_location)
    mlflow.set_experiment(experiment)
    close_abandoned_runs()
    return uri


def flatten(prefix: str, value: Any, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested config -> flat ``a.b.c`` params (lists as JSON), MLflow's param shape."""
    out = {} if out is None else out
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        text = json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
        out[prefix] = text[:6000]
    return out


def safe_params(params: dict[str, Any]) -> dict[str, Any]:
    """Flat MLflow params with credentials masked (:func:`~crawl2chat.stages.secrets.mask_secrets`):
    by value anywhere (a URI's password, ``?token=``, ``AKIA...``), and by the last
    part of the name when it names a secret (``tracking.db_password``)."""
    return mask_secrets(params)


# Which process opened a run: "host:pid:start time". A run left RUNNING by a process that
# is gone (killed with SIGKILL, a machine reset) is closed as KILLED by the next command on
# that host (:func:`close_abandoned_runs`), so the UI and lineage do not show it as running.
OWNER_TAG = "crawl2chat.owner"


def _process_owner(pid: int | None = None) -> str | None:
    import socket

    import psutil

    try:
        proc = psutil.Process(pid)
        return f"{socket.gethostname()}:{proc.pid}:{proc.create_time():.2f}"
    except psutil.Error:
        return None


def close_abandoned_runs() -> list[str]:
    """Mark KILLED the runs this host's processes opened and left RUNNING when they died;
    returns their ids. Runs of live processes, and other hosts' runs, are left alone."""
    import socket

    host = socket.gethostname()
    try:
        running = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                     filter_string=f"attributes.status = 'RUNNING' and tags.\"{OWNER_TAG}\" LIKE '{host}:%'")
    except Exception:  # noqa: BLE001 - tidying the store never stops a command
        return []
    closed = []
    client = mlflow.MlflowClient()
    for run in running:
        owner = run.data.tags.get(OWNER_TAG, "")
        try:
            pid = int(owner.split(":")[-2])
        except (IndexError, ValueError):
            continue
        if _process_owner(pid) != owner:  # gone, or the pid now belongs to another process
            client.set_terminated(run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
    return closed


def close_own_runs(status: str = "KILLED") -> None:
    """End every run this process opened and left RUNNING (from any thread): for a command
    that must end while its main thread, which would close them, cannot run."""
    owner = _process_owner()
    if not owner:
        return
    running = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                 filter_string=f"attributes.status = 'RUNNING' and tags.\"{OWNER_TAG}\" = '{owner}'")
    client = mlflow.MlflowClient()
    for run in running:
        client.set_terminated(run.info.run_id, status)


# The pipeline's parent run. Prefect may run a task in another thread, where MLflow's
# thread-local active run is not visible; a context variable travels with the task.
parent_run_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("crawl2chat_parent_run", default=None)


@contextlib.contextmanager
def closed_killed_when_stopped() -> Iterator[None]:
    """End the active run ``KILLED`` when the command is stopped on purpose (Ctrl-C, or
    SIGTERM, which Prefect raises as ``TerminationSignal``); MLflow would mark it FAILED,
    as a run that broke."""
    loaded = sys.modules.get("prefect.exceptions")  # only Prefect raises TerminationSignal
    stops = (KeyboardInterrupt, *((loaded.TerminationSignal,) if loaded else ()))
    try:
        yield
    except stops:
        mlflow.end_run("KILLED")
        raise


@contextlib.contextmanager
def pipeline_run(name: str, params: dict[str, Any] | None = None, tags: dict[str, str] | None = None) -> Iterator[mlflow.ActiveRun]:
    """The parent run of one pipeline run; stage runs opened inside become its children."""
    with mlflow.start_run(run_name=name, tags={"crawl2chat.pipeline": name, OWNER_TAG: _process_owner() or "",
                                               **(tags or {})}) as run:
        if params:
            mlflow.log_params(safe_params(flatten("", mask_secrets(params))))
        token = parent_run_id.set(run.info.run_id)
        try:
            with closed_killed_when_stopped():
                yield run
        finally:
            parent_run_id.reset(token)


@contextlib.contextmanager
def stage_run(name: str, params: dict[str, Any] | None = None, tags: dict[str, str] | None = None) -> Iterator[mlflow.ActiveRun]:
    """A child run under the pipeline run (or a top-level run when there is none)."""
    active = mlflow.active_run()
    parent = active.info.run_id if active else parent_run_id.get()
    with mlflow.start_run(
        run_name=name,
        nested=active is not None,
        parent_run_id=parent if active is None else None,
        tags={"crawl2chat.stage": name, OWNER_TAG: _process_owner() or "", **(tags or {})},
    ) as run:
        if params:
            mlflow.log_params(safe_params(flatten("", mask_secrets(params))))
        with closed_killed_when_stopped():
            yield run
