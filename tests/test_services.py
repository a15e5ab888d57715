"""The data and pretraining flows against real services started as processes on
127.0.0.1: a Prefect server, an MLflow tracking server (SQLite backend, artifacts
served through it) and a Ray cluster of a head and a worker node with token
authentication. The flows run through the CLI with PREFECT_API_URL,
MLFLOW_TRACKING_URI and RAY_ADDRESS pointing at them; the services are started
once for the module and shared by its tests."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from live_services import (BIN, RAY_LOOPBACK_ENV, free_port, outward_sockets, ray_start, signal_group,
                           wait_http)

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


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("services")
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0",
               PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    node_env = dict(env)  # a worker node's: Ray refuses one in its single-machine mode
    env.update(RAY_LOOPBACK_ENV)
    (tmp_path / "prefect-home").mkdir()
    mlflow_port, prefect_port, ray_port = free_port(), free_port(), free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []

    def start(name, cmd, env=env):
        out = open(logs / f"{name}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                      start_new_session=True))

    start("mlflow", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                     "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                     # Artifacts go through the server (mlflow-artifacts:/ URIs), stored under tmp_path.
                     "--serve-artifacts", "--artifacts-destination", (tmp_path / "artifacts").as_uri(),
                     "--workers", "1"])
    start("prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)])
    # Each Ray node runs in the foreground (--block) in a process group of its own, so the
    # teardown stops exactly this cluster (`ray stop` would also stop the test session's Ray).
    # Every node and driver on 127.0.0.1 (live_services.RAY_LOOPBACK_ENV says why).
    node = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    start("ray-head", ray_start(*node, "--head", "--port", str(ray_port), "--include-dashboard", "false"))
    start("ray-worker", ray_start(*node, "--address", f"127.0.0.1:{ray_port}", worker_node=True), env=node_env)
    try:
        wait_nodes(env, f"127.0.0.1:{ray_port}", 2)
        ray_nodes = [p for p in procs if "ray" in " ".join(p.args)]
        assert not outward_sockets(ray_nodes), outward_sockets(ray_nodes)
        wait_http(f"http://127.0.0.1:{mlflow_port}/health")
        wait_http(f"http://127.0.0.1:{prefect_port}/api/health")
        env.update(MLFLOW_TRACKING_URI=f"http://127.0.0.1:{mlflow_port}",
                   PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api", RAY_ADDRESS=f"127.0.0.1:{ray_port}")
        yield env
    finally:
        for p in reversed(procs):
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10  # one grace period for all: a Ray node can take longer to stop
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            signal_group(p, signal.SIGKILL)  # whatever the node left behind in its group
        # `ray start` records its cluster as this machine's default; forget the stopped one.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip().endswith(f":{ray_port}"):
            current.unlink()


def test_a_command_without_the_cluster_token_is_refused_in_one_sentence(services, tmp_path):
    # ray.init retried the refused call for ~45 s, a C++ warning a second, then named no token.
    from test_data_pipeline import write_warc

    write_warc(tmp_path / "in" / "a.warc.gz", range(3))
    no_token = {k: v for k, v in services.items() if k != "RAY_AUTH_TOKEN"}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "crawl2chat.cli", "data", "--input", str(tmp_path / "in"),
                           "--set", "data.engine=ray", "--set", f"home={tmp_path / 'home'}"],
                          env=no_token, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, said[-20:]
    assert said[-1] == (f"error: The Ray cluster at {services['RAY_ADDRESS']} (RAY_ADDRESS) refused this command's "
                        "token: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token, as its nodes "
                        "have it."), said[-20:]
    assert time.monotonic() - started < 40 and len(said) < 6, said


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


def english_corpus(n_sentences: int = 900, seed: int = 7) -> str:
    """A few tens of KB of varied English sentences, so the test never needs shared data."""
    rng = random.Random(seed)
    subjects = ("the old fisherman", "a young teacher", "my neighbour", "the small dog", "our team", "the river",
                "a quiet student", "the baker", "every traveller", "the city council", "her brother", "the wind")
    verbs = ("walked along", "looked at", "painted", "talked about", "carried", "remembered", "followed",
             "cleaned", "counted", "visited", "described", "forgot")
    objects = ("the narrow bridge", "a bright red kite", "the morning market", "three wooden boxes",
               "the harbour lights", "an old map of the valley", "the garden behind the school", "fresh bread",
               "the mountain path", "a letter from abroad", "the broken clock", "the evening news")
    endings = ("before sunrise", "after the long rain", "with great care", "without saying a word",
               "while the bells rang", "on a cold Tuesday", "because nobody else would", "for the first time",
               "near the station", "as the children laughed")
    paragraphs, sentences = [], []
    for i in range(n_sentences):
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(endings)}."
        if rng.random() < 0.3:
            sentence += f" It was {rng.choice(('strange', 'lovely', 'tiring', 'quiet', 'noisy'))}, " \
                        f"{rng.choice(('they said', 'she wrote', 'he thought', 'we agreed'))}."
        sentences.append(sentence[0].upper() + sentence[1:])
        if len(sentences) >= rng.randint(3, 7):
            paragraphs.append(" ".join(sentences))
            sentences = []
    paragraphs.append(" ".join(sentences))
    return "\n\n".join(p for p in paragraphs if p) + "\n"


def prefect_flow_runs(api: str, body: dict) -> list[dict]:
    request = urllib.request.Request(api + "/flow_runs/filter", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_training_flow_on_real_services(services, tmp_path):
    env = services
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english_corpus(), encoding="utf-8")
    assert corpus.stat().st_size > 20_000

    # A tiny model for 20 steps, evaluated at step 10 and at the end.
    settings = ["vocab_size=512", "seq_len=64", "micro_batch_size=4", "warmup_steps=2", "eval_every=10",
                "eval_batches=4", "checkpoint_every=10", "val_fraction=0.1", "log_every=1"]
    cmd = [sys.executable, "-m", "crawl2chat.cli", "pretrain", "--data", str(corpus), "--out", str(tmp_path / "out"),
           "--preset", "tiny", "--max-steps", "20", "--set", f"home={tmp_path / 'home'}"]
    for item in settings:
        cmd += ["--set", f"pretrain.train.{item}"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The summary the command prints is the source of truth for where things went.
    model_dir = re.search(r"^pretrain model: (.+)$", proc.stdout, re.M)
    model_uri = re.search(r"^\s*MLflow: (models:/crawl2chat-base/\d+) \(run \w+\)$", proc.stdout, re.M)
    assert model_dir and model_uri, proc.stdout[-3000:]
    assert (Path(model_dir.group(1).strip()) / "config.json").exists()
    assert re.search(r", 20 steps$", proc.stdout, re.M), proc.stdout[-3000:]
    assert "View run" not in proc.stdout and "Removed shared tensor" not in proc.stdout  # notices stay in the logs
    # With a tracking server set, nothing is tracked in the local SQLite fallback.
    assert not (tmp_path / "home" / "mlflow.db").exists()

    # Prefect: the server lists a completed run of the `pretrain` flow.
    runs = prefect_flow_runs(env["PREFECT_API_URL"], {"flows": {"name": {"any_": ["pretrain"]}}})
    assert runs and any(run["state_type"] == "COMPLETED" for run in runs), [r["state_type"] for r in runs]

    # MLflow: a `pretrain` child run under a `pretrain` parent, with per-step curves.
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("crawl2chat")
    assert experiment is not None
    # Artifacts are proxied by the server, not written to a path the client sees.
    assert experiment.artifact_location.startswith("mlflow-artifacts:"), experiment.artifact_location
    stage_runs = client.search_runs([experiment.experiment_id], "tags.`crawl2chat.stage` = 'pretrain'")
    assert len(stage_runs) == 1, [r.info.run_id for r in stage_runs]
    run = stage_runs[0]
    assert run.info.status == "FINISHED"
    parent_id = run.data.tags.get("mlflow.parentRunId")
    assert parent_id, run.data.tags
    parent = client.get_run(parent_id)
    assert parent.data.tags.get("crawl2chat.pipeline") == "pretrain" and parent.info.status == "FINISHED"
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert len({m.step for m in loss}) > 1, loss
    assert max(m.step for m in loss) == 20
    val_loss = client.get_metric_history(run.info.run_id, "val_loss")
    assert val_loss and all(m.value == m.value and m.value > 0 for m in val_loss)
    assert "val_bpb" in run.data.metrics

    # Model registry: `crawl2chat-base@current` is the version the command printed,
    # made by this run, and its files download through the server.
    version = client.get_model_version_by_alias("crawl2chat-base", "current")
    assert model_uri.group(1) == f"models:/crawl2chat-base/{version.version}"
    assert version.run_id == run.info.run_id
    assert version.source.startswith("mlflow-artifacts:"), version.source
    for name, uri in (("source", version.source), ("run", f"runs:/{run.info.run_id}/model"),
                      ("alias", "models:/crawl2chat-base@current")):
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "dl" / name)))
        files = {p.name for p in local.rglob("*") if p.is_file()}
        assert "config.json" in files, (name, files)
        assert any(f.endswith(".safetensors") for f in files), (name, files)
