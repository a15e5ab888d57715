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
