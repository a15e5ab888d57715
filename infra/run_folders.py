"""Training run folders keyed by what they were trained from.

A stage's run lives in ``OUT/<key>/``, the key being a digest of the stage, its
inputs' identities (:func:`input_identity`) and its settings: the same inputs and
settings find the same folder (resume, or reuse when finished and recorded),
changed data or settings start a new folder beside the old one, and ``OUT/model``
links to the newest finished run's model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import mlflow

from crawl2chat.infra.mlflow_datasets import file_digest
from crawl2chat.stages.data.versions import read_manifest
from crawl2chat.stages.secrets import mask_secrets

RUN_FILE = "run.json"  # in a run folder: the stage, its key, inputs and settings
DONE_FILE = "summary.json"  # in a finished run folder: the summary and its MLflow run


def input_identity(path: str) -> str:
    """What a stage input is, independent of where it lies: a dataset version by its
    content digest, a model folder by the key of the run that made it (else by its
    files), a data file by its sha256."""
    p = Path(path).resolve()
    if p.is_dir():
        manifest = read_manifest(p)
        if manifest:
            return manifest.get("content_digest", "")
        run_file = p.parent / RUN_FILE
        if run_file.exists():
            return "run:" + json.loads(run_file.read_text())["key"]
        digest = hashlib.sha256()
        for f in sorted(p.glob("*")):
            if f.is_file() and f.suffix in (".safetensors", ".json"):
                digest.update(f.name.encode() + b"\0" + file_digest(f).encode())
        return "files:" + digest.hexdigest()
    return "sha256:" + file_digest(p)


def run_folder(out: str | Path, stage: str, inputs: dict[str, str], identities: dict[str, str],
               settings: dict[str, Any], launch: dict[str, Any] | None = None) -> Path:
    """``OUT/<key>``: the run folder of this stage on these inputs (by their
    :func:`input_identity`) with these settings, launched so (``launch``: the process
    count, machines and Accelerate config, when not one plain process: they change the
    batches each rank sees and the checkpoints' format).

    Changed data or settings give a new key, so a new run starts beside the old
    one; the same key resumes (or, finished, reuses) the run. ``OUT/model`` links
    to the newest finished run's model.
    """
    parts = [stage, identities, settings] + ([launch] if launch else [])
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]
    run_dir = Path(out).resolve() / key
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / RUN_FILE).exists():
        payload = {"stage": stage, "key": key, "inputs": inputs, "identities": identities,
                   "settings": mask_secrets(settings), "launch": launch or {}}
        tmp = run_dir / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(payload, indent=2, default=str))
        os.replace(tmp, run_dir / RUN_FILE)
    return run_dir


def link_latest(out: str | Path, run_dir: Path) -> None:
    """Point ``OUT/model`` (and ``OUT/latest``) at a finished run, atomically."""
    for name, target in (("latest", run_dir.name), ("model", f"{run_dir.name}/model")):
        link = Path(out) / name
        if link.exists() and not link.is_symlink():
            continue  # a folder a user put there is left alone
        tmp = Path(out) / f".{name}.link-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)


def recorded_run(run_dir: Path) -> dict | None:
    """The summary of a run folder already trained and recorded in this tracking store."""
    try:
        done = json.loads((run_dir / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    # Compared as recorded: a summary may hold the store's address with its password masked.
    if mask_secrets(done.get("tracking_uri")) != mask_secrets(mlflow.get_tracking_uri()):
        return None
    try:
        mlflow.MlflowClient().get_run(done["run_id"])
    except Exception:  # noqa: BLE001 - a run deleted from the store is recorded again
        return None
    return done
