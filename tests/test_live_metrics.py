"""Training metrics reach MLflow while the run trains, each point with its own step and
time, and a tracking server that stops answering mid-run neither stops the training nor
loses a point: they are buffered and land when it answers again.

Real parts only: ``accelerate launch`` of the reward-model script on a tiny model, the
MLflow SQLite store the embedded default uses, and a real ``mlflow server`` on 127.0.0.1
that the test freezes (SIGSTOP) and thaws (SIGCONT) mid-run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from crawl2chat.infra.training_records import MetricsFollower
from crawl2chat.stages.training.settings import RewardConfig
from crawl2chat.stages.training.trainer import read_metrics
from crawl2chat.tasks.train import launch_training
from test_reward import rule_pairs
from test_sft import tiny_base, write_jsonl

pytestmark = [pytest.mark.timeout(900)]

STEPS = 150  # long enough (seconds, on an idle machine) for the follower to post points mid-run
SETS = {"seq_len": 64, "micro_batch_size": 4, "warmup_steps": 2, "eval_every": 0, "checkpoint_every": 0,
        "val_fraction": 0.0, "max_steps": STEPS}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("live"))


def _step_rows(path: Path) -> list[dict]:
    return [r for r in read_metrics(path) if r.get("type") == "step"]


def test_step_metrics_reach_mlflow_while_the_run_trains(base, tmp_path):
    """The Prefect task's own recording path (``train_stage``) on the embedded SQLite store,
    read back from MLflow while the training process is still running."""
    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.tasks.train import train_stage

    uri = setup_tracking(tmp_path / "home", "live-metrics")
    data = write_jsonl(tmp_path / "prefs.jsonl", rule_pairs(80))
    out = tmp_path / "reward"
    settings = RewardConfig(**SETS).model_dump(mode="json")
    result: dict = {}
    errors: list[BaseException] = []

    def train():
        try:
            result.update(train_stage("reward", {"base": str(base), "data": str(data)}, str(out), settings))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    runner = threading.Thread(target=train)
    runner.start()
    client = MlflowClient(uri)
    during: list[tuple[int, int, int]] = []  # (points, distinct steps, distinct timestamps) seen mid-run
    keys_during: set[str] = set()
    while runner.is_alive():
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  filter_string="tags.`crawl2chat.stage` = 'reward'")
        if runs:
            run_id = runs[0].info.run_id
            history = client.get_metric_history(run_id, "loss")
            keys = set(client.get_run(run_id).data.metrics)
            # Taken before the script wrote its summary: the run was still training.
            if history and not any(out.glob("*/metrics.json")):
                during.append((len(history), len({m.step for m in history}), len({m.timestamp for m in history})))
                keys_during |= keys
        time.sleep(0.5)
    runner.join()
    assert not errors, errors
    assert during, "no metrics reached MLflow before the run ended"
    points, steps, stamps = max(during)
    assert points == steps >= 3 and stamps >= 2, during
    assert {"loss", "lr", "grad_norm", "tokens_per_second"} <= keys_during, keys_during

    # At the end: every step once, at the time the trainer recorded it.
    run_dir = Path(result["model_dir"]).parent
    rows = _step_rows(run_dir / "metrics.jsonl")
    history = sorted(client.get_metric_history(result["run_id"], "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [m.timestamp for m in history] == [int(r["time"] * 1000) for r in rows]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows])


# ---------------------------------------------------------------- a server that stops answering


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--default-artifact-root", str(tmp_path / "artifacts")]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError((tmp_path / "server.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield proc, url
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.wait(30)
        log.close()


@pytest.mark.slow
def test_a_tracking_server_that_stops_answering_does_not_stop_training(base, tmp_path, mlflow_server, monkeypatch):
    proc, url = mlflow_server
    client = MlflowClient(url)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    # Fail fast while the server is frozen, instead of the client's minutes of retries:
    # the follower's own buffer and retry are what is tested.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    data = write_jsonl(tmp_path / "prefs.jsonl", rule_pairs(80))
    out = tmp_path / "reward"
    follower = MetricsFollower(out / "metrics.jsonl", run_id, client=client, interval=0.5)
    frozen = threading.Event()

    def freeze_mid_run():
        # Once some points have landed and the run is a few steps in, the server stops answering.
        while not frozen.is_set():
            if follower.sent > 0 and len(_step_rows(out / "metrics.jsonl")) >= 3:
                os.killpg(proc.pid, signal.SIGSTOP)
                frozen.set()
            time.sleep(0.1)

    freezer = threading.Thread(target=freeze_mid_run, daemon=True)
    follower.start()
    freezer.start()
    try:
        launch_training("reward", {"base": str(base), "data": str(data)}, str(out),
                        overrides=[f"{k}={v}" for k, v in SETS.items()])
        # Training finished while the server was frozen: the result on disk is whole.
        assert frozen.is_set(), "the run ended before the server could be frozen; give it more steps"
        summary = json.loads((out / "metrics.json").read_text())
        assert summary["steps"] == STEPS and (out / "model" / "model.safetensors").exists()
        deadline = time.time() + 60
        while follower.failures == 0 and time.time() < deadline:
            time.sleep(0.2)
        assert follower.failures > 0 and follower.pending, "the follower never met the outage"
        kept = len(follower.pending)
    finally:
        frozen.set()
        os.killpg(proc.pid, signal.SIGCONT)
    assert follower.stop(drain_timeout=120), follower.last_error
    assert not follower.pending and follower.sent >= kept
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT")
    rows = _step_rows(out / "metrics.jsonl")
    for key in ("loss", "lr", "grad_norm", "tokens_per_second"):
        history = client.get_metric_history(run_id, key)
        # Every step is there (a request the frozen server took in late may add a copy of its points).
        assert sorted({m.step for m in history}) == list(range(1, STEPS + 1)), key
        assert {(m.step, m.timestamp) for m in history} == {(r["step"], int(r["time"] * 1000)) for r in rows}, key


@pytest.mark.slow
def test_a_tracking_server_that_goes_away_for_good_is_said_in_one_sentence(base, tmp_path, mlflow_server):
    """`crawl2chat reward` against a real `mlflow server` that is killed mid-run: training
    finishes, the command ends within a couple of minutes (not MLflow's ~4 minutes of
    retries per call) with one sentence naming the server and exit status 1 (a rerun
    records it), and the trained model is on disk."""
    proc, url = mlflow_server
    data = write_jsonl(tmp_path / "prefs.jsonl", rule_pairs(80))
    out = tmp_path / "reward"
    env = dict(os.environ, MLFLOW_TRACKING_URI=url)
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        env.pop(name, None)
    cmd = [str(Path(sys.executable).parent / "crawl2chat"), "reward", "--base", str(base), "--data", str(data),
           "--out", str(out), *[a for k, v in {**SETS, "max_steps": 400}.items()
                                  for a in ("--set", f"reward.train.{k}={v}")]]
    said = tmp_path / "command.log"
    command = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(said, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and command.poll() is None:
        if len(list(out.glob("*/metrics.jsonl"))) and len(_step_rows(next(out.glob("*/metrics.jsonl")))) >= 3:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.time()
    command.wait(timeout=400)
    took = time.time() - killed
    said = said.read_text()
    last = said.strip().splitlines()[-1]
    assert command.returncode == 1, said[-3000:]
    assert last.startswith(f"error: The MLflow tracking server at {url} stopped answering"), said[-3000:]
    assert took < 200, took
    assert "Retrying (Retry(" not in said  # urllib3's notices stay in the log file
    (run,) = [p for p in out.iterdir() if (p / "metrics.jsonl").exists()]
    assert (run / "model" / "model.safetensors").exists()
