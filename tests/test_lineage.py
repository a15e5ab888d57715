"""Lineage walks MLflow input tags both ways, on a real SQLite store."""

from __future__ import annotations

import mlflow

from crawl2chat.infra.lineage import format_lineage, input_tags, resolve_run
from crawl2chat.infra.tracking import setup_tracking


def test_chain_is_walked_upstream_and_downstream(tmp_path):
    setup_tracking(tmp_path, "lineage-test")
    ids = {}

    def stage(name, model_dir=None, **inputs):
        tags = {"crawl2chat.stage": name, **input_tags(**inputs)}
        if model_dir:
            (tmp_path / model_dir).mkdir()
            tags["crawl2chat.model_dir"] = str((tmp_path / model_dir).resolve())
        with mlflow.start_run(run_name=name, tags=tags) as run:
            ids[name] = run.info.run_id

    stage("write")
    stage("pretrain", "base", data=ids["write"])
    stage("sft", "sft", base=ids["pretrain"])
    stage("reward", "rm", base=ids["pretrain"])
    stage("ppo", "policy", sft=ids["sft"], reward=ids["reward"])
    stage("mlm", "encoder", data=ids["write"])
    stage("distill", "student", teacher=ids["pretrain"], data=ids["write"])
    stage("contrastive", "embedder", encoder=ids["mlm"], data=ids["write"])

    text = format_lineage(ids["sft"])
    up, _, down = text.partition("this:")
    assert ids["pretrain"] in up and ids["write"] in up
    assert ids["ppo"] in down and ids["reward"] not in down
    # Every role a stage reads a model under is followed downstream: a distillation's teacher,
    # contrastive learning's starting encoder.
    (teacher_line,) = [x for x in format_lineage(ids["pretrain"]).splitlines() if ids["distill"] in x]
    assert teacher_line.strip().startswith("-> as teacher")
    assert any(ids["contrastive"] in x and "as encoder" in x for x in format_lineage(ids["mlm"]).splitlines())
    # A model folder resolves to the run that wrote it.
    assert resolve_run(str(tmp_path / "policy")).info.run_id == ids["ppo"]
    policy_up = format_lineage(ids["ppo"]).partition("this:")[0]
    for name in ("sft", "reward", "pretrain", "write"):
        assert ids[name] in policy_up
    # An exported copy resolves to the run that wrote its source.
    import json

    (tmp_path / "exported").mkdir()
    (tmp_path / "exported" / "export_report.json").write_text(json.dumps({"source": str((tmp_path / "policy").resolve())}))
    assert resolve_run(str(tmp_path / "exported")).info.run_id == ids["ppo"]
    # A run that did not finish says so where it is listed.
    with mlflow.start_run(run_name="dpo", tags={"crawl2chat.stage": "dpo", **input_tags(sft=ids["sft"])}) as run:
        failed = run.info.run_id
    mlflow.MlflowClient().set_terminated(failed, "FAILED")
    (line,) = [x for x in format_lineage(ids["sft"]).splitlines() if failed in x]
    assert line.endswith("[FAILED]")
    assert not any(x.endswith("]") for x in format_lineage(ids["sft"]).splitlines() if failed not in x)


def test_each_home_keeps_its_own_tracking_store(tmp_path):
    # MLflow writes the URI it is given into the environment; a second home must not inherit the first.
    first = setup_tracking(tmp_path / "a", "crawl2chat")
    second = setup_tracking(tmp_path / "b", "crawl2chat")
    assert first == f"sqlite:///{(tmp_path / 'a').resolve() / 'mlflow.db'}"
    assert second == f"sqlite:///{(tmp_path / 'b').resolve() / 'mlflow.db'}"


OPENER = """
import sys, time
from crawl2chat.infra.tracking import setup_tracking, stage_run
setup_tracking(sys.argv[1], "abandoned-test")
with stage_run("pretrain") as run:
    print(run.info.run_id, flush=True)
    time.sleep(600)
"""


def test_a_run_whose_process_was_killed_is_closed_by_the_next_command(tmp_path):
    """A stage run left RUNNING by a process killed with SIGKILL is marked KILLED when the
    next command opens the store; the run of a process still alive stays RUNNING."""
    import signal
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        killed, alive = (p.stdout.readline().strip() for p in procs)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        setup_tracking(tmp_path, "abandoned-test")
        client = mlflow.MlflowClient()
        assert client.get_run(killed).info.status == "KILLED" and client.get_run(killed).info.end_time
        assert client.get_run(alive).info.status == "RUNNING"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_a_model_folder_is_traced_from_any_folder_without_making_a_store(tmp_path):
    """``crawl2chat lineage /abs/path/model`` run elsewhere: the store its training recorded
    beside the run folder is used; a lookup never makes a store of its own."""
    import json
    import os
    import subprocess
    import sys

    from crawl2chat.infra.run_folders import DONE_FILE

    project = tmp_path / "project"
    setup_tracking(project / ".crawl2chat", "lineage-elsewhere")
    model = project / "runs" / "pretrain" / "k1" / "model"
    model.mkdir(parents=True)
    try:
        with mlflow.start_run(run_name="pretrain", tags={"crawl2chat.stage": "pretrain",
                                                          "crawl2chat.model_dir": str(model.resolve())}) as run:
            pass
        (model.parent / DONE_FILE).write_text(json.dumps({"tracking_uri": mlflow.get_tracking_uri()}))
    finally:
        mlflow.set_tracking_uri(None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    cli = [sys.executable, "-m", "crawl2chat.cli", "lineage"]
    found = subprocess.run([*cli, str(model)], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    assert run.info.run_id in found.stdout.partition("this:")[2].splitlines()[0]
    missing = subprocess.run([*cli, str(tmp_path / "nothing")], cwd=elsewhere, env=env, capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "no MLflow store here" in missing.stderr
    assert list(elsewhere.iterdir()) == []


def test_an_input_recorded_in_another_store_is_not_linked_and_does_not_break_the_walk(tmp_path):
    """A dataset built with the embedded store, trained on with a tracking server: the
    training run links no data run it cannot show, and a run that names one anyway
    (recorded before) is still traced."""
    import json

    from crawl2chat.tasks.data import data_lineage

    setup_tracking(tmp_path / "elsewhere", "lineage-test")
    with mlflow.start_run(run_name="write") as run:
        elsewhere = run.info.run_id
    data = tmp_path / "data"
    (data / "versions" / "v0001").mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({"version": "v0001", "content_digest": "sha256:ab", "shards": []}))
    (data / "versions" / "v0001" / "mlflow_run.json").write_text(json.dumps({"run_id": elsewhere}))

    setup_tracking(tmp_path / "here", "lineage-test")
    tags = data_lineage(str(data))
    assert tags["crawl2chat.data_version"] == "v0001" and "crawl2chat.input.data" not in tags
    with mlflow.start_run(run_name="pretrain", tags={"crawl2chat.stage": "pretrain", **input_tags(data=elsewhere)}) as run:
        here = run.info.run_id
    up = format_lineage(here).partition("this:")[0]
    assert elsewhere not in up
