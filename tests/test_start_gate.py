"""A training process started before its data is ready (``run_streaming``'s ``prepare``):
it goes on only once the preparation is done, is stopped when the preparation fails,
and dies with its owner killed mid-preparation; real processes and signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from crawl2chat.infra.fault_drill import run_processes, wait_until_gone
from crawl2chat.infra.launch import LaunchError, run_streaming

# A stand-in rank: what a stage's script does first (stage._run_main), then a report.
RANK = textwrap.dedent("""
    import json, os, sys
    from crawl2chat.stages.lifetime import die_with_parent
    from crawl2chat.stages.start_gate import wait_at_gate
    die_with_parent()
    go = wait_at_gate()
    print(json.dumps({"go": go, "prepared": os.path.exists(sys.argv[1]),
                      "gate_left_set": "CRAWL2CHAT_START_GATE" in os.environ,
                      "imported": "transformers.modeling_utils" in sys.modules}), flush=True)
""")


def test_the_rank_goes_on_once_the_preparation_is_done(tmp_path):
    marker = tmp_path / "prepared"
    lines: list[str] = []

    def prepare():
        time.sleep(0.5)
        marker.write_text("data")

    assert run_streaming([sys.executable, "-c", RANK, str(marker)], on_line=lines.append, prepare=prepare) == 0
    report = json.loads(lines[-1])
    # Its libraries imported at the gate, the data there when it went on, no gate left for its children.
    assert report == {"go": True, "prepared": True, "gate_left_set": False, "imported": True}


def test_a_failed_preparation_stops_the_waiting_rank(tmp_path):
    tag = tmp_path / "failing"
    lines: list[str] = []

    def prepare():
        deadline = time.monotonic() + 60
        while not run_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run_processes(tag)  # the rank is up, waiting
        raise ValueError("input.txt holds no text")

    with pytest.raises(ValueError, match="no text"):
        run_streaming([sys.executable, "-c", RANK, str(tag)], on_line=lines.append, prepare=prepare, grace_seconds=5)
    assert wait_until_gone(tag, timeout=20) == []
    assert not any('"go": true' in line for line in lines)


def test_a_rank_that_ends_before_the_word_reports_its_own_error(tmp_path):
    with pytest.raises(LaunchError) as failed:
        run_streaming([sys.executable, "-c", "print('cannot start: bad settings', flush=True); raise SystemExit(2)"],
                      prepare=lambda: time.sleep(1.0))
    assert failed.value.returncode == 2 and "cannot start: bad settings" in failed.value.tail


OWNER = textwrap.dedent("""
    import sys, time
    from crawl2chat.infra.launch import run_streaming
    print("owner up", flush=True)
    run_streaming([sys.executable, "-c", sys.argv[1], sys.argv[2]], prepare=lambda: time.sleep(600))
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_the_waiting_rank_dies_with_its_owner_killed_mid_preparation(tmp_path, sig):
    tag = tmp_path / f"owner-{sig.name}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, RANK, str(tag)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert owner.stdout.readline().strip() == "owner up"
    deadline = time.monotonic() + 60
    while len(run_processes(tag)) < 2 and time.monotonic() < deadline:  # the owner and its rank
        time.sleep(0.05)
    assert len(run_processes(tag)) == 2, run_processes(tag)
    os.kill(owner.pid, sig)
    owner.wait(timeout=60)
    assert wait_until_gone(tag, timeout=20) == []
