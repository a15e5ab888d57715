"""A folder a run needs that is missing or cannot be written ends the run before any
work with one sentence naming it and what to do, and exit status 2: the deployments'
CRAWL2CHAT_WORKDIR (prefect.yaml's pull step, run as a worker's flow-run process
runs it) and the command line's project folder (`home`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# What a worker's flow-run process does with prefect.yaml's pull steps (Prefect's
# run_step, less the API look-ups of blocks and variables): the worker's environment
# templated into the step's inputs, the step imported by name and called in a thread.
PULL = """
import os, threading, yaml
from prefect.utilities.importtools import import_object
from prefect.utilities.templating import apply_values
for step in yaml.safe_load(open({spec!r}))["pull"]:
    (fqn, inputs), = step.items()
    call = threading.Thread(target=import_object(fqn), kwargs=apply_values(inputs, os.environ))
    call.start()
    call.join()
print("cwd=" + os.getcwd())
"""


def run_pull_steps(tmp_path: Path, workdir: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CRAWL2CHAT_WORKDIR"}
    if workdir is not None:
        env["CRAWL2CHAT_WORKDIR"] = workdir
    code = PULL.format(spec=str(ROOT / "prefect.yaml"))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_prefect_yaml_pull_step_checks_the_workdir(tmp_path):
    pull = yaml.safe_load((ROOT / "prefect.yaml").read_text())["pull"]
    assert pull == [{"crawl2chat.infra.workdir.enter_workdir": {"directory": "{{ $CRAWL2CHAT_WORKDIR }}"}}]

    good = run_pull_steps(tmp_path, str(ROOT))
    assert good.returncode == 0 and f"cwd={ROOT}" in good.stdout, good.stderr[-2000:]

    missing = tmp_path / "no" / "such" / "checkout"
    proc = run_pull_steps(tmp_path, str(missing))
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"error: CRAWL2CHAT_WORKDIR={missing} does not exist: set it to a crawl2chat checkout this "
                    "user can write in (the folder holding prefect.yaml) and restart the Prefect worker.")
    assert "Traceback" not in proc.stderr

    a_file = tmp_path / "prefect.yaml"
    a_file.write_text("")
    proc = run_pull_steps(tmp_path, str(a_file))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: CRAWL2CHAT_WORKDIR={a_file} is not a folder: set it to")

    proc = run_pull_steps(tmp_path, None)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: CRAWL2CHAT_WORKDIR is not set in the Prefect worker's environment: set it to the crawl2chat checkout")


def test_project_folder_that_cannot_be_created_ends_the_command_plainly(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = blocker / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run([sys.executable, "-m", "crawl2chat.cli", "data", "--input", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--set", f"home={home}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: The project folder {home} (setting `home`) cannot be created: {blocker} is not a folder: "
        "run from a folder you can write in, or choose one with --set home=DIR."]
    assert not (tmp_path / "out").exists()


def test_folder_checks(tmp_path):
    import pytest

    from crawl2chat.infra.workdir import FolderUnusable, check_home, check_workdir

    assert check_workdir(str(tmp_path)) == tmp_path.resolve()
    assert check_home(str(tmp_path / "new" / "home")) == (tmp_path / "new" / "home").resolve()
    with pytest.raises(FolderUnusable, match="is not set"):
        check_workdir("  ")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(FolderUnusable, match="cannot be written by this user"):
            check_workdir(str(locked))
        with pytest.raises(FolderUnusable, match="cannot be created"):
            check_home(str(locked / "home"))
    if Path("/proc/self").is_dir():  # permission bits say yes to root there; making the folder says no
        with pytest.raises(FolderUnusable, match=r"/proc/crawl2chat-home \(setting `home`\) cannot be created \("):
            check_home("/proc/crawl2chat-home")


def test_a_file_where_an_output_folder_goes_ends_the_command_plainly(tmp_path):
    (tmp_path / "runs").write_text("x")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run([sys.executable, "-m", "crawl2chat.cli", "data", "--input", str(tmp_path / "in.warc.gz"),
                           "--out", "runs/data"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'runs'} is in the way: a folder is needed there and it is a file")


def test_a_deployment_that_stored_its_workdir_says_to_deploy_again(tmp_path, monkeypatch):
    """Set when `prefect deploy` ran, the value is stored in the deployment and the worker's
    own is not read: restarting the worker would not help, deploying again does."""
    import pytest

    from crawl2chat.infra.workdir import FolderUnusable, check_workdir

    monkeypatch.setenv("CRAWL2CHAT_WORKDIR", str(tmp_path))  # the worker's: fine, and not the one used
    with pytest.raises(FolderUnusable, match=r"the deployment stored it when `prefect deploy` ran, so deploy again"):
        check_workdir(str(tmp_path / "gone"))


def test_the_workdir_sentence_reaches_the_flow_runs_state_and_logs(prefect_api, tmp_path):
    """The pull step ends its process before Prefect's log handler sends anything: the
    sentence is put on the flow run itself (Failed, with it as the message) and in its logs,
    where the Prefect UI shows them."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL

    @flow(name="workdir-check")
    def nothing() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(nothing)
    missing = tmp_path / "no" / "checkout"
    env = {**{k: v for k, v in os.environ.items() if k != "CRAWL2CHAT_WORKDIR"},
           "CRAWL2CHAT_WORKDIR": str(missing), "PREFECT__FLOW_RUN_ID": str(run.id), "PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.run([sys.executable, "-c", PULL.format(spec=str(ROOT / "prefect.yaml"))], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    sentence = proc.stderr.strip().splitlines()[-1].removeprefix("error: ")
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert state.type.value == "FAILED" and state.message == sentence
    assert [log.message for log in logs] == [sentence]
