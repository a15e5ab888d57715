"""What a command does before its flow starts."""

from __future__ import annotations

import sys
import time

import mlflow

from crawl2chat.cli import _open_tracking
from crawl2chat.stages.settings import load_config


def test_the_local_store_opens_while_the_prefect_api_comes_up(tmp_path):
    """The MLflow store in the project folder is opened, and the plotting library loaded,
    before the command waits for its local Prefect API; a tracking server is left to the flow."""
    try:
        cfg = load_config(overrides={"home": str(tmp_path / "home")})
        _open_tracking(cfg)
        assert (tmp_path / "home" / "mlflow.db").is_file()
        assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
        assert mlflow.get_experiment_by_name(cfg.tracking.experiment) is not None
        assert "matplotlib.figure" in sys.modules

        # Nothing listens on this port: a server is not contacted here (the flow reports it).
        server = load_config(overrides={"home": str(tmp_path / "other"), "tracking.uri": "http://127.0.0.1:9"})
        started = time.monotonic()
        _open_tracking(server)
        assert time.monotonic() - started < 2
        assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}"
        assert not (tmp_path / "other" / "mlflow.db").exists()
    finally:
        mlflow.set_tracking_uri(None)  # the environment is restored by conftest


def test_a_data_build_imports_ray_only_to_run_on_it():
    """The data flow and its tasks import without Ray (~0.5 s of a small build's start):
    a build the in-process engine runs never loads it."""
    import subprocess

    probe = ("import sys, crawl2chat.flows.data, crawl2chat.tasks.data, crawl2chat.stages.data.pipeline; "
             "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
