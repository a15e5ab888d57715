"""Prefect wiring for the embedded default and for a real server.

With no ``PREFECT_API_URL``, a command runs its flows against a temporary local
Prefect API server whose SQLite database lives in the project folder
(``HOME/prefect``). Prefect would start that server itself on the first API call,
but only after the command has imported Prefect's whole server package (about 6 s
on a small machine) and then waiting another 8-15 s for it to come up, all on the
critical path. :func:`start_embedded_api` instead starts the same server process
(the same ``uvicorn`` factory and settings as Prefect's ``SubprocessASGIServer``)
as soon as the settings are read, so it comes up while the command imports Ray,
torch and its stages, and :func:`wait_for_embedded_api` waits for it just before
the first flow runs.

A new project folder's database needs Prefect's migrations (about 9 s); it starts
instead from a copy of the first freshly migrated one on the machine
(:mod:`crawl2chat.infra.sqlite_templates`). Prefect still checks and applies
migrations on start, so a template from an older layout is brought up to date
rather than trusted.

With ``PREFECT_API_URL`` set, flows report to that server (and its UI) instead,
and nothing is started.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from crawl2chat.infra.sqlite_templates import copy_template, save_template, template_path
from crawl2chat.stages.telemetry import disable_telemetry

API_LOG = "logs/prefect-api.log"  # under the project folder
_DB_NAME = "prefect.db"


def configure_prefect_env(home: str | None = None, terse: bool = True) -> None:
    """Set Prefect's environment before it is imported.

    With no API server configured, the temporary server keeps its SQLite database
    under the project's home folder, so concurrent jobs of different projects do
    not contend for one database in ``~/.prefect``. ``terse``: Prefect's own log lines
    at WARNING and up (a command's terminal shows its stages' lines); off for
    ``serve-flows``, whose runs' INFO lines (each task's start and end) are what a
    run's page in the Prefect UI shows.
    """
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # The pipeline talks to its own services only: no usage reports to outside hosts.
    disable_telemetry()
    # Each stage prints its own progress lines; library progress bars would interleave with them.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if home and not os.environ.get("PREFECT_API_URL") and "PREFECT_HOME" not in os.environ:
        prefect_home = Path(home).resolve() / "prefect"
        prefect_home.mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level
        os.environ["PREFECT_HOME"] = str(prefect_home)
    # Flow-run logs go to the terminal through our own per-step lines; keep Prefect's terse.
    if terse:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "false")


class _EmbeddedAPI:
    """This command's temporary server (one per process)."""

    process: subprocess.Popen | None = None
    ready: bool = False
    url: str = ""
    db: Path | None = None
    fresh_db: bool = False  # the database did not exist before this server started


def _prefect_package_dir() -> Path:
    """Prefect's package folder, found without importing Prefect."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    return Path(spec.origin).parent


def _prefect_version() -> str:
    from importlib.metadata import version

    return version("prefect")


def _template_path() -> Path:
    return template_path(f"prefect-{_prefect_version()}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database(prefect_home: Path) -> Path | None:
    """The SQLite file the server will use, when it is the default one under PREFECT_HOME."""
    url = os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL")
    return None if url else prefect_home / _DB_NAME


def configured_api_url() -> str | None:
    """The Prefect server the user named (``PREFECT_API_URL``), not this command's own."""
    url = os.environ.get("PREFECT_API_URL")
    return url if url and url != _EmbeddedAPI.url else None


