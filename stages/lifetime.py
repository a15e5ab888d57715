"""Processes that never outlive whoever started them.

A training launch is a chain: the command or Prefect task (the *owner*) starts
``accelerate launch``, which starts one process per rank (a one-process run is
started by the owner itself, ``infra.launch.simple_launch``). Killing the owner
with any signal, SIGKILL included, must take the whole chain with it, or the
ranks go on writing checkpoints into a folder a rerun is about to use.

On Linux every link of the chain asks the kernel for a *parent-death signal*
(``prctl(PR_SET_PDEATHSIG)``): the launcher is started with one
(:func:`die_with_parent_preexec`, run between ``fork`` and ``exec``), and each
rank sets its own as its script starts (:func:`die_with_parent`, called by
``stage.run_script``). When a parent dies its child gets SIGKILL, that child's
children get theirs, and so on down the tree.

The kernel sends the signal when the *thread* that created the child exits,
not the process. The owner therefore starts and waits for the launcher from
one thread (``infra.launch.run_streaming`` blocks in it until the launcher has
exited), so a Prefect worker thread that finishes early cannot kill a healthy
run, and a thread that dies with its process kills the run as it should.

A rank that set its signal after its parent had already died would never get
one; the owner's pid is therefore passed down in ``CRAWL2CHAT_OWNER_PID`` and a
rank whose ancestors no longer include it exits at once.

Elsewhere (macOS) there is no parent-death signal: only the process-group
handling of ``run_streaming`` applies (Ctrl-C, SIGTERM of the owner's task).

Not every process a command starts is started by this project: Prefect's local
API server, Ray's agents and whatever those start again cannot be given a
parent-death signal. A command therefore holds a *lifeline*
(:func:`hold_lifeline`): a token in ``CRAWL2CHAT_LIFELINE`` that every process it
starts inherits, and a small reaper process that waits on a pipe from the
command. The pipe closes when the command ends, however it ends; the reaper then
kills every process still carrying the token and exits. While it waits it also
keeps a list of the command's descendants (pid and start time, once a
second), and kills those too: a process started with an environment of its own
choosing does not carry the token.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import NoReturn

OWNER_ENV = "CRAWL2CHAT_OWNER_PID"  # the pid of the process a launched job belongs to
LIFELINE_ENV = "CRAWL2CHAT_LIFELINE"  # "<pid of the command>:<random>", inherited by all it starts
_PR_SET_PDEATHSIG = 1

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        _prctl = None

HAVE_PDEATHSIG = _prctl is not None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits."""
    if _prctl is None:
        return False
    return _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent_preexec(sig: int = signal.SIGKILL):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child dies with the calling thread.

    Everything it needs is resolved before the fork (the libc function, the
    parent's pid), so between ``fork`` and ``exec`` it only makes two system
    calls; a parent that died before the signal was armed is caught by
    comparing the parent pid."""
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os._exit(137)

    return preexec


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """For a process started by a launcher it does not control (an ``accelerate
    launch`` rank): die with the parent, and exit now if the owner named in
    ``CRAWL2CHAT_OWNER_PID`` is no longer among this process's ancestors (the
    chain broke before the signal was armed)."""
    set_parent_death_signal(sig)
    owner = os.environ.get(OWNER_ENV)
    if owner and owner.isdigit() and int(owner) not in ancestors():
        print(f"the process that started this run (pid {owner}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(137)


def exit_now(code: int) -> NoReturn:
    """End this process with status ``code`` the way Python's own exit does, up to its
    teardown: other (non-daemon) threads are waited for, ``atexit`` handlers run and
    the standard streams are flushed; then ``os._exit``, without tearing the
    interpreter down.

    The teardown is skipped for two reasons. A training rank: torch's gloo worker
    threads let go of a finished collective's tensors a moment after the caller's wait
    returns (or whenever an unawaited prefetch, such as ZeRO-3's parameter gathers,
    completes), and releasing a tensor that carries Python state takes the GIL. Once
    teardown has begun Python makes any other thread that asks for the GIL exit on the
    spot; inside that C++ destructor the exit aborts the process (``terminate called
    without an active exception``, SIGABRT), so a run that finished its work was
    reported as failed. The command line: with Prefect, MLflow and their dependencies
    loaded, the teardown took 1.4 s of a small ``crawl2chat data`` (11 s in all) and
    does nothing a user needs. What is written is closed (and atomically renamed) before
    this is called, or by an ``atexit`` handler (logging's, MLflow's, Prefect's API
    server stop); open files of the process are closed by the kernel."""
    import atexit
    import threading

    try:
        shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls first at exit
        if shutdown is not None and threading.current_thread() is threading.main_thread():
            shutdown()
        atexit._run_exitfuncs()  # logging's flush among them
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed, or replaced by None
                pass
        os._exit(code)


def ancestors(pid: int | None = None) -> list[int]:
    """The pids from this process's parent up to (and including) pid 1."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except psutil.Error:
        return []


