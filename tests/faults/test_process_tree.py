"""No process outlives its owner: the launch path (``run_streaming``) with a stand-in
for ``accelerate launch`` whose "rank" leaves the process group, and a local Ray.
The owner is killed with SIGKILL, SIGTERM or Ctrl-C (SIGINT)."""

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

# The stand-in launcher starts a "rank" in a session of its own (out of reach of a
# process-group kill) that arms its parent-death signal as the training scripts do.
RANK = "from crawl2chat.stages.lifetime import die_with_parent; die_with_parent(); import time; time.sleep(600)"
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)
    print('launched', flush=True)
    time.sleep(600)
""")
OWNER = textwrap.dedent("""
    import sys
    from crawl2chat.infra.launch import run_streaming
    run_streaming([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]], grace_seconds=5,
                  on_line=lambda line: print(line, flush=True))
""")


def start_owner(tag: str) -> subprocess.Popen:
    # Ctrl-C as in a terminal: a suite started in the background (``cmd &``) hands its
    # children an ignored SIGINT, which Python keeps ignored.
    owner = subprocess.Popen([sys.executable, "-c", OWNER, LAUNCHER, RANK, tag], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert owner.stdout.readline().strip() == "launched"
    deadline = time.monotonic() + 60
    while len(run_processes(tag)) < 3 and time.monotonic() < deadline:  # owner, launcher, rank
        time.sleep(0.05)
    assert len(run_processes(tag)) == 3, run_processes(tag)
    return owner


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_launched_tree_dies_with_its_owner(tmp_path, sig):
    tag = str(tmp_path / f"tree-{sig.name}")
    owner = start_owner(tag)
    os.kill(owner.pid, sig)
    owner.wait(timeout=60)
    assert wait_until_gone(tag, timeout=20) == []


def test_a_rank_whose_owner_is_gone_exits_at_once(tmp_path):
    """A rank that arms its signal after the chain broke finds its owner missing."""
    env = {**os.environ, "CRAWL2CHAT_OWNER_PID": "999999999"}
    rank = subprocess.run([sys.executable, "-c", RANK, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert rank.returncode == 137 and "(pid 999999999) is gone" in rank.stderr


DRIVER = textwrap.dedent("""
    import json, os, sys, time
    import psutil
    from crawl2chat.infra.ray_runtime import ensure_ray
    ensure_ray(num_cpus=1)
    time.sleep(3)  # let the raylet start its agents
    me = psutil.Process()
    print(json.dumps([[p.pid, p.create_time()] for p in me.children(recursive=True)]), flush=True)
    time.sleep(600)
""")


def test_local_ray_dies_with_its_driver():
    """SIGKILL of a process that started the project's local Ray: every Ray process
    below it (GCS, raylet, workers, agents) exits too, within seconds (Ray's own agents
    would wait a minute on the dead GCS)."""
    import psutil

    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        started = json.loads(driver.stdout.readline())
    finally:
        os.kill(driver.pid, signal.SIGKILL)  # the driver alone: Ray's processes share its group
        driver.wait()
    assert started, "Ray started no processes"
    t0 = time.monotonic()
    left = started
    while left and time.monotonic() - t0 < 120:
        left = [(pid, ct) for pid, ct in left if psutil.pid_exists(pid) and _same(pid, ct)]
        time.sleep(0.2)
    assert left == [], [psutil.Process(pid).cmdline() for pid, _ in left]
    assert time.monotonic() - t0 < 20


TERMINATED = textwrap.dedent("""
    import time
    from crawl2chat.infra.console import quiet_libraries
    quiet_libraries()  # as every entry point does, before Ray loads
    from crawl2chat.infra.ray_runtime import ensure_ray
    ensure_ray(num_cpus=1)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_ray_driver_stopped_with_sigterm_ends_as_terminated_without_a_dump():
    """Ray's failure-signal handler would turn the SIGTERM into an abort (status 134) with a
    C++ stack dump on the terminal; the process ends as SIGTERM ends it, and quietly."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "CRAWL2CHAT_VERBOSE")}
    driver = subprocess.Popen([sys.executable, "-c", TERMINATED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, start_new_session=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
        driver.send_signal(signal.SIGTERM)
        _, stderr = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    # Killed by the signal, or exited with its number (Ray's Python handler) or 128 + it; never an abort.
    assert driver.returncode in (-signal.SIGTERM, signal.SIGTERM, 128 + signal.SIGTERM), driver.returncode
    assert "SIGTERM received" not in stderr, stderr[-2000:]


RELEASER = textwrap.dedent("""
    import json, time
    import psutil, ray
    from crawl2chat.infra.ray_runtime import ensure_ray, release_local_ray
    from crawl2chat.stages.lifetime import hold_lifeline
    ensure_ray(num_cpus=1)
    time.sleep(3)  # let the raylet start its agents
    me = psutil.Process()
    started = len(me.children(recursive=True))
    stopped, again = release_local_ray(), release_local_ray()
    lifeline = hold_lifeline._reaper.pid  # held for the whole process, not Ray's
    def ray_left():
        return [" ".join(p.cmdline()[:4]) for p in me.children(recursive=True) if p.pid != lifeline]
    deadline = time.monotonic() + 20
    while ray_left() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = ray_left()
    print(json.dumps({"started": started, "stopped": stopped, "again": again, "left": left,
                      "initialized": ray.is_initialized()}), flush=True)
