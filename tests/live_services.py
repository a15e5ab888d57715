"""Helpers of the tests that start real services as processes on 127.0.0.1: free
ports, readiness waits, process groups stopped whole, a Prefect server, the JSON
REST calls its UI makes, and a sweep for processes a test's services left behind.

Each service runs in a process group (session) of its own, so stopping one stops
exactly what it started and nothing of the test session (its local Ray included).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
# Requests go straight to 127.0.0.1, whatever proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 180.0, proc: subprocess.Popen | None = None,
              log: Path | None = None) -> None:
    """Wait until ``url`` answers 200; fail early, with the log's tail, when ``proc`` exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with _DIRECT.open(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}\n{tail}")
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process's group, SIGKILL to whatever of it is left after ``grace`` seconds."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def start_service(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | str | None = None,
                  die_with_parent: bool = False) -> subprocess.Popen:
    """``cmd`` in a session of its own, stdout and stderr to ``log``; with ``die_with_parent``
    it is killed when the calling thread dies (a benchmark's service, which no test sweep follows)."""
    preexec = None
    if die_with_parent:
        from crawl2chat.stages.lifetime import die_with_parent_preexec

        preexec = die_with_parent_preexec()
    out = open(log, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True, preexec_fn=preexec)
    finally:
        out.close()  # the child holds its own copy


def prefect_command(*args: str) -> list[str]:
    """The ``prefect`` command line of this interpreter's installation."""
    return [sys.executable, "-m", "prefect", *args]


def server_env(folder: Path) -> dict[str, str]:
    """This process's environment for a Prefect server and its clients under ``folder``
    (``folder/prefect-home``): no inherited service addresses, no usage reports, no scheduler
    (a test crossing 03:00 UTC must not start the daily refresh)."""
    (folder / "prefect-home").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env.update({"PREFECT_HOME": str(folder / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DO_NOT_TRACK": "1", "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"})
    return env


def start_prefect_server(env: dict[str, str], logs: Path, cwd: Path | str | None = None,
                         timeout: float = 240.0, die_with_parent: bool = False) -> tuple[subprocess.Popen, str]:
    """``prefect server start`` on a free port of 127.0.0.1; returns the process and its API URL."""
    port = free_port()
    log = logs / "prefect-server.log"
    # SQLite: a write waits up to 60 s for another (Prefect's 10 s gives "503 database is
    # locked" on a loaded 2-core machine), as the project's embedded server does.
    env = {"PREFECT_SERVER_DATABASE_TIMEOUT": "60", **env}
    proc = start_service(prefect_command("server", "start", "--host", "127.0.0.1", "--port", str(port)),
                         env, log, cwd, die_with_parent)
    api = f"http://127.0.0.1:{port}/api"
    try:
        wait_http(f"{api}/health", timeout, proc, log)
    except BaseException:
        stop_group(proc)
        raise
    return proc, api


def api_call(api: str, method: str, path: str, body: Any = None, timeout: float = 30.0, retries: int = 5) -> Any:
    """One JSON request to a REST API (the Prefect UI's calls); an HTTP error carries its body.
    A 503 (the server's database busy) is retried after 1, 2, 4, ... s, as Prefect's own client does."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(api + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    for attempt in range(retries + 1):
        try:
            with _DIRECT.open(request, timeout=timeout) as r:
                raw = r.read()
            break
        except urllib.error.HTTPError as e:
            if e.code == 503 and attempt < retries:
                time.sleep(2 ** attempt)
                continue
            raise AssertionError(f"{method} {path}: {e.code} {e.read()[:2000]!r}") from None
    return json.loads(raw) if raw else None


def tagged_processes(name: str, value: str) -> list[int]:
    """Pids of this user's processes whose environment holds ``name=value``.

    A test gives the services it starts a marker variable; every process they
    start inherits it, in whatever session, so this finds what they left behind.
    """
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or another user's
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_no_tagged_processes(name: str, value: str, timeout: float = 30.0) -> list[int]:
    """Wait for the tagged processes to exit; returns those still alive after ``timeout``."""
    deadline = time.time() + timeout
    while True:
        left = tagged_processes(name, value)
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A Ray cluster on 127.0.0.1 only. Ray takes a node address of 127.0.0.1 for "this
# machine" and swaps in the machine's outward address (its GCS, a driver's and a node's
# connections go there) unless its single-machine mode is on
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), which `ray start` refuses for a worker node.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # the head's and the drivers' environment


def ray_start(*args: str, worker_node: bool = False) -> list[str]:
    """A ``ray start`` command line; a worker node's resolves 127.0.0.1 to itself instead of
    the machine's outward address (the one address lookup Ray would make), so that it
    joins a head started with :data:`RAY_LOOPBACK_ENV` over the loopback interface."""
    if not worker_node:
        return [str(BIN / "ray"), "start", *args]
    wrapper = ("import sys, ray._private.services as s; "
               "s.node_ip_address_from_perspective = lambda *a, **k: '127.0.0.1'; "
               "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()")
    return [sys.executable, "-c", wrapper, "start", *args]


def outward_sockets(procs: list[subprocess.Popen]) -> list[tuple[str, str, str]]:
    """Sockets of the processes in these processes' groups bound or connected beyond the
    loopback interface: (process name, status, address)."""
    import ipaddress

    import psutil

    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback

    groups = {os.getpgid(p.pid) for p in procs if p.poll() is None}
    found = []
    for conn in psutil.net_connections(kind="inet"):
        try:
            if not conn.pid or os.getpgid(conn.pid) not in groups:
                continue
            name = psutil.Process(conn.pid).name()
        except (ProcessLookupError, psutil.Error):
            continue
        for end in (conn.laddr, conn.raddr):
            if end and not loopback(end.ip):
                found.append((name, conn.status, f"{end.ip}:{end.port}"))
    return found
