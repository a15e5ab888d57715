"""Prefect wiring for the embedded default and for a real server.

With no ``PREFECT_API_URL``, Prefect starts a temporary local API server the first
time a flow runs; on a small machine that takes 15-25 s, longer than Prefect's
own default wait, so the wait is raised here before Prefect is imported. With
``PREFECT_API_URL`` set, flows report to that server (and its UI) instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from crawl2chat.stages.telemetry import disable_telemetry


def configure_prefect_env(home: str | None = None) -> None:
    """Set Prefect's environment before it is imported.

    With no API server configured, the temporary server keeps its SQLite database
    under the project's home folder, so concurrent jobs of different projects do
    not contend for one database in ``~/.prefect``.
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
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "false")
