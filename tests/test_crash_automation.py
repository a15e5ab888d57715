"""A served flow run whose process is killed outright is marked ``Crashed`` by the server.

``prefect server start`` on 127.0.0.1 and ``crawl2chat serve-flows`` against it, as the
README runs them: the command creates the crash automation (once, however often it
starts), a data-refresh run is started the way the UI's Run button starts it, its
crawl held on a loopback site that does not answer, and the whole ``serve-flows``
process group is SIGKILLed. The server then sets the run ``Crashed`` from the
missing heartbeats; a flow run of another, untagged flow that also fell silent is
left as it was.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from live_services import (
    BIN,
    api_call,
    kill_pids,
    server_env,
    signal_group,
    start_prefect_server,
    start_service,
    stop_group,
    wait_no_tagged_processes,
)

from crawl2chat.flows.automations import NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TAG = "CRAWL2CHAT_CRASH_AUTOMATION"  # marker variable of serve-flows and everything it starts


def _silent_site() -> tuple[ThreadingHTTPServer, threading.Event]:
    """A site on 127.0.0.1 that holds every request until released (a crawl that waits)."""
    release = threading.Event()

    class Hold(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            release.wait(120)
            self.send_error(503)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hold)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, release


def _automations(api: str) -> list[dict]:
    return [a for a in api_call(api, "POST", "/automations/filter", {}) if a["name"] == NAME]


def _wait(what: str, check, timeout: float, every: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _heartbeats(api: str, flow_run_id: str) -> list:
    body = {"filter": {"event": {"name": ["prefect.flow-run.heartbeat"]},
                       "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}}, "limit": 10}
    return api_call(api, "POST", "/events/filter", body)["events"]


def test_a_killed_served_run_is_marked_crashed(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    tag = secrets.token_hex(8)
    env = server_env(tmp_path)
    server, api = start_prefect_server(env, logs, cwd=tmp_path)
    site, release = _silent_site()
    serving = None
    try:
        env.update(PREFECT_API_URL=api, **{TAG: tag})
        env.pop("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)
        serving = start_service([str(BIN / "crawl2chat"), "serve-flows"], env, logs / "serve-flows.log",
                                cwd=tmp_path)

        def deployment():
            found = api_call(api, "POST", "/deployments/filter", {"deployments": {"name": {"any_": ["data-refresh"]}}})
            return found[0] if found else None

        refresh = _wait("serve-flows' deployments", deployment, 240, every=1)
        assert refresh["tags"] == ["crawl2chat"]
        (made,) = _automations(api)
        assert made["trigger"]["posture"] == "Proactive" and made["trigger"]["within"] == 90
        assert made["actions"] == [{**made["actions"][0], "type": "change-flow-run-state", "state": "CRASHED"}]

        # A shorter window for the test, through the module the work-pool path runs: the
        # automation of that name is updated, not made twice.
        out = subprocess.run([sys.executable, "-m", "crawl2chat.flows.automations", "10"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        (updated,) = _automations(api)
        assert updated["id"] == made["id"] and updated["trigger"]["within"] == 10

        # Another team's flow run on the same server: silent too, but not tagged crawl2chat.
        other_flow = api_call(api, "POST", "/flows/", {"name": "another-team"})
        other = api_call(api, "POST", "/flow_runs/", {"flow_id": other_flow["id"], "state": {"type": "RUNNING"}})
        api_call(api, "POST", "/events", [{
            "id": str(uuid.uuid4()), "occurred": datetime.now(timezone.utc).isoformat(),
            "event": "prefect.flow-run.heartbeat",
            "resource": {"prefect.resource.id": f"prefect.flow-run.{other['id']}"}}])

        site_url = f"http://127.0.0.1:{site.server_address[1]}/"
        run = api_call(api, "POST", f"/deployments/{refresh['id']}/create_flow_run",
                       {"parameters": {"config": {"data": {"seed_urls": [site_url]}}}})
        _wait("the served run's first heartbeat", lambda: _heartbeats(api, run["id"]), 240)
        assert api_call(api, "GET", f"/flow_runs/{run['id']}")["state_type"] == "RUNNING"

        signal_group(serving, signal.SIGKILL)  # serve-flows and the run's process, at once
        serving.wait(timeout=30)
        assert wait_no_tagged_processes(TAG, tag) == []

        def crashed():
            state = api_call(api, "GET", f"/flow_runs/{run['id']}")["state"]
            return state if state["type"] == "CRASHED" else None

        state = _wait("the killed run to be marked Crashed", crashed, 120, every=1)
        assert "heartbeat" in state["message"]
        time.sleep(6)  # another sweep of the proactive triggers (every 5 s), for the untagged run
        assert api_call(api, "GET", f"/flow_runs/{other['id']}")["state_type"] == "RUNNING"
    finally:
        release.set()
        site.shutdown()
        if serving is not None:
            stop_group(serving)
        stop_group(server)
        kill_pids(wait_no_tagged_processes(TAG, tag, timeout=10))


def test_serve_flows_refuses_a_window_that_would_crash_live_runs(tmp_path):
    """A window of two heartbeats or less is refused before anything is served."""
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30")
    out = subprocess.run([str(BIN / "crawl2chat"), "serve-flows", "--crash-after", "45"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --crash-after must be 0 (no automation) or at least 61 s, more than two heartbeats of 30 s "
        "(PREFECT_FLOWS_HEARTBEAT_FREQUENCY); got 45.")
