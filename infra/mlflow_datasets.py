"""Datasets as MLflow dataset inputs: by digest and source, never by loading their rows.

A data-stage version is named ``<folder>@<version>`` with the first characters of
its content digest; a plain file (chat data, preference pairs, a text corpus)
with those of its sha256. The MLflow UI then shows, on each training run, which
dataset version it read, and runs that read the same data share the digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import warnings

from mlflow.data.dataset_source import DatasetSource
from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset

DIGEST_CHARS = 16


def _source(uri: str) -> DatasetSource:
    # MLflow registers a local-file source under two scheme names and warns that
    # it picked one; both are the same class.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return resolve_dataset_source(uri)


def dataset_entity(manifest: dict, out_dir: str) -> MetaDataset:
    """The dataset version a data-stage manifest describes."""
    digest = str(manifest.get("content_digest", "")).removeprefix("sha256:")
    name = f"{Path(out_dir).name}@{manifest.get('version', 'v0001')}"
    return MetaDataset(_source(str(Path(out_dir).resolve())), name=name,
                       digest=digest[:DIGEST_CHARS] or None)


def file_digest(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_dataset(path: str | Path, sha256: str | None = None) -> MetaDataset:
    """A data file (JSONL, Parquet, text) by its content digest (``sha256`` when already known)."""
    path = Path(path).resolve()
    return MetaDataset(_source(str(path)), name=path.name, digest=(sha256 or file_digest(path))[:DIGEST_CHARS])
