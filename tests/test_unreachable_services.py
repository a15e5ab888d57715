"""A service the environment names that does not answer is said in one sentence, before any work.

Real commands, with a Ray cluster, an MLflow server and a Prefect server named on
127.0.0.1 ports nothing listens on: each ends within seconds (not MLflow's minutes of
retries, nor ray.init's endless wait) with exit status 2 and one sentence naming the
service, its address and the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_services import free_port
from test_data_pipeline import write_warc

from crawl2chat.infra.run_folders import run_folder
from crawl2chat.tasks.train import launch_key


@pytest.mark.parametrize("variable, what", [
    ("RAY_ADDRESS", "Ray cluster"),
    ("MLFLOW_TRACKING_URI", "MLflow tracking server"),
    ("PREFECT_API_URL", "Prefect server"),
])
def test_a_named_service_that_does_not_answer_is_said_in_one_sentence(tmp_path, variable, what):
    write_warc(tmp_path / "in" / "a.warc.gz", range(3))
    port = free_port()
    address = {"RAY_ADDRESS": f"127.0.0.1:{port}", "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}",
               "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}[variable]
    env = dict(os.environ, **{variable: address})
    cmd = [str(Path(sys.executable).parent / "crawl2chat"), "data", "--input", str(tmp_path / "in"),
           "--set", "data.engine=ray"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last.startswith(f"error: The {what} at {address} ({variable}) does not answer"), last
    assert time.monotonic() - started < 120
    assert "Traceback" not in proc.stdout + proc.stderr


def test_a_run_folder_is_keyed_by_its_launch_unless_it_is_one_plain_process(tmp_path):
    args = (tmp_path, "pretrain", {"data": "d"}, {"data": "sha256:x"}, {"lr": 1e-3})
    one = run_folder(*args, launch_key(1, 1, None))
    assert one == run_folder(*args)  # the key runs had before launches were part of it
    two = run_folder(*args, launch_key(2, 1, None))
    deepspeed = run_folder(*args, launch_key(2, 1, "deepspeed"))
    assert len({one, two, deepspeed}) == 3
