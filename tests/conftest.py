"""Shared fixtures: one local Ray for the session, a real temporary Prefect API, the shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# Tests never talk to a cluster or a tracking server the developer happens to have configured.
for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
    os.environ.pop(var, None)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# Addresses of services a test started. ``mlflow.set_tracking_uri`` writes its URI into
# the environment, so without this a test's server, gone after it, would be inherited
# by every later test's subprocesses.
_SERVICE_VARS = ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL", "MLFLOW_EXPERIMENT_ID",
                 "MLFLOW_EXPERIMENT_NAME")


@pytest.fixture(autouse=True)
def _service_addresses_do_not_leak():
    saved = {k: os.environ.get(k) for k in _SERVICE_VARS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("shared test data (../shared/data) is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def parallel_reference(tmp_path_factory) -> dict:
    """Corpus, tokenizer and the 1-process pretraining run that the tensor-, pipeline- and
    multi-machine tests compare with (``tests/parallel_reference.py``)."""
    from parallel_reference import build

    return build(tmp_path_factory.mktemp("parallel"))


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray, started once for the whole test session."""
    import ray

    from crawl2chat.infra.ray_runtime import ensure_ray

    info = ensure_ray(num_cpus=2)
    # Shared by every test of the session: training launched in-process (which stops a
    # local Ray it finds once its data is prepared) leaves this one running.
    ensure_ray.started_local = False
    yield info
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api():
    """A real temporary Prefect API server (SQLite) for flow runs in this session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def pytest_runtest_logreport(report):
    """A failure's report printed the moment it happens, not only in the summary at the
    end: a run cut short (a CI time limit) still shows what failed and why."""
    if not report.failed:
        return
    reporter = _CONFIG["config"].pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    if reporter is None:
        return
    reporter.write("\n")
    reporter.section(f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s)", sep="-")
    text = str(report.longrepr)
    reporter.write_line(text if len(text) <= 8000 else "...\n" + text[-8000:])


_CONFIG: dict = {}


def pytest_configure(config):
    _CONFIG["config"] = config
