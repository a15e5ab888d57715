"""The terminal shows the stages' own lines: library notices are filtered from a
launched stage's output (they stay in its log file) unless -v / CRAWL2CHAT_VERBOSE."""

from __future__ import annotations

import subprocess
import sys

from crawl2chat.infra.console import VERBOSE_ENV, is_chatter

NOTICES = [
    "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving. This should be OK, but check by verifying",
    "[2026-12-03 11:52:10,063] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you",
    "\U0001F3C3 View run pretrain at: http://127.0.0.1:37609/#/experiments/1/runs/35b99a76",
    "2026/12/03 10:55:40 INFO mlflow.store.db.utils: Creating initial MLflow database tables...",
    "\x1b[33m(raylet)\x1b[0m WARNING: 8 PYTHON worker processes have been started on node: 7eafaff4 with address: "
    "127.0.0.1, which is 4x the maximum expected startup concurrency (2).",
    "2026-12-03 15:43:42,882\tWARNING dataset.py:8601 -- Warning: The Ray cluster currently does not have any "
    "available CPUs. The Dataset job will hang unless more CPUs are freed up.",
    "Still processing items: 5 items remaining...",
    "Replacing spaces in invalid WARC-Target-URI: hello this",
]
PROGRESS = [
    "10 steps, val_loss 4.411 -> /tmp/run/model",
    "step 40 loss 3.2 lr 1e-3",
    "RuntimeError: CUDA out of memory while saving",  # errors always show
    "Setting accelerator to CPU",  # the words alone, outside DeepSpeed's notice, are not filtered
]


def test_library_notices_are_filtered_and_progress_is_not(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    assert all(is_chatter(line) for line in NOTICES)
    assert not any(is_chatter(line) for line in PROGRESS)
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert not any(is_chatter(line) for line in NOTICES)


def test_verbose_flag_reaches_the_process_and_what_it_starts():
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in (VERBOSE_ENV, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "MLFLOW_LOGGING_LEVEL")}
    code = ("import os, sys; from crawl2chat.cli import app; sys.argv = ['c2c', '-v', 'chat', '--help'];\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "print('VERBOSE=' + os.environ.get('CRAWL2CHAT_VERBOSE', ''), "
            "'URLS=' + os.environ.get('MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT', ''))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env).stdout
    assert "VERBOSE=1 URLS=" in out and "URLS=true" not in out
    quiet = subprocess.run([sys.executable, "-c", code.replace("'-v', ", "")], capture_output=True, text=True,
                           timeout=120, env=env).stdout
    assert "VERBOSE= URLS=true" in quiet


def test_every_command_shows_an_example():
    import re

    from typer.testing import CliRunner

    from crawl2chat.cli import app

    env = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    top = CliRunner().invoke(app, ["--help"], env=env)
    assert "Example: crawl2chat run" in top.output
    commands = re.findall(r"^│ (\w[\w-]*)\s{2,}", top.output, re.M)
    assert {"data", "run", "pretrain", "distill", "eval", "serve", "chat", "lineage"} <= set(commands)
    for name in commands:
        out = CliRunner().invoke(app, [name, "--help"], env=env).output
        assert "Example:" in out and "crawl2chat" in out.split("Example:", 1)[1], name


def test_raylet_notices_stay_off_the_terminal_unless_verbose(ray_local, capsys, monkeypatch):
    """A notice the raylet publishes to the driver (its worker-count warning) is held
    back; any other message on that channel is printed; -v prints the notice too."""
    import time

    import ray
    from ray._private.utils import publish_error_to_driver

    gcs = ray._private.worker.global_worker.gcs_client
    notice = ("WARNING: 8 PYTHON worker processes have been started on node: 7eafaff4 with address: 127.0.0.1, "
              "which is 4x the maximum expected startup concurrency (2).")

    def publish(message: str) -> None:
        publish_error_to_driver("worker_pool_large", message, gcs)

    def printed_until(text: str) -> str:
        deadline, out = time.time() + 30, ""
        while time.time() < deadline and text not in out:
            time.sleep(0.2)
            out += capsys.readouterr().out
        return out

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    publish(notice)
    publish("a message that is no notice")  # the channel keeps order: the notice was handled first
    out = printed_until("no notice")
    assert "no notice" in out and "PYTHON worker processes" not in out
    monkeypatch.setenv(VERBOSE_ENV, "1")
    publish(notice.replace("8 PYTHON", "12 PYTHON"))
    assert "12 PYTHON worker processes have been started" in printed_until("PYTHON worker processes")


def test_terminal_handlers_hold_notices_back_and_files_keep_them(tmp_path, monkeypatch):
    """Ray Data's notice reaches its log file, not the terminal handler of the same logger."""
    import io
    import logging

    from crawl2chat.infra.console import filter_terminal_handlers

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    logger = logging.getLogger("crawl2chat.test.ray_like")
    terminal, log_file = io.StringIO(), tmp_path / "ray-data.log"
    handlers = [logging.StreamHandler(terminal), logging.FileHandler(log_file)]
    for h in handlers:
        logger.addHandler(h)
    try:
        filter_terminal_handlers(logger.name)
        filter_terminal_handlers(logger.name)  # once is enough: no second filter
        assert len(handlers[0].filters) == 1 and not handlers[1].filters
        logger.warning("Warning: The Ray cluster currently does not have any available CPUs. The Dataset job will hang")
        logger.warning("a real problem")
        monkeypatch.setenv(VERBOSE_ENV, "1")
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled")
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
    assert terminal.getvalue().splitlines() == [
        "a real problem", "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled"]
    assert "does not have any available CPUs" in log_file.read_text()


def test_run_traces_keep_what_the_terminal_holds_back(tmp_path, monkeypatch):
    """After ``keep_run_traces``: a failed run's "Finished in state Failed" line and a library's
    notice (warcio's) stay off the terminal handler and reach HOME/logs/flow-runs.log; a real
    warning shows on both."""
    import io
    import logging
    from pathlib import Path

    from crawl2chat.infra.console import keep_run_traces

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    root = logging.getLogger()
    terminal = io.StringIO()
    console = logging.StreamHandler(terminal)
    root.addHandler(console)
    before = list(root.handlers)
    try:
        path = Path(keep_run_traces(tmp_path))
        logging.getLogger("prefect.task_runs").error("Finished in state Failed('Task run encountered an exception')")
        logging.getLogger("prefect.flow_runs").error("Crash detected! Execution was aborted by a termination signal.")
        logging.getLogger("warcio.recordloader").warning("Replacing spaces in invalid WARC-Target-URI: hello this")
        logging.getLogger("crawl2chat.test").warning("a real problem")
    finally:
        for h in [h for h in root.handlers if h not in before] + [console]:
            root.removeHandler(h)
            h.close()
    assert terminal.getvalue().splitlines() == ["a real problem"]
    logged = path.read_text()
    assert "Finished in state Failed" in logged and "Crash detected!" in logged and "Replacing spaces" in logged and "a real problem" in logged