def descendants(pid: int) -> list:
    """The live processes below ``pid`` (psutil processes)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def stop_process(proc, grace: float = 5.0) -> None:
    """SIGTERM a ``subprocess.Popen`` child, SIGKILL it after ``grace`` seconds, and reap it."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def terminate_tree(pgid: int, procs: Iterable, grace: float = 10.0) -> None:
    """SIGTERM the process group ``pgid`` and the processes ``procs`` (a launcher's
    tree collected beforehand, which may have left the group), wait up to ``grace``
    seconds, then SIGKILL what is left."""
    import psutil

    procs = list(procs)
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


# ---------------------------------------------------------------- lifeline


def hold_lifeline() -> str | None:
    """Tie every process this one starts from now on to this process's life (see the
    module docstring); returns the token. Idempotent within a process; a command
    started by another command holds a lifeline of its own (and, carrying the
    outer token, is reaped by the outer one)."""
    import secrets
    import subprocess

    held = os.environ.get(LIFELINE_ENV, "")
    if held.split(":", 1)[0] == str(os.getpid()):
        return held
    token = f"{os.getpid()}:{secrets.token_hex(8)}"
    os.environ[LIFELINE_ENV] = token
    try:
        # The write end stays in this process only (pipes are not inherited by the
        # processes it starts), so the reaper reads EOF exactly when this process is gone.
        reaper = subprocess.Popen([sys.executable, "-m", "crawl2chat.stages.lifetime", token],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)  # out of the reach of Ctrl-C and of a group kill
    except OSError:
        return token
    hold_lifeline._reaper = reaper  # the pipe's write end lives as long as this process
    return token


def carrying(token: str) -> list[int]:
    """Live processes (other than this one) whose environment carries the lifeline ``token``.

    On Linux the environment block is read raw from ``/proc``: processes that retitle
    themselves (Ray's agents) overwrite its first entries, and a parser that stops at
    the first empty entry would miss the token further on."""
    import psutil

    entry = f"{LIFELINE_ENV}={token}".encode()
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if os.path.isdir("/proc"):
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    has = entry in f.read().split(b"\0")
            else:
                has = p.environ().get(LIFELINE_ENV) == token
            if has and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return found


def reap(token: str, known: dict[int, float] | None = None, settle: float = 2.0, limit: float = 20.0) -> list[int]:
    """Kill every process carrying ``token`` and every process of ``known`` (pid: start
    time; a pid since reused by another process is left alone), scanning again until
    none has been seen for ``settle`` seconds (a process may be starting while its
    parent is killed), or ``limit`` seconds have passed."""
    import psutil

    killed: list[int] = []
    for pid, started in (known or {}).items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                proc.kill()
                killed.append(pid)
        except psutil.Error:
            pass
    start = last_seen = time.monotonic()
    while time.monotonic() - last_seen < settle and time.monotonic() - start < limit:
        for pid in carrying(token):
            last_seen = time.monotonic()
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    return killed


def _family(pid: int) -> dict[int, float]:
    """``pid``'s live descendants, pid: start time."""
    import psutil

    found = {}
    for proc in descendants(pid):
        try:
            found[proc.pid] = proc.create_time()
        except psutil.Error:
            pass
    return found


def _reaper_main(token: str) -> None:
    """Wait for the command to end, then reap. The end is the pipe's EOF, or this process
    being re-parented: a process the command forked without exec holds a copy of the
    pipe's write end and would delay the EOF for as long as it lives."""
    import select

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    command = int(token.split(":", 1)[0])
    parent = os.getppid()
    known: dict[int, float] = {}
    scanned = 0.0
    try:
        # A parent other than the command means the command has already ended (this
        # process was re-parented before it got here): only the token is left to go by.
        while parent == command and os.getppid() == parent:
            if time.monotonic() - scanned >= 1.0:
                scanned = time.monotonic()
                family = _family(command)
                if os.getppid() != command:
                    break  # the command ended during the scan; its pid may already be another's
                known.update(family)
                known.pop(os.getpid(), None)
            ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.5)
            if ready and not os.read(sys.stdin.fileno(), 65536):
                break
    except OSError:
        pass
    reap(token, known)


if __name__ == "__main__":
    _reaper_main(sys.argv[1])
