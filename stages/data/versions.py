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
version's finished step folders. A build killed after that rename, before
``OUT/manifest.json`` followed, is completed by the next build.

Damaged data is found, not read: each manifest records every shard's size and
sha256. Readers (:func:`shard_files`, hence every training stage) check them and
stop with :class:`DamagedDataError`, one sentence naming the file; the next build
of the folder checks the current version the same way and rebuilds it from its
step folders when the damage is its own, and a ``manifest.json`` that no longer
parses is restored from ``versions/<name>/manifest.json`` once that version's
shards check out.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
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
    previous_superseded: list[str] = field(default_factory=list)  # their superseded-id files (no longer current)
    site_templates: dict[str, list[str]] = field(default_factory=dict)  # host -> template lines judged so far
    up_to_date: dict[str, Any] | None = None  # a committed manifest that already is this build


class DamagedDataError(ValueError):
    """A data folder's manifest or shard is not what was written; the message names the file."""


def _number(version: Any) -> int:
    match = _VERSION_RE.match(str(version or ""))
    return int(match.group(1)) if match else 0


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


def load_manifest(out_dir: str | os.PathLike, version: str | None = None) -> dict[str, Any] | None:
    """Like :func:`read_manifest`, but a manifest that exists and does not parse (or is not
    a manifest) raises :class:`DamagedDataError` naming it; None only when there is none."""
    path = Path(out_dir) / (f"{VERSIONS_DIR}/{version}/{MANIFEST}" if version else MANIFEST)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise DamagedDataError(f"{path} is unreadable ({type(e).__name__}: {e}; {len(text)} bytes)") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards", []), list):
        raise DamagedDataError(f"{path} is unreadable (not a dataset manifest)")
    return manifest


# sha256 checks already passed in this process: (path, size, mtime_ns) -> sha256
_checked: dict[tuple[str, int, int], str] = {}


def shard_damage(out_dir: str | os.PathLike, manifest: dict[str, Any]) -> tuple[str, str] | None:
    """``(version, sentence)`` for the first shard of ``manifest`` that is missing or whose
    size or sha256 differs from what the manifest recorded; None when all are intact.
    A file already checked unchanged (same size and modification time) in this process
    is not hashed again."""
    root = Path(out_dir)
    for shard in manifest.get("shards", []):
        path = root / shard["path"]
        version = str(shard.get("version") or manifest.get("version"))
        try:
            st = path.stat()
        except OSError:
            return version, f"{path} is missing (dataset version {version})"
        if "bytes" in shard and st.st_size != shard["bytes"]:
            return version, f"{path} has {st.st_size} bytes, {shard['bytes']} were written (dataset version {version})"
        if "sha256" in shard:
            key = (str(path), st.st_size, st.st_mtime_ns)
            if _checked.get(key) != shard["sha256"]:
                if sha256_file(path) != shard["sha256"]:
                    return version, f"{path} does not match the sha256 its manifest recorded (dataset version {version})"
                _checked[key] = shard["sha256"]
    return None


