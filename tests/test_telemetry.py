"""Usage reporting is off at every entry point: importing the flows (what a Prefect
worker does), the command line and a stage script, each in a fresh interpreter with
none of the opt-outs set; the libraries' own checks then report telemetry off.
The compose services carry the same variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from crawl2chat.stages.telemetry import TELEMETRY_OPT_OUTS

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, sys
import {module}
from huggingface_hub import constants as hf
from mlflow.telemetry.utils import is_telemetry_disabled
from prefect._internal.analytics.enabled import is_telemetry_enabled
from prefect.settings import get_current_settings
from ray._common.usage.usage_lib import usage_stats_enabled
print(json.dumps({{
    "env": {{k: os.environ.get(k) for k in {names!r}}},
    "hf": hf.HF_HUB_DISABLE_TELEMETRY, "mlflow_off": is_telemetry_disabled(),
    "prefect_client_on": is_telemetry_enabled(),
    "prefect_server_on": get_current_settings().server.analytics_enabled,
    "ray_on": usage_stats_enabled(),
}}))
"""


def _probe(module: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TELEMETRY_OPT_OUTS}
    env.pop("CI", None)  # Prefect also stays quiet on CI; the opt-outs alone must do it here
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module=module, names=list(TELEMETRY_OPT_OUTS))],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_flows_turns_every_report_off():
    got = _probe("crawl2chat.flows.pipeline")
    assert got["env"] == TELEMETRY_OPT_OUTS
    assert got["hf"] is True and got["mlflow_off"] is True
    assert got["prefect_client_on"] is False and got["prefect_server_on"] is False
    assert got["ray_on"] is False


def test_command_line_and_stage_scripts_get_the_same_opt_outs():
    for module in ("crawl2chat.cli", "crawl2chat.stages.training.pretrain"):
        assert _probe(module)["env"] == TELEMETRY_OPT_OUTS, module


def test_compose_services_that_run_our_libraries_opt_out():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("mlflow", "prefect-server", "prefect-worker", "ray-head", "ray-worker"):
        env = services[name]["environment"]
        for key, value in TELEMETRY_OPT_OUTS.items():
            assert str(env.get(key)) == value, f"{name}: {key}={env.get(key)!r}"