""")


def test_local_ray_released_for_training_leaves_no_process():
    """Training stops the local Ray once its data is prepared (``release_local_ray``): every
    Ray process goes while the process that started it carries on; a second call, or one
    with no local instance, stops nothing."""
    proc = subprocess.run([sys.executable, "-c", RELEASER], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["started"] > 0 and result["stopped"] and not result["again"]
    assert result["left"] == [] and not result["initialized"]


def _same(pid: int, create_time: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == create_time and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


ORPHAN_HOLDER = textwrap.dedent("""
    import os, sys, time
    if os.fork():
        os._exit(0)  # the holder's parent dies at once: it is re-parented to init
    from crawl2chat.stages.locks import acquire
    acquire(sys.argv[1])
    time.sleep(float(sys.argv[2]))  # the time the kernel takes to tear a dying rank down
""")


def test_a_rerun_waits_for_a_dying_holder_not_for_a_live_one(tmp_path):
    """A rank orphaned by its killed launcher still holds the run folder for a
    moment: a rerun started at once waits for it instead of failing; a holder
    whose parent is alive is reported at once."""
    from crawl2chat.stages.locks import FolderBusy, acquire, read_holder, release

    folder = tmp_path / "run"
    subprocess.run([sys.executable, "-c", ORPHAN_HOLDER, str(folder), "3"], check=True)
    deadline = time.monotonic() + 30
    while read_holder(folder)[0] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    orphan = read_holder(folder)[0]
    assert orphan is not None
    t0 = time.monotonic()
    release(acquire(folder, wait=0))
    assert time.monotonic() - t0 < 15

    live = subprocess.Popen([sys.executable, "-c", "import sys, time; from crawl2chat.stages.locks import acquire; "
                             "acquire(sys.argv[1]); print('held', flush=True); time.sleep(60)", str(folder)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(FolderBusy, match=f"process {live.pid}"):
            acquire(folder, wait=0)
        assert time.monotonic() - t0 < 2
    finally:
        live.kill()
        live.wait()


HELD = textwrap.dedent("""
    import os, subprocess, sys, time
    from crawl2chat.stages.lifetime import hold_lifeline
    hold_lifeline()
    # A server started the way Prefect starts its local API: no parent-death signal,
    # a session of its own; and one that retitles itself as Ray's agents do.
    a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]], start_new_session=True)
    b = subprocess.Popen([sys.executable, '-c', 'import ctypes, time; ctypes.CDLL(None).prctl(15, b"ray::Agent", 0, 0, 0); '
                          'time.sleep(600)', sys.argv[1]], start_new_session=True)
    # And one started with an environment of its own choosing, without the lifeline's token.
    c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[1]], start_new_session=True,
                         env={'PATH': os.environ.get('PATH', '')})
    time.sleep(2)  # the reaper notes the command's descendants once a second
    print(a.pid, b.pid, c.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_processes_outside_the_launch_path_die_with_a_command_holding_its_lifeline(tmp_path, sig):
    """A command (the CLI holds a lifeline from its first line) whose children were started
    by libraries, out of its process group and without a parent-death signal (one of them
    without the lifeline's token in its environment): when the command is killed, its
    reaper kills them."""
    import psutil

    tag = f"lifeline-{os.getpid()}-{sig.name}"
    command = subprocess.Popen([sys.executable, "-c", HELD, tag], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    children = [psutil.Process(int(p)) for p in command.stdout.readline().split()]
    assert len(children) == 3 and all(c.is_running() for c in children)
    os.kill(command.pid, sig)
    command.wait(timeout=30)
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert alive == [], [p.cmdline() for p in alive]
    assert wait_until_gone(tag, timeout=5) == []
