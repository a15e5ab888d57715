"""The command's own temporary Prefect API: started early in the background, answered
before a flow runs, stopped with the command; a new project folder starts from the
migrated database template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

COMMAND = textwrap.dedent("""
    import json, os, sys, time
    from crawl2chat.infra.prefect_runtime import (configure_prefect_env, flow_settings, start_embedded_api,
                                                 wait_for_embedded_api)
    configure_prefect_env(sys.argv[1])
    start_embedded_api(sys.argv[1])
    url = os.environ["PREFECT_API_URL"]
    from prefect import flow, task
    from prefect.settings import get_current_settings

    heartbeats = []

    @task(name="probe-step")
    def step() -> int:
        return 7

    @flow(name="probe")
    def probe() -> int:
        heartbeats.append(get_current_settings().flows.heartbeat_frequency)  # what the flow engine reads
        return step()

    done = []
    # Work done while the server does not answer yet; one failing item does not stop the rest.
    wait_for_embedded_api(meanwhile=[lambda: 1 / 0, lambda: done.append(bool(__import__("trafilatura")))])
    server = __import__("crawl2chat.infra.prefect_runtime", fromlist=["_EmbeddedAPI"])._EmbeddedAPI.process.pid
    with flow_settings():  # as the CLI runs its flows
        result = probe()
    import httpx
    settings = httpx.get(f"{url}/admin/settings").json()  # the server's own settings
    print(json.dumps({"url": url, "result": result, "server": server, "heartbeats": heartbeats,
                      "triggers": settings["server"]["services"]["triggers"]["enabled"],
                      "server_imported": "prefect.server.api.server" in sys.modules, "meanwhile": done}),
          flush=True)
""")


def run_command(home, cache) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    env["XDG_CACHE_HOME"] = str(cache)
    proc = subprocess.run([sys.executable, "-c", COMMAND, str(home)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_flows_run_against_the_commands_own_server_and_new_folders_start_from_the_template(tmp_path):
    import psutil

    cache = tmp_path / "cache"
    first = run_command(tmp_path / "one", cache)
    assert first["result"] == 7 and first["url"].startswith("http://127.0.0.1:")
    assert first["heartbeats"] == [None]  # no heartbeat thread to wait for at the flow run's end
    assert first["triggers"] is False  # no automation services on the command's own server
    assert not first["server_imported"]  # the command never loads Prefect's server package
    assert first["meanwhile"] == [True]  # done while the server came up, past a failing item
    assert not psutil.pid_exists(first["server"])  # stopped with the command
    assert (tmp_path / "one" / "prefect" / "prefect.db").is_file()
    templates = list((cache / "crawl2chat").glob("prefect-*.db"))
    assert len(templates) == 1

    # A second new folder starts from a copy of the template (marked here) and runs its flow there.
    import sqlite3

    con = sqlite3.connect(templates[0])
    assert con.execute("pragma journal_mode").fetchone()[0] == "delete"  # one self-contained file
    con.execute("create table template_mark (x int)")
    con.commit()
    con.close()
    second = run_command(tmp_path / "two", cache)
    assert second["result"] == 7
    con = sqlite3.connect(tmp_path / "two" / "prefect" / "prefect.db")
    tables = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
    flows = [r[0] for r in con.execute("select name from flow")]
    task_runs = [r[0] for r in con.execute("select state_type from task_run")]
    con.close()
    assert "template_mark" in tables and flows == ["probe"]
    assert task_runs == ["COMPLETED"]  # the task run's events reached the server's recorder before it stopped
    assert list((tmp_path / "two" / "prefect").glob(".prefect.db.tmp-*")) == []


def test_flows_against_a_configured_server_keep_prefects_heartbeats():
    """With no temporary server of the command's own (``PREFECT_API_URL`` names the user's
    server), flow runs send heartbeats as Prefect's settings say: automations there may watch them."""
    from prefect.settings import get_current_settings

    from crawl2chat.infra.prefect_runtime import _EmbeddedAPI, flow_settings

    assert _EmbeddedAPI.process is None
    before = get_current_settings().flows.heartbeat_frequency
    with flow_settings():
        assert get_current_settings().flows.heartbeat_frequency == before
    assert before is not None
