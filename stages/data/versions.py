"""Versions of a data-stage output folder.

A data-stage folder holds a chain of immutable dataset versions::

    OUT/manifest.json                     the current version (what readers use)
    OUT/shards/v0002-shard-00000.parquet  every version's shards, never rewritten
    OUT/rejected/v0002-rejected-00000.parquet
    OUT/versions/v0002/manifest.json      each version's manifest, kept for lineage
    OUT/versions/v0002/dedup_index/       the dedup keys of the documents it added
    OUT/work/v0002/<step>/                the version's step folders (resumable)

A full build reads every input file and starts a new chain. A refresh reads only
the input files no version of the chain has read yet (a re-crawl's new WARC files
hold only new and changed pages; unchanged ones are revisit records), drops the
records an earlier version already holds (a document id is never in two versions'
shards), deduplicates the rest against the dedup index of every earlier version,
and commits a version whose manifest lists the earlier shards plus its own. A
version is committed when its manifest is renamed into ``versions/<name>/``; a
killed build leaves at most files no manifest names, and the rerun reuses the
version's finished step folders.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

MANIFEST = "manifest.json"
VERSIONS_DIR = "versions"
_VERSION_RE = re.compile(r"^v(\d{4,})$")


@dataclass
class VersionPlan:
    """What the next build of a data folder does."""

    name: str  # e.g. "v0003"
    work_dir: str  # OUT/work/<name>
    files: list[str]  # the input files this version reads
    refresh: bool
    fingerprint: str  # inputs + settings of this build
    base: dict[str, Any] | None = None  # the manifest this version extends (refresh)
    previous_index: list[str] = field(default_factory=list)  # dedup indexes to deduplicate against
    previous_shards: list[str] = field(default_factory=list)  # shards whose ids this version must not repeat
    up_to_date: dict[str, Any] | None = None  # a committed manifest that already is this build


def version_name(number: int) -> str:
    return f"v{number:04d}"


def committed_versions(out_dir: str | os.PathLike) -> list[str]:
    """Names of the committed versions of a data folder, oldest first."""
    root = Path(out_dir) / VERSIONS_DIR
    names = [p.parent.name for p in root.glob(f"*/{MANIFEST}") if _VERSION_RE.match(p.parent.name)]
    return sorted(names, key=lambda n: int(n[1:]))


def read_manifest(out_dir: str | os.PathLike, version: str | None = None) -> dict[str, Any] | None:
    """The current manifest of a data folder, or that of one version."""
    path = Path(out_dir) / (f"{VERSIONS_DIR}/{version}/{MANIFEST}" if version else MANIFEST)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def file_identity(path: str) -> list[Any]:
    """A file as a version remembers it: path and size (WARC files are never rewritten)."""
    try:
        return [path, os.stat(path).st_size]
    except OSError:  # remote (fsspec) paths are identified by name
        return [path, -1]


def build_fingerprint(kind: str, base: str | None, files: Sequence[str], settings: dict[str, Any]) -> str:
    blob = json.dumps([kind, base, [file_identity(f) for f in files], settings], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def plan_version(out_dir: str | os.PathLike, files: Sequence[str], settings: dict[str, Any], refresh: bool,
                 extra_index: Sequence[str] = ()) -> VersionPlan:
    """Decide what the next build does: nothing (already built), a refresh, or a full build.

    ``settings`` are the data settings that shape the output; a full build whose
    files and settings equal the current version's is already done.
    """
    out = Path(out_dir)
    current = read_manifest(out)
    versions = committed_versions(out)
    name = version_name(int(versions[-1][1:]) + 1 if versions else 1)
    work = str(out / "work" / name)
    if refresh and current and current.get("version"):
        seen = {tuple(f) for f in current.get("input_files", [])}
        new = [f for f in files if tuple(file_identity(f)) not in seen]
        fp = build_fingerprint("refresh", current["version"], new, settings)
        previous = [str(out / p) for p in current.get("dedup_indexes", [])] + list(extra_index)
        shards = [str(out / s["path"]) for s in current.get("shards", [])]
        return VersionPlan(name, work, new, True, fp, base=current, previous_index=previous,
                           previous_shards=shards, up_to_date=None if new else current)
    fp = build_fingerprint("full", None, files, settings)
    done = current if current and current.get("build_fingerprint") == fp else None
    return VersionPlan(name, work, list(files), False, fp, previous_index=list(extra_index), up_to_date=done)


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_digest(shards: Sequence[dict[str, Any]]) -> str:
    """The digest of a version's content: of its shards' digests, in order, so that
    a refresh never re-reads the shards of earlier versions."""
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(f"{shard['path']}:{shard['sha256']}\n".encode())
    return "sha256:" + digest.hexdigest()


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)


def superseded_ids(source: str | os.PathLike, manifest: dict[str, Any] | None = None) -> frozenset[str]:
    """Ids of documents in a data folder's shards whose page a later version replaced
    (a refresh that kept a changed page); readers skip them. ``manifest``: the
    version to read them for (default: the folder's current one)."""
    src = Path(source)
    if manifest is None:
        manifest = read_manifest(src) if src.is_dir() else None
    files = [src / f for f in (manifest or {}).get("superseded", [])]
    if not files:
        return frozenset()
    import pyarrow.parquet as pq

    return frozenset(pq.read_table(files, columns=["id"])["id"].to_pylist())


def iter_documents(source: str | os.PathLike, columns: Sequence[str]) -> Iterator[dict[str, Any]]:
    """Rows (the given columns) of the documents a data folder's current version holds:
    its shards in order, without dropped or superseded documents."""
    import pyarrow.parquet as pq

    skip = superseded_ids(source)
    for path in shard_files(source):
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        cols = [c for c in dict.fromkeys([*columns, "id", "drop_reason"]) if c in names]
        for batch in pf.iter_batches(columns=cols, batch_size=1024):
            for row in batch.to_pylist():
                if row.get("drop_reason") or (skip and row.get("id") in skip):
                    continue
                yield {c: row.get(c) for c in columns}


def shard_files(source: str | os.PathLike) -> list[Path]:
    """Parquet shards of a data-stage output folder: those its current manifest names
    (every version of the chain), else ``DIR/shards/*.parquet`` or ``DIR/*.parquet``."""
    src = Path(source)
    manifest = read_manifest(src)
    if manifest and manifest.get("shards") and all("path" in s for s in manifest["shards"]):
        files = [src / s["path"] for s in manifest["shards"]]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{src}/manifest.json names shards that are missing: {', '.join(missing[:3])}")
        return files
    for pattern in ("shards/*.parquet", "*.parquet"):
        found = sorted(Path(p) for p in glob.glob(str(src / pattern)))
        if found:
            return found
    raise FileNotFoundError(f"no Parquet shards under {src}/shards/ or {src}/")
