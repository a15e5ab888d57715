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
