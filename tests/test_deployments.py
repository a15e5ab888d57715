"""prefect.yaml names real flows, and the data refresh carries its schedule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_every_deployment_entrypoint_is_a_flow():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = set()
    for deployment in spec["deployments"]:
        path, _, attr = deployment["entrypoint"].partition(":")
        module_spec = importlib.util.spec_from_file_location(f"entry_{attr}", ROOT / path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        flow = getattr(module, attr)
        assert hasattr(flow, "to_deployment"), f"{deployment['entrypoint']} is not a Prefect flow"
        # Typed parameters give the Prefect UI a form: the config is a pydantic model.
        schema = flow.parameters.model_dump()
        assert "config" in schema["properties"]
        # Every parameter a deployment sets is one the flow takes.
        assert set(deployment.get("parameters") or {}) <= set(schema["properties"]), deployment["name"]
        names.add(deployment["name"])
    assert {"pipeline", "data-refresh", "train", "pretrain"} <= names
    refresh = next(d for d in spec["deployments"] if d["name"] == "data-refresh")
    assert refresh["schedules"][0]["cron"]
    assert refresh["parameters"]["refresh"] is True
