"""The folders a run needs before it starts: the deployments' working folder and the project folder.

A Prefect worker runs each deployment from ``CRAWL2CHAT_WORKDIR`` (``prefect.yaml``'s
pull step, :func:`enter_workdir`); the command line keeps its embedded services
under the project folder (the ``home`` setting, ``.crawl2chat`` by default). When
either is missing or cannot be written, the run stops before any work with one
sentence naming the folder, the setting and what to do, and exit status 2 (the
command line's convention for what a rerun cannot fix), instead of a traceback
from deep inside a library.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

WORKDIR_ENV = "CRAWL2CHAT_WORKDIR"


class FolderUnusable(RuntimeError):
    """A folder a run needs is missing or cannot be written; the message is one sentence."""


def _unusable(path: Path, create: bool) -> str | None:
    """Why ``path`` cannot serve as a folder to write in (None: it can).

    With ``create``, a missing folder is fine when its nearest existing parent is a
    folder this process may write in (it will be created)."""
    if path.exists():
        if not path.is_dir():
            return "is not a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return "cannot be written by this user"
        return None
    if not create:
        return "does not exist"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} cannot be written by this user"
    return None


def check_workdir(directory: str) -> Path:
    """``CRAWL2CHAT_WORKDIR`` as the pull step received it: an existing folder this user can write in."""
    if not directory.strip():
        raise FolderUnusable(
            f"{WORKDIR_ENV} is not set in the Prefect worker's environment: set it to the crawl2chat "
            f"checkout (the folder holding prefect.yaml), e.g. `export {WORKDIR_ENV}=$PWD`, and restart the worker.")
    path = Path(directory).expanduser().resolve()
    why = _unusable(path, create=False)
    if why:
        if os.environ.get(WORKDIR_ENV) != directory:
            # Set when `prefect deploy` ran, the value was stored in the deployment: the worker's is not read.
            fix = (f"the deployment stored it when `prefect deploy` ran, so deploy again with {WORKDIR_ENV} "
                   "set to a crawl2chat checkout this user can write in (or unset, to use the worker's own).")
        else:
            fix = ("set it to a crawl2chat checkout this user can write in (the folder holding prefect.yaml) "
                   "and restart the Prefect worker.")
        raise FolderUnusable(f"{WORKDIR_ENV}={directory} {why}: {fix}")
    return path


def enter_workdir(directory: str) -> dict[str, str]:
    """``prefect.yaml``'s pull step: change into ``CRAWL2CHAT_WORKDIR`` (as Prefect's
    ``set_working_directory`` does), after checking it. A folder that cannot serve ends
    the flow run's process with the sentence on stderr and exit status 2; the worker
    reports the run as crashed with that status."""
    try:
        path = check_workdir(directory)
    except FolderUnusable as e:
        sys.stdout.flush()
        print(f"error: {e}", file=sys.stderr, flush=True)
        _fail_flow_run(str(e))
        # The step runs in a thread of Prefect's engine: end the process itself, before
        # the engine adds a traceback after the sentence.
        os._exit(2)
    os.chdir(path)
    return {"directory": str(path)}


def _fail_flow_run(sentence: str) -> None:
    """Put the sentence where the Prefect UI shows it: the flow run's state (Failed) and
    its logs. The process ends before Prefect's own log handler would send anything."""
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not run_id:
        return
    try:
        from datetime import datetime, timezone

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import LogCreate
        from prefect.states import Failed

        with get_client(sync_client=True) as client:
            client.create_logs([LogCreate(name="crawl2chat.workdir", level=40, message=sentence,
                                          timestamp=datetime.now(timezone.utc), flow_run_id=run_id)])
            client.set_flow_run_state(run_id, Failed(message=sentence), force=True)
    except Exception:  # noqa: BLE001 - the sentence is on stderr and the exit status says it; the API is extra
        pass


def check_home(home: str) -> Path:
    """The project folder (``home`` setting): an existing or creatable folder this user can write in."""
    path = Path(home).expanduser().resolve()
    why = _unusable(path, create=True)
    if not why:
        # Made now: permission bits do not tell everything (root in /proc or /sys, a read-only mount).
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = f"cannot be created ({e.strerror or type(e).__name__})"
    if why:
        raise FolderUnusable(
            f"The project folder {path} (setting `home`) {why}: run from a folder you can write in, "
            f"or choose one with --set home=DIR.")
    return path
