"""`crawl2chat data` on a local Ray, stopped with SIGTERM mid-build: the command's own words.

ray.init puts in a SIGTERM handler of its own (sys.exit), which used to replace the
command's: the build ended with status 15, no sentence, and its MLflow runs FAILED.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from test_data_pipeline import write_warc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_sigterm_to_a_data_build_on_ray_says_so_and_closes_its_runs_killed(tmp_path):
    write_warc(tmp_path / "in" / "a.warc.gz", range(400))
    write_warc(tmp_path / "in" / "b.warc.gz", range(400, 800))
    log = tmp_path / "command.log"
    cmd = [str(Path(sys.executable).parent / "crawl2chat"), "data", "--input", str(tmp_path / "in"),
           "--set", "data.engine=ray"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 300
    while "[data] extract" not in log.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, log.read_text()[-2000:]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    said = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, said[-2000:]
    assert said.strip().splitlines()[-1] == "stopped (SIGTERM); rerunning the same command resumes where it stopped"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / '.crawl2chat' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs and "FAILED" not in {r.info.status for r in runs}, [(r.info.run_name, r.info.status) for r in runs]
    time.sleep(2)
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, left


def test_a_thread_calling_ray_after_it_shut_down_starts_no_second_instance(tmp_path):
    # As a stopped command exits, Ray's exit hook shuts it down while Ray Data's scheduling
    # thread may still make one more call: that call fails in its thread; before, Ray
    # connected on first use and started a second local instance, warning on the terminal.
    script = (
        "import threading, ray\n"
        "from crawl2chat.infra.ray_runtime import ensure_ray\n"
        "ensure_ray(num_cpus=1)\n"
        "ray.shutdown()\n"
        "said = []\n"
        "def late():\n"
        "    try:\n"
        "        ray.put(1)\n"
        "        said.append('connected')\n"
        "    except Exception as e:\n"
        "        said.append(type(e).__name__)\n"
        "t = threading.Thread(target=late); t.start(); t.join()\n"
        "print('late call:', said[0], 'initialized:', ray.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "late call: RaySystemError initialized: False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "SIGTERM handler is not set" not in done.stderr, done.stderr[-2000:]
