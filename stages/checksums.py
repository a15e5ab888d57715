"""Sizes and sha256 of a folder's files, written after the folder and checked before it is trusted.

A checkpoint or a model folder is written, then ``checksums.json`` is written
into it (atomically) listing every file with its size and sha256, and only then
is the folder renamed into place. Before a resume loads it,
:func:`folder_damage` compares the files with the list: a truncated, missing or
altered file is reported by name instead of being loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CHECKSUMS = "checksums.json"


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_checksums(folder: str | os.PathLike) -> dict:
    """List every file under ``folder`` (but the list itself) with size and sha256."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != CHECKSUMS and not p.name.startswith(f".{CHECKSUMS}"):
            files[p.relative_to(folder).as_posix()] = {"size": p.stat().st_size, "sha256": file_sha256(p)}
    payload = {"files": files}
    tmp = folder / f".{CHECKSUMS}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / CHECKSUMS)
    return payload


def folder_damage(folder: str | os.PathLike, required: bool = False) -> str | None:
    """None when every file listed in ``folder/checksums.json`` is there with its size
    and sha256; otherwise one sentence naming the first damaged file. A folder
    without the list passes unless ``required`` (folders written before lists
    existed)."""
    folder = Path(folder)
    try:
        listed = json.loads((folder / CHECKSUMS).read_text())["files"]
    except FileNotFoundError:
        return f"{folder / CHECKSUMS} is missing" if required else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{folder / CHECKSUMS} is unreadable ({type(e).__name__})"
    for name, want in listed.items():
        p = folder / name
        try:
            size = p.stat().st_size
        except OSError:
            return f"{p} is missing"
        if size != want["size"]:
            return f"{p} has {size} bytes, {want['size']} were written"
        if file_sha256(p) != want["sha256"]:
            return f"{p} does not match its sha256"
    return None
