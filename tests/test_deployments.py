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


def test_prefect_yaml_is_made_from_the_training_registry():
    from crawl2chat.flows.deployments import prefect_yaml

    assert (ROOT / "prefect.yaml").read_text() == prefect_yaml(), \
        "prefect.yaml is stale: python -m crawl2chat.flows.deployments > prefect.yaml"


def test_serve_flows_serves_the_same_deployments_with_the_refresh_in_utc():
    """``crawl2chat serve-flows``' deployments: prefect.yaml's names and parameters, the data
    refresh on the cron given, in UTC as prefect.yaml's (its help says UTC)."""
    from crawl2chat.flows.deployments import deployments, served

    built = {d.name: d for d in served("0 4 * * *")}
    assert set(built) == {d["name"] for d in deployments()}
    (schedule,) = built["data-refresh"].schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 4 * * *", "UTC")
    assert built["data-refresh"].parameters == {"refresh": True}
    # Tagged, as prefect.yaml's: the crash automation watches the runs so tagged.
    assert all(d.tags == ["crawl2chat"] for d in built.values())
    assert all(d["tags"] == ["crawl2chat"] for d in deployments())


def test_every_registered_stage_has_settings_a_flow_and_a_command():
    from typer.main import get_command

    from crawl2chat.cli import app
    from crawl2chat.flows.pipeline import STAGE_FLOWS
    from crawl2chat.stages.settings import Config
    from crawl2chat.stages.training.registry import STAGES

    commands = get_command(app).commands
    for name, stage in STAGES.items():
        section = getattr(Config(), name)
        assert section.registered_name == stage.registered_name
        flow_params = set(STAGE_FLOWS[name].parameters.model_dump()["properties"])
        assert flow_params == {"config", *stage.input_names}
        options = {o for p in commands[name].params for o in p.opts}
        assert {f"--{i}" for i in stage.input_names} <= options
        assert importlib.util.find_spec(stage.module) is not None
