"""The deployments the way a user runs them: ``prefect server start`` on 127.0.0.1, a
process work pool, ``prefect deploy --all`` from the repository's ``prefect.yaml``, a
``prefect worker start`` process, and flow runs started through the REST call the
Prefect UI's "Run" form makes (``POST /api/deployments/{id}/create_flow_run``) with
the form's values: the deployment's parameter schema defaults and its own
parameters, with only the sizes and the folders changed.

The ``data-refresh`` deployment builds dataset version v0001 from a small crawl of
the embedded documentation site. The ``pipeline`` deployment then runs every stage
with tiny sizes and ``refresh`` ticked: its data stage re-crawls and adds v0002 on
top of v0001 without rewriting it, and it trains a base model on v0002, then the
SFT model, the reward model and the PPO policy. Every run is recorded in an MLflow
SQLite store that the worker is given through ``MLFLOW_TRACKING_URI``: the version
lineage on the data runs, and each training run linked to the runs it read (the
base model to the version and the run that wrote it). Every process the services
started (the worker's flow-run processes and their Ray included) has exited once
the worker is stopped.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from live_services import (
    api_call,
    kill_pids,
    prefect_command,
    server_env,
    start_prefect_server,
    start_service,
    stop_group,
    wait_no_tagged_processes,
)

from crawl2chat.flows.deployments import REFRESH_CRON, WORK_POOL
from crawl2chat.infra.lineage import INPUT_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
TAG = "CRAWL2CHAT_LIVE_DEPLOYMENTS"  # marker variable of the worker and every process it starts
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A Prefect server with every deployment of prefect.yaml and a worker polling their pool."""
    tmp = tmp_path_factory.mktemp("deployments").resolve()
    logs = tmp / "logs"
    logs.mkdir()
    tag = secrets.token_hex(8)
    # The daily schedule is stored and shown, but no run is created from it (no scheduler).
    env = server_env(tmp)
    server, api = start_prefect_server(env, logs, cwd=tmp)
    worker = None
    try:
        # The README's steps, with the checkout that prefect.yaml's pull step changes into.
        env.update(PREFECT_API_URL=api, CRAWL2CHAT_WORKDIR=str(ROOT))

        def prefect(*args: str) -> None:
            proc = subprocess.run(prefect_command(*args), env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"prefect {' '.join(args)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"

        prefect("work-pool", "create", WORK_POOL["name"], "--type", "process")
        tracking_uri = f"sqlite:///{tmp / 'mlflow.db'}"
        worker_env = dict(env, MLFLOW_TRACKING_URI=tracking_uri, PREFECT_WORKER_QUERY_SECONDS="2", **{TAG: tag})
        # The worker starts while the deployments are created, as in a second terminal.
        worker = start_service(prefect_command("worker", "start", "--pool", WORK_POOL["name"]), worker_env,
                               logs / "worker.log", cwd=tmp)
        prefect("--no-prompt", "deploy", "--all")

        def stop_worker() -> list[int]:
            """Stop the worker's process group; returns the pids of processes left behind."""
            stop_group(worker)
            return wait_no_tagged_processes(TAG, tag)

        yield SimpleNamespace(api=api, tmp=tmp, logs=logs, tracking_uri=tracking_uri, stop_worker=stop_worker)
    finally:
        if worker is not None:
            stop_group(worker)
        stop_group(server)
        kill_pids(wait_no_tagged_processes(TAG, tag, timeout=10))


def form_values(deployment: dict, changes: dict) -> dict:
    """The values of the UI's run form: each parameter's schema default, the deployment's
    own parameters over them, then ``changes`` (dotted paths; each must be a field the
    form shows, so a renamed setting fails here instead of being sent and refused)."""
    schema = deployment["parameter_openapi_schema"]
    values = {name: copy.deepcopy(deployment["parameters"].get(name, prop.get("default")))
              for name, prop in schema["properties"].items()}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = values
        for key in parents:
            node = node[key]
        assert leaf in node, f"{dotted} is not a field of the form"
        node[leaf] = value
    return values


def run_deployment(api: str, deployment: dict, parameters: dict, logs: Path, timeout: float = 600.0) -> dict:
    """Start a flow run of the deployment as the UI does and wait for it to end."""
    run = api_call(api, "POST", f"/deployments/{deployment['id']}/create_flow_run", {"parameters": parameters})
    deadline = time.time() + timeout
    while True:
        run = api_call(api, "GET", f"/flow_runs/{run['id']}")
        if run["state_type"] in FINAL or time.time() > deadline:
            break
        time.sleep(2)
    if run["state_type"] != "COMPLETED":
        lines = api_call(api, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
        log = "\n".join(line["message"] for line in lines)[-4000:]
        worker = (logs / "worker.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"flow run {run['name']}: {run['state_type']} {run['state']['message']}\n{log}\n{worker}")
    return run


def test_deployments_run_from_the_ui_form(deployed):
    api, tmp = deployed.api, deployed.tmp

    # Every deployment of prefect.yaml is on the server, in the work pool, with its flow's form.
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    on_server = {d["name"]: d for d in api_call(api, "POST", "/deployments/filter", {})}
    assert set(on_server) == {d["name"] for d in spec["deployments"]}
    assert {d["work_pool_name"] for d in on_server.values()} == {WORK_POOL["name"]}
    assert all("config" in d["parameter_openapi_schema"]["properties"] for d in on_server.values())

    refresh = api_call(api, "GET", "/deployments/name/data/data-refresh")
    # The daily schedule, as the deployment page shows it.
    schedules = [s for s in refresh["schedules"] if s["active"]]
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in schedules] == [(REFRESH_CRON, "UTC")]
    assert refresh["parameters"] == {"refresh": True}
    assert refresh["enforce_parameter_schema"]  # the server checks the form's values against the schema

    home, out = tmp / "home", tmp / "data"
    parameters = form_values(refresh, {"config.home": str(home), "config.data.out": str(out),
                                       "config.data.crawl.max_pages": 20})
    assert parameters["refresh"] is True and parameters["config"]["tracking"]["uri"] is None
    first_run = run_deployment(api, refresh, parameters, deployed.logs)
    assert first_run["deployment_id"] == refresh["id"] and first_run["parameters"] == parameters
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == "v0001" and manifest["documents_kept"] > 0
    first = (out / "versions" / "v0001" / "manifest.json").read_bytes()

    # The `pipeline` deployment from its form: the same crawl and folders, refresh ticked,
    # tiny training sizes. Every training stage runs under the worker's flow run
    # (`accelerate launch` each), one MLflow run apiece.
    pipeline = on_server["pipeline"]
    tiny = {"preset": "tiny", "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4, "max_steps": 6,
            "warmup_steps": 1, "eval_every": 6, "eval_batches": 2, "checkpoint_every": 6, "val_fraction": 0.2}
    post = {"sft.train.max_steps": 2, "reward.train.max_steps": 2, "ppo.train.max_steps": 1,
            "ppo.train.rollout_batch_size": 4, "ppo.train.micro_batch_size": 4, "ppo.train.max_new_tokens": 8}
    folders = {f"config.{stage}.out": str(tmp / stage) for stage in ("pretrain", "sft", "reward", "ppo")}
    parameters = form_values(pipeline, {"refresh": True, "config.home": str(home), "config.data.out": str(out),
                                        "config.data.crawl.max_pages": 20, "config.demo_sets.examples": 24,
                                        "config.demo_sets.out": str(tmp / "demo_sets"), **folders,
                                        **{f"config.pretrain.train.{k}": v for k, v in tiny.items()},
                                        **{f"config.{k}": v for k, v in post.items()}})
    run = run_deployment(api, pipeline, parameters, deployed.logs)
    assert run["deployment_id"] == pipeline["id"] and run["parameters"] == parameters

    # The second version lists the first as its base and leaves its files as they were.
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(p.name for p in (out / "versions").iterdir()) == ["v0001", "v0002"]
    assert manifest["version"] == "v0002" and manifest["base_version"] == "v0001" and manifest["refresh"] is True
    assert manifest["versions"] == ["v0001", "v0002"]
    assert (out / "versions" / "v0001" / "manifest.json").read_bytes() == first
    for shard in manifest["shards"]:
        assert (out / shard["path"]).is_file()
    for stage in ("pretrain", "sft", "reward", "ppo"):
        assert (tmp / stage / "model" / "config.json").is_file(), stage

    # MLflow: the worker's tracking URI took effect (nothing in the embedded store under home).
    assert not (home / "mlflow.db").exists()
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(deployed.tracking_uri)
    experiment = client.get_experiment_by_name("crawl2chat")
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id])
    parents = {r.data.tags.get("crawl2chat.pipeline"): r for r in found if r.data.tags.get("crawl2chat.pipeline")}
    assert set(parents) == {"data", "pipeline"} and all(r.info.status == "FINISHED" for r in parents.values())
    writes = {r.data.tags["crawl2chat.data_version"]: r for r in found if r.data.tags.get("crawl2chat.stage") == "write"}
    assert set(writes) == {"v0001", "v0002"}
    assert writes["v0002"].data.tags["crawl2chat.data_base_version"] == "v0001"
    assert writes["v0002"].data.tags["crawl2chat.data_digest"] == manifest["content_digest"]
    assert writes["v0001"].data.tags["mlflow.parentRunId"] == parents["data"].info.run_id
    assert writes["v0002"].data.tags["mlflow.parentRunId"] == parents["pipeline"].info.run_id
    for version, write in writes.items():
        # The version folder names the run that wrote it: a training run reading it links there.
        recorded = json.loads((out / "versions" / version / "mlflow_run.json").read_text())
        assert recorded["run_id"] == write.info.run_id

    children = {r.data.tags["crawl2chat.stage"]: r for r in found
                if r.data.tags.get("mlflow.parentRunId") == parents["pipeline"].info.run_id}
    assert {"crawl", "extract", "write", "pretrain", "demo-sets", "sft", "reward", "ppo"} <= set(children)
    assert all(children[s].info.status == "FINISHED" for s in ("pretrain", "sft", "reward", "ppo"))
    base = children["pretrain"]
    tags = base.data.tags
    assert tags["crawl2chat.data_version"] == "v0002" and tags["crawl2chat.data_digest"] == manifest["content_digest"]
    assert tags[f"{INPUT_PREFIX}data"] == writes["v0002"].info.run_id
    assert client.get_metric_history(base.info.run_id, "loss")
    # Lineage: each stage's run names the runs it read, and `crawl2chat lineage` follows them.
    inputs = {stage: {k[len(INPUT_PREFIX):]: v for k, v in children[stage].data.tags.items()
                      if k.startswith(INPUT_PREFIX)} for stage in ("sft", "reward", "ppo")}
    assert inputs["sft"] == {"base": base.info.run_id} and inputs["reward"] == {"base": base.info.run_id}
    assert inputs["ppo"] == {"sft": children["sft"].info.run_id, "reward": children["reward"].info.run_id}
    from crawl2chat.infra.lineage import format_lineage

    mlflow.set_tracking_uri(deployed.tracking_uri)
    chain = format_lineage(str(tmp / "ppo" / "model"))
    for upstream in (children["sft"], children["reward"], base, writes["v0002"]):
        assert f"run {upstream.info.run_id}" in chain, chain

    # What the worker's terminal showed: each data step's progress, no library notices or bars.
    shown = (deployed.logs / "worker.log").read_text(errors="replace")
    assert re.search(r"^\[data\] langid +documents \d+/\d+  \[#{20}\]", shown, re.M)
    for notice in ("PYTHON worker processes", "Token authentication is", "Loading weights"):
        assert notice not in shown, notice

    # Stopping the worker leaves no process behind (flow-run processes and their Ray included).
    assert deployed.stop_worker() == []


def test_serve_flows_does_not_replace_the_work_pool_deployments(deployed):
    """`crawl2chat serve-flows` against the server that `prefect deploy` filled: refused in one
    sentence, the work pool's deployments left as they were (a worker still runs them)."""
    import sys

    env = dict(server_env(deployed.tmp), PREFECT_API_URL=deployed.api)
    proc = subprocess.run([str(Path(sys.executable).parent / "crawl2chat"), "serve-flows", "--crash-after", "0"],
                          env=env, cwd=deployed.tmp, capture_output=True, text=True, timeout=300)
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert proc.returncode == 2 and "through a work pool" in last, proc.stdout[-2000:] + proc.stderr[-2000:]
    refresh = api_call(deployed.api, "GET", "/deployments/name/data/data-refresh")
    assert refresh["work_pool_name"] == WORK_POOL["name"] and refresh["pull_steps"], refresh
