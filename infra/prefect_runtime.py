"""Prefect wiring for the embedded default and for a real server.

With no ``PREFECT_API_URL``, Prefect starts a temporary local API server the first
time a flow runs; on a small machine that takes 15-25 s, longer than Prefect's
own default wait, so the wait is raised here before Prefect is imported. With
``PREFECT_API_URL`` set, flows report to that server (and its UI) instead.
"""

from __future__ import annotations

import os


def configure_prefect_env() -> None:
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Flow-run logs go to the terminal through our own per-step lines; keep Prefect's terse.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "false")
