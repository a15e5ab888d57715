"""The one held-out split: decided when pretraining packs, used by everything after.

Packing (:mod:`~crawl2chat.stages.training.packing`) sends a document to
validation when ``xxhash64(id) / 2**64 < val_fraction`` (the text stands in for a
missing id). A corpus too small for the hash to pick any document moves its last
whole documents to validation instead; their keys are listed in the split. A plain
text file is split at a line break, its tail held out.

The split is written to the packed data's ``index.json`` and, as
``held_out_split.json``, into the base model's folder; every later stage copies
that file into its own model folder (:func:`~crawl2chat.stages.training.stage.save_model`).
So whoever holds a model knows which documents it never trained on:

* every evaluation (``crawl2chat eval``, the end-of-stage evaluations, the main
  job's summary) reads only held-out documents and names the split it used;
* every later stage that reads the shards (the SFT, preference and prompt sets
  derived from the corpus) leaves the held-out documents out.

An augmented row (the data stage's ``augment`` step) is split by the document it
was made from (``augmented_from``): packing and :func:`training_rows` leave out
the augmented copies of held-out documents, and evaluation reads original
documents only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

SPLIT_FILE = "held_out_split.json"
ALL = "all"  # no split: every document given is evaluated


def key_digest(key: str) -> str:
    """The xxhash64 of a document key in hex (how held-out tail documents are listed)."""
    import xxhash

    return xxhash.xxh64_hexdigest(key.encode("utf-8"))


def document_key(row: dict[str, Any]) -> str:
    """The key a document is split by (as packing does): the id of the document an
    augmented row was made from (``augmented_from``), else its id, else its text. An
    augmented copy is thus always on its source's side of the split."""
    if row.get("augmented_from"):
        return str(row["augmented_from"])
    return str(row["id"]) if row.get("id") is not None else str(row.get("text") or "")


@dataclass(frozen=True)
class HeldOutSplit:
    """Which documents a model never trained on.

    ``kind``: ``id_hash`` (shards: the id hash below ``val_fraction``, plus the
    documents listed in ``tail_keys``) or ``text_tail`` (a text file ``source``
    from character ``cut_chars`` on)."""

    kind: str
    val_fraction: float
    source: str | None = None
    tail_keys: frozenset[str] = field(default_factory=frozenset)
    cut_chars: int | None = None

    @property
    def name(self) -> str:
        if self.kind == "text_tail":
            return f"text_tail@{self.cut_chars}:{Path(self.source or '').name}"
        tail = f"+tail{len(self.tail_keys)}" if self.tail_keys else ""
        return f"xxh64(id)<{self.val_fraction:g}{tail}"

    def holds_out(self, key: str) -> bool:
        from crawl2chat.stages.training.packing import is_validation

        if self.kind != "id_hash":
            raise ValueError(f"split {self.name} is not a document split")
        return is_validation(key, self.val_fraction) or (bool(self.tail_keys) and key_digest(key) in self.tail_keys)

    def to_dict(self) -> dict[str, Any]:
        rule = ("xxhash64(id or text) / 2**64 < val_fraction, or xxhash64 hex listed in tail_keys"
                if self.kind == "id_hash" else "the text file from character cut_chars on")
        return {"name": self.name, "kind": self.kind, "rule": rule, "val_fraction": self.val_fraction,
                "source": self.source, "tail_keys": sorted(self.tail_keys), "cut_chars": self.cut_chars}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "split") -> "HeldOutSplit":
        try:
            kind = d["kind"]
            if kind not in ("id_hash", "text_tail"):
                raise ValueError(f"unknown kind {kind!r}")
            return cls(kind=kind, val_fraction=float(d["val_fraction"]), source=d.get("source"),
                       tail_keys=frozenset(d.get("tail_keys") or ()), cut_chars=d.get("cut_chars"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a held-out split record ({e})") from e


def write_split(split: HeldOutSplit | dict[str, Any], folder: str | os.PathLike) -> Path:
    payload = split.to_dict() if isinstance(split, HeldOutSplit) else split
    path = Path(folder) / SPLIT_FILE
    tmp = path.with_name(f".{SPLIT_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_split(folder: str | os.PathLike) -> HeldOutSplit | None:
    """The split recorded with a model folder (``held_out_split.json``) or a packed
    data folder (``index.json``); None when there is none."""
    folder = Path(folder)
    path = folder / SPLIT_FILE
    if path.is_file():
        return HeldOutSplit.from_dict(json.loads(path.read_text()), str(path))
    index = folder / "index.json"
    if index.is_file():
        record = json.loads(index.read_text()).get("split")
        if record:
            return HeldOutSplit.from_dict(record, f"{index} field 'split'")
    return None


def _same_file(a: str | os.PathLike | None, b: str | os.PathLike) -> bool:
    try:
        return a is not None and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def held_out_rows(split: HeldOutSplit | None, data: str | os.PathLike, columns: Sequence[str] = ("id", "text"),
                  max_docs: int | None = None) -> tuple[list[dict[str, Any]], str]:
    """The held-out documents of ``data`` (a shards folder or a text file) under
    ``split``, and the name of the split they come from.

    Without a split, or when ``data`` is not what the split was made on (a text
    file for a shards split, another file for a text-file split), every document
    of ``data`` is returned and the name says so (``all``)."""
    from crawl2chat.stages.data.versions import iter_documents

    data = Path(data)
    if not data.exists():
        raise FileNotFoundError(f"{data} does not exist")
    if data.is_file():
        text = data.read_text(encoding="utf-8")
        if split is not None and split.kind == "text_tail" and _same_file(split.source, data):
            return [{"id": None, "text": text[split.cut_chars:]}], split.name
        return [{"id": None, "text": text}], ALL
    cols = list(dict.fromkeys([*columns, "id", "text", "augmented_from"]))
    rows: list[dict[str, Any]] = []
    use_split = split is not None and split.kind == "id_hash"
    for row in iter_documents(data, cols):
        if not row.get("text") or row.get("augmented_from"):  # evaluation reads original documents only
            continue
        if use_split and not split.holds_out(document_key(row)):
            continue
        rows.append(row)
        if max_docs is not None and len(rows) >= max_docs:
            break
    if use_split and not rows:
        raise ValueError(f"no document of {data} is held out by the split {split.name}; "
                         f"evaluate on other data or with the split 'all'")
    return rows, split.name if use_split else ALL


def training_rows(split: HeldOutSplit | None, data: str | os.PathLike,
                  columns: Sequence[str]) -> Iterator[dict[str, Any]]:
    """The documents of a shards folder that are not held out (all of them without a split)."""
    from crawl2chat.stages.data.versions import iter_documents

    cols = list(dict.fromkeys([*columns, "id", "text", "augmented_from"]))
    use_split = split is not None and split.kind == "id_hash"
    for row in iter_documents(data, cols):
        if use_split and split.holds_out(document_key(row)):  # an augmented copy goes with its source
            continue
        yield row
