"""Walk the lineage of models and data through MLflow run tags.

Every stage run tags the runs whose outputs it consumed as
``crawl2chat.input.<role> = <run id>`` (role: data, base, sft, reward, policy, teacher, encoder),
so the chain data version -> tokenizer + base model -> SFT -> reward model ->
policy can be followed upstream (read a run's input tags) and downstream (search
for runs naming it as an input).
"""

from __future__ import annotations

import json

from pathlib import Path

import mlflow
from mlflow.entities import Run

from crawl2chat.stages.training.registry import STAGES

INPUT_PREFIX = "crawl2chat.input."
MODEL_PREFIX = "crawl2chat.input_model."  # the registered model version a stage read, beside its run
# Every role a run may name an input under: a dataset, each stage's input models and the
# folders its settings name (crawl2chat.stages.training.registry), and the policy.
ROLES = ("data", "policy", *sorted({i.model_role for s in STAGES.values() for i in s.inputs if i.model_role}
                                   | {role for s in STAGES.values() for _, role in s.folder_settings}))


def input_tags(**runs: str | None) -> dict[str, str]:
    """``input_tags(data=run_id)`` -> the tags a stage run carries for its inputs."""
    return {f"{INPUT_PREFIX}{role}": run_id for role, run_id in runs.items() if run_id}


def known_run(run_id: str | None) -> str | None:
    """``run_id`` when this tracking store holds that run (an input recorded in another store,
    such as a dataset built before ``MLFLOW_TRACKING_URI`` was set, is not linked)."""
    if not run_id:
        return None
    from mlflow.exceptions import MlflowException

    try:
        mlflow.MlflowClient().get_run(run_id)
    except MlflowException:
        return None
    return run_id


def model_input_tags(**stages: dict) -> dict[str, str]:
    """``model_input_tags(base=summary)`` -> run tags plus the model URI of each input model."""
    tags = input_tags(**{role: summary.get("run_id") for role, summary in stages.items()})
    tags.update({f"{MODEL_PREFIX}{role}": summary["model_uri"] for role, summary in stages.items()
                 if summary.get("model_uri")})
    return tags


def folder_input_tags(**folders: str) -> dict[str, str]:
    """Input tags for model folders given by path: the run that produced each, when
    this tracking store has it (a folder from elsewhere is simply not linked)."""
    tags = {}
    for role, folder in folders.items():
        try:
            run = resolve_run(str(folder))
        except Exception:  # noqa: BLE001 - an unknown folder has no lineage to record
            continue
        tags[f"{INPUT_PREFIX}{role}"] = run.info.run_id
    return tags


def recorded_store(ref: str) -> str | None:
    """The tracking URI a training stage recorded beside the model folder ``ref`` (its run
    folder's summary; an exported copy's source's), so a lineage is found from any folder."""
    from crawl2chat.infra.run_folders import DONE_FILE

    folder = Path(ref)
    try:
        if (folder / "export_report.json").exists():
            folder = Path(json.loads((folder / "export_report.json").read_text())["source"])
        uri = json.loads((folder.resolve().parent / DONE_FILE).read_text()).get("tracking_uri")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return uri if isinstance(uri, str) and "***" not in uri else None  # a masked password cannot be used


def resolve_run(ref: str) -> Run:
    """A run from a run id, a ``models:/name/version`` or ``models:/name@alias`` URI, or a model folder."""
    client = mlflow.MlflowClient()
    if ref.startswith("models:/"):
        name, _, rest = ref[len("models:/"):].partition("/")
        if "@" in name:
            name, alias = name.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            version = client.get_model_version(name, rest)
        return client.get_run(version.run_id)
    if Path(ref).exists():
        model_dir = str(Path(ref).resolve())
        exported = Path(ref) / "export_report.json"  # an exported copy: the run that made its source
        if exported.exists():
            try:
                model_dir = json.loads(exported.read_text())["source"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise LookupError(f"{exported} is unreadable ({type(e).__name__})") from None
        runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                  filter_string=f"tags.\"crawl2chat.model_dir\" = '{model_dir}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        if not runs:
            raise LookupError(f"no MLflow run produced the model folder {model_dir}")
        return runs[0]
    return client.get_run(ref)


def upstream(run: Run) -> list[tuple[str, Run]]:
    """(role, run) of every input of ``run``, nearest first, recursively; an input run this
    tracking store does not hold (recorded in another store) ends that branch."""
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient()
    chain, seen, frontier = [], {run.info.run_id}, [run]
    while frontier:
        current = frontier.pop(0)
        for key, value in sorted(current.data.tags.items()):
            if key.startswith(INPUT_PREFIX) and value not in seen:
                seen.add(value)
                try:
                    parent = client.get_run(value)
                except MlflowException:
                    continue
                chain.append((key[len(INPUT_PREFIX):], parent))
                frontier.append(parent)
    return chain


def downstream(run: Run) -> list[tuple[str, Run]]:
    """(role under which it was consumed, run) of every run built on ``run``, recursively."""
    chain, seen, frontier = [], {run.info.run_id}, [run.info.run_id]
    while frontier:
        current = frontier.pop(0)
        for role in ROLES:
            found = mlflow.search_runs(search_all_experiments=True, output_format="list",
                                       filter_string=f"tags.\"{INPUT_PREFIX}{role}\" = '{current}'")
            for child in found:
                if child.info.run_id not in seen:
                    seen.add(child.info.run_id)
                    chain.append((role, child))
                    frontier.append(child.info.run_id)
    return chain


def describe(run: Run) -> str:
    tags = run.data.tags
    stage = tags.get("crawl2chat.stage", run.info.run_name)
    data = " ".join(filter(None, (tags.get("crawl2chat.data_version"), tags.get("crawl2chat.data_digest"))))
    detail = tags.get("crawl2chat.model_dir") or data
    status = "" if run.info.status == "FINISHED" else f"  [{run.info.status}]"  # failed, killed, or still running
    return f"{stage:<9} run {run.info.run_id}  {detail}{status}".rstrip()


def format_lineage(ref: str) -> str:
    run = resolve_run(ref)
    lines = ["upstream (inputs, nearest first):"]
    lines += [f"  <- {role:<7} {describe(r)}" for role, r in upstream(run)] or ["  (none)"]
    lines += [f"this:           {describe(run)}", "downstream (built on it):"]
    lines += [f"  -> as {role:<6} {describe(r)}" for role, r in downstream(run)] or ["  (none)"]
    return "\n".join(lines)
