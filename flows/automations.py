"""The Prefect automation that marks crawl2chat's silent flow runs ``Crashed``.

A flow run whose process dies outright (SIGKILL, a lost machine, the OOM killer)
cannot report its end, so the server shows it ``Running`` for ever. Served and
worker-run flows send heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``; 30 s under
``crawl2chat serve-flows``); this automation is Prefect's own remedy for runs whose
heartbeats stop (a proactive trigger on ``prefect.flow-run.heartbeat``, see
https://docs.prefect.io/v3/advanced/detect-zombie-flows), scoped to runs tagged
``crawl2chat`` so that other flows on a shared server are left alone.
``crawl2chat serve-flows`` creates or updates it on start;
``python -m crawl2chat.flows.automations [SECONDS]`` does it for the ``prefect.yaml``
work-pool path.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

TAG = "crawl2chat"  # every deployment of flows/deployments.py carries it; its runs inherit it
NAME = "crawl2chat: crash flow runs whose heartbeats stopped"
CRASH_AFTER_S = 90  # three missed heartbeats at the served runs' 30 s
PREFECT_MIN_WITHIN_S = 10  # Prefect's least window for a proactive trigger


def heartbeat_seconds() -> int | None:
    """The heartbeat period flow runs started from this environment use (None: no heartbeats)."""
    value = os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
    if not value:
        return None
    return max(int(value), 30)  # Prefect's own floor (flow_engine.MINIMUM_HEARTBEAT_INTERVAL)


def crash_after_problem(seconds: int) -> str | None:
    """Why ``seconds`` cannot be the window after which a silent run is marked crashed
    (0 means no automation); None when it can. A window no longer than two heartbeats
    would crash live runs whose beat came a little late."""
    if seconds == 0:
        return None
    beat = heartbeat_seconds()
    least = max(PREFECT_MIN_WITHIN_S, 2 * beat + 1 if beat else 0)
    if seconds < least:
        why = f"two heartbeats of {beat} s (PREFECT_FLOWS_HEARTBEAT_FREQUENCY)" if beat else "Prefect's least window"
        return f"must be 0 (no automation) or at least {least} s, more than {why}; got {seconds}"
    return None


def crash_automation(within_s: int):
    """The automation (not yet sent): a tagged flow run that sent a heartbeat and then
    neither another one nor a final state within ``within_s`` seconds is set ``Crashed``."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=NAME,
        description=(f"Sets Crashed on a flow run tagged '{TAG}' whose process stopped sending heartbeats "
                     f"for {within_s} s (killed, or its machine lost). Made by crawl2chat serve-flows."),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag",
                                                 "prefect.resource.id": f"prefect.tag.{TAG}"}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"No heartbeat for {within_s} s: the flow run's process was killed or its machine lost.")],
    )


def ensure_crash_automation(within_s: int = CRASH_AFTER_S) -> str:
    """Create the automation on the server ``PREFECT_API_URL`` names, or update the one of
    that name (one per server, whatever the number of ``serve-flows`` processes);
    returns its id."""
    from prefect.automations import Automation

    wanted = crash_automation(within_s)
    try:
        existing = Automation.read(name=NAME)
    except ValueError:  # none of that name yet
        return str(wanted.create().id)
    wanted.id = existing.id
    wanted.update()
    return str(existing.id)


if __name__ == "__main__":
    seconds = int(sys.argv[1]) if len(sys.argv) > 1 else CRASH_AFTER_S
    problem = crash_after_problem(seconds)
    if problem or seconds == 0:
        sys.exit(f"The window {problem}." if problem else "0 seconds: no automation made.")
    print(f"automation {ensure_crash_automation(seconds)}: '{NAME}' ({seconds} s)")