def restore_current(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The current manifest, made whole first when needed: when ``OUT/manifest.json``
    is unreadable or older than the newest committed version (a build killed between
    committing its version and naming it current), the newest version's manifest is
    checked (its shards' sizes and sha256) and written as the current one."""
    out = Path(out_dir)
    versions = committed_versions(out)
    try:
        current = load_manifest(out)
        problem = None
    except DamagedDataError as e:
        current, problem = None, str(e)
    if not versions or (current is not None and current.get("version") == versions[-1]):
        if problem:
            raise DamagedDataError(f"{problem}, and no committed version under {out / VERSIONS_DIR} can replace it")
        return current
    newest = load_manifest(out, versions[-1])
    if current is not None and _number(current.get("version")) > _number(versions[-1]):
        return current
    if problem:
        why = problem
    elif current is None:
        why = f"{out / MANIFEST} is missing"
    else:
        why = f"{out / MANIFEST} still names {current.get('version')}, not the committed {versions[-1]}"
    damage = shard_damage(out, newest)
    if damage:
        raise DamagedDataError(f"{why}, and {versions[-1]} cannot replace it: {damage[1]}")
    print(f"[data] {why}: restored from {out / VERSIONS_DIR / versions[-1] / MANIFEST}", flush=True)
    write_json_atomically(out / MANIFEST, newest)
    return newest


def file_identity(path: str, root: str | os.PathLike | None = None) -> list[Any]:
    """A file as a version remembers it: path and size (WARC files are never rewritten).
    A file inside ``root`` (the data folder: its crawl's WARC files) is named relative to
    it, so a data folder moved or copied elsewhere still knows which files it has read."""
    try:
        size = os.stat(path).st_size
    except OSError:  # remote (fsspec) paths are identified by name
        return [path, -1]
    if root is not None and Path(path).resolve().is_relative_to(Path(root).resolve()):
        path = Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    return [path, size]


def build_fingerprint(kind: str, base: str | None, files: Sequence[str], settings: dict[str, Any],
                      root: str | os.PathLike | None = None) -> str:
    blob = json.dumps([kind, base, [file_identity(f, root) for f in files], settings], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def plan_version(out_dir: str | os.PathLike, files: Sequence[str], settings: dict[str, Any], refresh: bool,
                 extra_index: Sequence[str] = ()) -> VersionPlan:
    """Decide what the next build does: nothing (already built), a refresh, or a full build.

    ``settings`` are the data settings that shape the output; a full build whose
    files and settings equal the current version's is already done.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        from crawl2chat.stages.settings import SettingsError

        raise SettingsError(f"data.out: {out} is a file, not a folder")
    current = restore_current(out)
    versions = committed_versions(out)
    name = version_name(int(versions[-1][1:]) + 1 if versions else 1)
    work = str(out / "work" / name)
    damage = shard_damage(out, current) if current and current.get("version") else None
    if damage and refresh:
        raise DamagedDataError(f"{damage[1]}; a refresh cannot extend a damaged version (build without refresh "
                               "to rebuild it, or restore the file)")
    if damage:
        fp = build_fingerprint("full", None, files, settings, out)
        if current.get("build_fingerprint") == fp and damage[0] == current["version"]:
            # This very build, damaged since: redo it under its own name, from its step folders.
            print(f"[data] {damage[1]}: rebuilding {current['version']}", flush=True)
            return VersionPlan(current["version"], str(out / "work" / current["version"]), list(files), False, fp,
                               previous_index=list(extra_index))
        current = None  # a full build stands alone: the damaged version is neither reused nor extended
    if refresh and current and current.get("version"):
        seen = {tuple(f) for f in current.get("input_files", [])}
        # (Older versions named every file by its absolute path.)
        new = [f for f in files if tuple(file_identity(f, out)) not in seen and tuple(file_identity(f)) not in seen]
        fp = build_fingerprint("refresh", current["version"], new, settings, out)
        previous = [str(out / p) for p in current.get("dedup_indexes", [])] + list(extra_index)
        shards = [str(out / s["path"]) for s in current.get("shards", [])]
        superseded = [str(out / p) for p in current.get("superseded", [])]
        return VersionPlan(name, work, new, True, fp, base=current, previous_index=previous,
                           previous_shards=shards, previous_superseded=superseded,
                           site_templates=load_site_templates(out, current), up_to_date=None if new else current)
    fp = build_fingerprint("full", None, files, settings, out)
    done = current if current and current.get("build_fingerprint") == fp else None
    return VersionPlan(name, work, list(files), False, fp, previous_index=list(extra_index), up_to_date=done)


SITE_TEMPLATES = "site_templates.json"  # beside a version's manifest: host -> template lines judged so far


def load_site_templates(out: Path, manifest: dict[str, Any]) -> dict[str, list[str]]:
    """The site template lines a version holds (:mod:`~crawl2chat.stages.data.templates`); {} when none."""
    path = manifest.get("site_templates")
    if not path:
        return {}
    try:
        return json.loads((out / path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DamagedDataError(f"{out / path} is unreadable ({type(e).__name__}); a refresh needs the site "
                               "template lines it holds (build without refresh to rebuild them)") from e


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_digest(shards: Sequence[dict[str, Any]], superseded: Sequence[str] = ()) -> str:
    """The digest of a version's content: of its shards' digests, in order, and of the
    superseded-id files readers skip (each written once, by the version it names), so
    that a refresh never re-reads the shards of earlier versions, and a refresh that
    only retired pages (a 404) still changes it."""
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(f"{shard['path']}:{shard['sha256']}\n".encode())
    for path in superseded:
        digest.update(f"superseded:{path}\n".encode())
    return "sha256:" + digest.hexdigest()


def remove_leftovers(out_dir: str | os.PathLike) -> list[str]:
    """Remove the temporary files and folders (``.*.tmp-*``) a killed build left in a
    data folder and its work folders; returns what was removed. Call it only while
    holding the folder's lock: then no live writer owns any of them."""
    out = Path(out_dir)
    removed = []
    for root in (out, *[p for p in (out / "work").rglob("*") if p.is_dir() and ".tmp-" not in p.name]):
        for leftover in sorted(root.glob(".*.tmp-*")):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(str(leftover.relative_to(out)))
    return removed


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

    files = shard_files(source)  # checks the manifest and the shards first
    skip = superseded_ids(source)
    for path in files:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        cols = [c for c in dict.fromkeys([*columns, "id", "drop_reason", "augmented_from"]) if c in names]
        for batch in pf.iter_batches(columns=cols, batch_size=1024):
            for row in batch.to_pylist():
                # A superseded document's augmented copies go with it.
                if row.get("drop_reason") or (skip and (row.get("id") in skip or row.get("augmented_from") in skip)):
                    continue
                yield {c: row.get(c) for c in columns}


def shard_files(source: str | os.PathLike, verify: bool = True) -> list[Path]:
    """Parquet shards of a data-stage output folder: those its current manifest names
    (every version of the chain), each checked against the size and sha256 the manifest
    recorded (:class:`DamagedDataError` names the first that differs, as it does an
    unreadable manifest), else ``DIR/shards/*.parquet`` or ``DIR/*.parquet``.
    ``verify=False`` lists them without reading them (a caller that only sizes them)."""
    src = Path(source)
    manifest = load_manifest(src) if src.is_dir() else None
    if manifest and manifest.get("shards") and all("path" in s for s in manifest["shards"]):
        files = [src / s["path"] for s in manifest["shards"]]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{src}/manifest.json names shards that are missing: {', '.join(missing[:3])}")
        damage = shard_damage(src, manifest) if verify else None
        if damage:
            raise DamagedDataError(damage[1])
        return files
    for pattern in ("shards/*.parquet", "*.parquet"):
        found = sorted(Path(p) for p in glob.glob(str(src / pattern)))
        if found:
            return found
    raise FileNotFoundError(f"no Parquet shards under {src}/shards/ or {src}/")
