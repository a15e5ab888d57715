"""A Ray head that dies while `crawl2chat data` runs on its cluster is said in one sentence.

Ray's core waits for a head that is gone (a minute by default,
``RAY_gcs_rpc_server_reconnect_timeout_s``), then ends the driver from C++ with its
own message and the command's MLflow runs left RUNNING. A real head on
127.0.0.1 (``ray start --head``), a real build on it, the head's whole process
group SIGKILLed mid-extract: the command ends before Ray's own exit, with exit
status 1, its own sentence last, its runs closed, and nothing of it left running.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from live_services import BIN, RAY_LOOPBACK_ENV, free_port, ray_start, signal_group
from test_data_pipeline import write_warc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def wait_for_head(env: dict, address: str, head: subprocess.Popen, timeout: float = 180.0) -> None:
    probe = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print(len(ray.nodes()))"
    deadline = time.time() + timeout
    while time.time() < deadline and head.poll() is None:
        if subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True,
                          timeout=120).returncode == 0:
            return
        time.sleep(1)
    raise TimeoutError(f"the Ray head at {address} did not come up")


def test_a_ray_head_killed_mid_build_is_said_in_one_sentence(tmp_path):
    write_warc(tmp_path / "in" / "a.warc.gz", range(600))
    write_warc(tmp_path / "in" / "b.warc.gz", range(600, 1200))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    # Ray's token authentication (on by default for `ray start`), the head and the command sharing the token.
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    # Ray's own exit after 40 s without its head instead of 60: the command says it before that.
    env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "40"
    env.update(RAY_LOOPBACK_ENV)  # the head and the command on 127.0.0.1 only
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = subprocess.Popen(ray_start("--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
                                      "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"),
                            env=env, cwd=tmp_path, stdout=open(tmp_path / "head.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc = None
    try:
        wait_for_head(env, address, head)
        log = tmp_path / "command.log"
        proc = subprocess.Popen([str(BIN / "crawl2chat"), "data", "--input", str(tmp_path / "in"),
                                 "--set", "data.engine=ray"], cwd=tmp_path, env=dict(env, RAY_ADDRESS=address),
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while "[data] extract" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        signal_group(head, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - killed
        said = log.read_text()
        last = said.strip().splitlines()[-1]
        assert proc.returncode == 1, said[-3000:]
        assert last.startswith(f"error: The Ray cluster at {address} (RAY_ADDRESS) stopped answering mid-run"), \
            said[-3000:]
        assert last.endswith("rerunning the same command once it is back resumes where it stopped."), last
        assert took < 40, f"{took:.0f} s after the head died (Ray's own exit comes at 40 s)"
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path / '.crawl2chat' / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert runs and "RUNNING" not in {r.info.status for r in runs}, \
            [(r.info.run_name, r.info.status) for r in runs]
        time.sleep(2)
        left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert not left, left
    finally:
        if proc is not None and proc.poll() is None:
            signal_group(proc, signal.SIGKILL)
        signal_group(head, signal.SIGKILL)
        head.wait(timeout=30)
        current = Path("/tmp/ray/ray_current_cluster")  # `ray start` records its cluster as this machine's default
        if current.exists() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()
