"""The data flow against real services started as processes on 127.0.0.1: a Prefect
server, an MLflow tracking server (SQLite backend) and a Ray cluster of a head and a
worker node with token authentication. The flow runs through the CLI with
PREFECT_API_URL, MLFLOW_TRACKING_URI and RAY_ADDRESS pointing at them."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_nodes(env: dict, address: str, count: int, timeout: float = 240.0) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(len([n for n in ray.nodes() if n['Alive']]))")
    deadline = time.time() + timeout
    while time.time() < deadline:
        proc = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True,
                              timeout=180)
        if proc.returncode == 0 and proc.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise TimeoutError(f"the Ray cluster at {address} did not reach {count} nodes")


@pytest.fixture
def services(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0",
               PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    (tmp_path / "prefect-home").mkdir()
    mlflow_port, prefect_port, ray_port = free_port(), free_port(), free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []

    def start(name, cmd):
        out = open(logs / f"{name}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                      start_new_session=True))

    start("mlflow", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                     "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                     "--artifacts-destination", (tmp_path / "artifacts").as_uri(), "--workers", "1"])
    start("prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)])
    # Each Ray node runs in the foreground (--block) in a process group of its own, so the
    # teardown stops exactly this cluster (`ray stop` would also stop the test session's Ray).
    ray = [str(BIN / "ray"), "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
           "--disable-usage-stats"]
    start("ray-head", ray + ["--head", "--port", str(ray_port), "--include-dashboard", "false"])
    start("ray-worker", ray + ["--address", f"127.0.0.1:{ray_port}"])
    try:
        wait_nodes(env, f"127.0.0.1:{ray_port}", 2)
        wait_http(f"http://127.0.0.1:{mlflow_port}/health")
        wait_http(f"http://127.0.0.1:{prefect_port}/api/health")
        env.update(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{mlflow_port}",
                   PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api", RAY_ADDRESS=f"127.0.0.1:{ray_port}")
        yield env
    finally:
        for p in reversed(procs):
            signal_group(p, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            signal_group(p, signal.SIGKILL)  # whatever the node left behind in its group
        # `ray start` records its cluster as this machine's default; forget the stopped one.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip().endswith(f":{ray_port}"):
            current.unlink()


@pytest.mark.slow
def test_data_flow_on_real_services(services, shared_data, tmp_path):
    env = services
    # Token authentication is on: a driver without the token is refused.
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
    refused = subprocess.run([sys.executable, "-c", "import ray; ray.init()"], env=no_token,
                             capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0

    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "crawl2chat.cli", "data", "--input", str(shared_data / "warc" / "dolma"),
         "--out", str(out), "--set", f"home={tmp_path / 'home'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Ray: the data jobs ran on the two-node cluster, not on a local instance.
    assert "[ray] connected to 127.0.0.1" in proc.stdout and ": 2 nodes" in proc.stdout
    assert not (tmp_path / "home" / "mlflow.db").exists()

    # Prefect: the server lists the completed flow run.
    request = urllib.request.Request(env["PREFECT_API_URL"] + "/flow_runs/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        runs = json.loads(r.read())
    assert any(run["state_type"] == "COMPLETED" for run in runs)

    # MLflow: the server holds the parent run and a child run per step.
    import mlflow

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    found = mlflow.search_runs(experiment_names=["crawl2chat"], output_format="list")
    stages = {r.data.tags.get("crawl2chat.stage") for r in found}
    assert {"extract", "langid", "quality", "dedup", "balance", "write", "review"} <= stages
    assert shutil.which("ray") or (BIN / "ray").exists()
