"""No usage reports leave the machine: the opt-outs of every library the project runs.

:func:`disable_telemetry` sets them in this process's environment, so they hold
for the libraries imported afterwards and for every process started from here
(Ray's workers, ``accelerate launch`` and its ranks, a Prefect worker's flow runs).
It runs when the ``crawl2chat`` package is imported, before any of those
libraries, so each entry point (the command line, a flow run by a Prefect worker,
a stage script started on its own) has them. A value already set is kept: a
user who opts in on purpose is not overruled. ``docker-compose.yml`` sets the same
variables for its services.
"""

from __future__ import annotations

import os

TELEMETRY_OPT_OUTS = {
    "DO_NOT_TRACK": "1",  # the cross-tool convention; Prefect's client and Hugging Face honour it
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray's usage stats (reported by the head node)
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow 3's client telemetry
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # the Prefect server, the embedded temporary one included
    "HF_HUB_DISABLE_TELEMETRY": "1",  # transformers / huggingface_hub
}


def disable_telemetry() -> dict[str, str]:
    """Set every opt-out not already set; returns the values in force."""
    for name, value in TELEMETRY_OPT_OUTS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in TELEMETRY_OPT_OUTS}
