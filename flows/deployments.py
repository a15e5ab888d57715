"""The Prefect deployments of crawl2chat's flows, made from the training registry.

``prefect.yaml`` at the top of the repository is this module's output
(``python -m crawl2chat.flows.deployments > prefect.yaml``); a test keeps the two
equal, so a stage added to the registry gets its deployment in one step.
``crawl2chat serve-flows`` serves the same set without a work pool.
"""

from __future__ import annotations

import yaml

from crawl2chat.flows.automations import TAG
from crawl2chat.stages.training.registry import STAGES

WORK_POOL = {"name": "crawl2chat"}
REFRESH_CRON = "0 3 * * *"

HEADER = """\
# Prefect deployments of crawl2chat's flows, for a Prefect server with a process work pool:
#   prefect server start                                   # UI on http://127.0.0.1:4200
#   export PREFECT_API_URL=http://127.0.0.1:4200/api
#   prefect work-pool create crawl2chat --type process
#   prefect deploy --all && prefect worker start --pool crawl2chat
# (`crawl2chat serve-flows` serves the same flows without a work pool.)
# Made by `python -m crawl2chat.flows.deployments > prefect.yaml` from the training registry.
"""


def deployments() -> list[dict]:
    fixed = [
        {"name": "pipeline",
         "description": "Every stage end to end (crawl or WARC input, data stage, base model, SFT, reward model, PPO).",
         "entrypoint": "flows/pipeline.py:pipeline_flow"},
        {"name": "data-refresh",
         "description": "Re-crawl with conditional requests and add only new or changed pages, deduplicated "
                        "against every earlier version, as a new dataset version (old shards are never rewritten).",
         "entrypoint": "flows/data.py:data_flow", "parameters": {"refresh": True},
         "schedules": [{"cron": REFRESH_CRON, "timezone": "UTC"}]},
        {"name": "train",
         "description": "Every training stage from an existing dataset (base model, SFT, reward model, PPO).",
         "entrypoint": "flows/pipeline.py:train_flow"},
    ]
    stages = [{"name": s.name, "description": s.goal, "entrypoint": f"flows/pipeline.py:{s.name}_flow"}
              for s in STAGES.values()]
    return [{**d, "tags": [TAG], "work_pool": dict(WORK_POOL)} for d in fixed + stages]


def served(refresh_cron: str = REFRESH_CRON) -> list:
    """The deployments ``crawl2chat serve-flows`` serves: the same set as ``prefect.yaml``,
    without a work pool, the data refresh on ``refresh_cron`` in UTC; each tagged
    ``crawl2chat`` (:mod:`crawl2chat.flows.automations` watches the runs so tagged)."""
    from prefect.schedules import Cron

    from crawl2chat.flows import pipeline
    from crawl2chat.flows.data import data_flow

    return [
        pipeline.pipeline_flow.to_deployment(name="pipeline", tags=[TAG]),
        data_flow.to_deployment(name="data-refresh", schedule=Cron(refresh_cron, timezone="UTC"),
                                parameters={"refresh": True}, tags=[TAG]),
        pipeline.train_flow.to_deployment(name="train", tags=[TAG]),
        *(f.to_deployment(name=name, tags=[TAG]) for name, f in pipeline.STAGE_FLOWS.items()),
    ]


def in_work_pools(deployments: list) -> list[str]:
    """``flow/name`` of the served ``deployments`` the server already holds for a work pool
    (``prefect deploy`` of ``prefect.yaml``): serving would replace them with served ones that
    a worker can no longer run."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    taken = []
    with get_client(sync_client=True) as client:
        for d in deployments:
            try:
                existing = client.read_deployment_by_name(f"{d.flow_name}/{d.name}")
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                taken.append(f"{d.flow_name}/{d.name} (work pool {existing.work_pool_name})")
    return taken


def prefect_yaml() -> str:
    import prefect

    body = {"name": "crawl2chat", "prefect-version": prefect.__version__,
            "pull": [{"crawl2chat.infra.workdir.enter_workdir":
                      {"directory": "{{ $CRAWL2CHAT_WORKDIR }}"}}],
            "deployments": deployments()}
    return HEADER + "\n" + yaml.safe_dump(body, sort_keys=False, width=100)


if __name__ == "__main__":
    print(prefect_yaml(), end="")