def start_embedded_api(home: str) -> None:
    """Start this command's temporary Prefect API server in the background and point
    Prefect at it (``PREFECT_API_URL``); a no-op when a server is configured."""
    if os.environ.get("PREFECT_API_URL") or _EmbeddedAPI.process is not None:
        return
    from crawl2chat.stages.lifetime import die_with_parent_preexec

    prefect_home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect")
    prefect_home.mkdir(parents=True, exist_ok=True)
    db = _database(prefect_home)
    fresh = db is not None and not db.exists()
    if fresh:
        copy_template(_template_path(), db)
    log_path = Path(home).resolve() / API_LOG
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ, PREFECT_HOME=str(prefect_home), PREFECT_UI_ENABLED="0",
               PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
    # On SQLite one writer waits for another; Prefect's 10 s answers "503 database is
    # locked" while a busy machine (Ray, a training run) slows the server's own writes.
    if not any(k in env for k in ("PREFECT_SERVER_DATABASE_TIMEOUT", "PREFECT_API_DATABASE_TIMEOUT")):
        env["PREFECT_SERVER_DATABASE_TIMEOUT"] = "60"
    # No automations: this server lives and dies with the command, and its flow runs send
    # no heartbeats for them to watch (flow_settings). Prefect's trigger and action services
    # otherwise start with it and make its first write request build a second API app
    # (POST /flows/ 0.22 s against 0.05 s); a user's own setting is kept.
    if not any(k in env for k in ("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", "PREFECT_API_SERVICES_TRIGGERS_ENABLED")):
        env["PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"] = "false"
    with open(log_path, "ab") as log:
        _EmbeddedAPI.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(_prefect_package_dir().parent),
             "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            # Out of the terminal's process group, so Ctrl-C reaches the command first and its
            # flow can still record how it ended; it dies with the command (parent-death
            # signal, the lifeline, and stop_embedded_api at exit).
            start_new_session=True, preexec_fn=die_with_parent_preexec())
    _EmbeddedAPI.url, _EmbeddedAPI.db, _EmbeddedAPI.fresh_db = f"http://127.0.0.1:{port}/api", db, fresh
    os.environ["PREFECT_API_URL"] = _EmbeddedAPI.url
    atexit.register(stop_embedded_api)


def wait_for_embedded_api(meanwhile: Sequence[Callable[[], object]] = ()) -> None:
    """Block until this command's temporary server answers; a server that exits or does
    not answer within ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` raises
    RuntimeError naming its log.

    ``meanwhile``: work the command does later anyway (importing its steps' libraries),
    done one item at a time, on this thread, while the server does not answer yet; what
    is left when it answers is left to the steps. A failing item is left to them too, to
    report where it belongs."""
    proc = _EmbeddedAPI.process
    if proc is None or _EmbeddedAPI.ready:
        return
    pending = list(meanwhile)
    import httpx

    limit = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    deadline = time.monotonic() + limit
    with httpx.Client(timeout=5.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"The local Prefect API server exited with status {proc.returncode} "
                                   f"before answering; see {os.environ.get('PREFECT_HOME')} and the "
                                   f"log {API_LOG} in the project folder.")
            try:
                if client.get(f"{_EmbeddedAPI.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"The local Prefect API server did not answer within {limit:.0f} s "
                                   f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); see the log "
                                   f"{API_LOG} in the project folder.")
            if pending:
                try:
                    pending.pop(0)()
                except Exception:  # noqa: BLE001 - see the docstring
                    pass
            else:
                time.sleep(0.1)
    _EmbeddedAPI.ready = True
    if _EmbeddedAPI.fresh_db:
        save_template(_EmbeddedAPI.db, _template_path())


def flow_settings():
    """The Prefect settings this command's flow runs go under (a context manager).

    Against the command's own temporary server, flow runs send no heartbeats. Prefect's
    heartbeat thread (a heartbeat every 180 s, for automations that mark a flow run whose
    heartbeats stopped as crashed) is joined when each flow run ends, and it sleeps in
    1-s steps, so every flow and subflow run ended up to a second late: a flow with a
    subflow and a task took 2.1 s against 0.34 s without. The temporary server lives and
    dies with the command and runs no automation of the user's, so nothing reads those
    heartbeats there. Against a configured server (``PREFECT_API_URL``), where
    automations may watch them, they are sent as Prefect's settings say."""
    from contextlib import nullcontext

    if _EmbeddedAPI.process is None:
        return nullcontext()
    from prefect.settings import temporary_settings

    return temporary_settings(updates={"flows.heartbeat_frequency": None})


def stop_embedded_api() -> None:
    """Stop this command's temporary server (at exit)."""
    proc, _EmbeddedAPI.process = _EmbeddedAPI.process, None
    if proc is not None:
        from crawl2chat.stages.lifetime import stop_process

        stop_process(proc)
