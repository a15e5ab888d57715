"""Tokenise documents into packed token files for pretraining.

Output (``out_dir``):

* ``train.bin`` / ``val.bin`` — flat arrays of token ids, every document
  followed by ``<|endoftext|>``; uint16 when the vocabulary fits, else uint32.
  Training reads them through ``np.memmap`` so a corpus larger than memory
  costs nothing to open and any window is one slice.
* ``documents.parquet`` — one row per packed document: ``id``, ``key`` (the
  xxhash64 of the key it was split by), ``split``, ``group`` (its language, or
  source when the data stage balanced by source), ``weight`` (the data stage's
  ``sample_weight``) and its ``offset`` and ``tokens`` in its split's file.
  Training draws documents by weight from it (see
  :class:`~crawl2chat.stages.training.pretrain.TokenWindows`).
* ``index.json`` — dtype, vocabulary size, per split the token, document and
  UTF-8 byte counts, ``augmented_held_out`` (augmented rows of held-out
  documents, left out of both splits), the held-out ``split``
  (:class:`~crawl2chat.stages.training.heldout.HeldOutSplit`) and where the
  ``weights`` come from. Bytes are what turn a validation loss in nats per
  token into bits per byte, a figure comparable across tokenizers.
  ``index.json`` is written last: its presence marks a complete packing.

Parquet shards are tokenised in this process, file by file (the tokenizer's
``encode_batch`` already uses every core), or, on a Ray cluster (``RAY_ADDRESS``)
or for shards past ``PACK_LOCAL_MAX_MB``, by a Ray Data job (``map_batches`` over
record batches, one tokenizer per worker); both give the same files
(:func:`packs_on_ray`). Documents go to validation by a stable
hash of their id (or text, when there is no id), so the split never changes
when shards are re-packed or re-ordered; a corpus too small for the hash to pick
any document holds out its last whole documents instead. A plain text file is
one continuous document: its last ``val_fraction`` (cut at a line break) is
validation, as in nanoGPT's Tiny Shakespeare setup.

Weights: with the data stage's default ``balance.mode: weight`` each document
carries ``sample_weight`` (its group's target share over its current share),
packed as ``weight``. In ``sample`` mode the shards are already thinned to the
target mixture, so every weight is 1 (applying them again would overshoot);
``balance.by: none`` and data without the column also give 1.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from crawl2chat.stages.data.versions import read_manifest, shard_files, superseded_ids
from crawl2chat.stages.training.tokenizer import EOS_TOKEN, is_text_file

INDEX = "index.json"
DOCUMENTS = "documents.parquet"
# Shards up to this size are tokenised here: Ray's start (3-5 s) and its job's scheduling buy
# nothing on one machine, where the tokenizer's own threads keep every core busy.
PACK_LOCAL_MAX_MB = 1024.0


def packs_on_ray(source: str | os.PathLike, files: list[Path] | None = None) -> bool:
    """Whether packing ``source`` runs a Ray Data job: a data-stage folder on a Ray cluster
    (``RAY_ADDRESS``), or one whose shards (``files``, else listed here unread) exceed
    ``PACK_LOCAL_MAX_MB``; never a text file."""
    from crawl2chat.stages.data.engine import RAY, choose

    if is_text_file(source) or not Path(source).is_dir():
        return False
    if files is None:
        try:
            files = shard_files(source, verify=False)
        except (OSError, ValueError):
            return False
    return bool(files) and choose("auto", [str(f) for f in files], PACK_LOCAL_MAX_MB) == RAY


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_validation(key: str, val_fraction: float) -> bool:
    """Stable split: xxhash64 of the document key mapped to [0, 1)."""
    import xxhash

    return xxhash.xxh64_intdigest(key.encode("utf-8")) / 2.0**64 < val_fraction


def _documents_schema():
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("key", pa.string()), ("split", pa.string()), ("group", pa.string()),
                      ("weight", pa.float64()), ("offset", pa.int64()), ("tokens", pa.int64())])


def weight_policy(source: str | os.PathLike, columns: list[str]) -> dict[str, Any]:
    """Where training weights and groups come from for a shards folder: the data
    stage's ``sample_weight`` in ``weight`` mode, else 1 (see the module docstring)."""
    manifest = read_manifest(source) or {}
    balance = ((manifest.get("config") or {}).get("data") or {}).get("balance") or {}
    by, mode = balance.get("by", "lang"), balance.get("mode", "weight")
    group_column = "source" if by == "source" else "lang"
    if "sample_weight" not in columns:
        origin = "none: the shards carry no sample_weight"
    elif by == "none":
        origin = "none: balance.by is none"
    elif mode == "sample":
        origin = "none: balance.mode is sample, the shards already follow the target mixture"
    else:
        origin = "sample_weight"
    return {"origin": origin, "by": group_column if group_column in columns else None,
            "balance_mode": mode if manifest else None}


class _TokenizeBatch:
    """Ray Data callable: loads the tokenizer once per worker, then turns a
    record batch of documents into token arrays, split labels, byte counts,
    keys, groups and weights."""

    def __init__(self, tokenizer_file: str, val_fraction: float, group_column: str | None, use_weights: bool):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_file)
        self.eos = self.tok.token_to_id(EOS_TOKEN)
        self.val_fraction = val_fraction
        self.group_column, self.use_weights = group_column, use_weights

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from crawl2chat.stages.training.heldout import key_digest

        texts = [str(t) for t in batch["text"]]
        ids = [None if k is None else str(k) for k in batch["id"]] if "id" in batch else [None] * len(texts)
        sources = ([str(s) if s else None for s in batch["augmented_from"]] if "augmented_from" in batch
                   else [None] * len(texts))
        # An augmented row is split by the document it was made from.
        keys = [s if s else (i if i is not None else t) for s, i, t in zip(sources, ids, texts)]
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        tokens = [np.asarray(e.ids + [self.eos], dtype=np.int64) for e in encs]
        groups = ([str(g) if g else "unknown" for g in batch[self.group_column]] if self.group_column
                  else ["unknown"] * len(texts))
        weights = np.ones(len(texts), dtype=np.float64)
        if self.use_weights:
            raw = np.array([np.nan if w is None else float(w) for w in batch["sample_weight"]], dtype=np.float64)
            weights = np.where(np.isfinite(raw) & (raw > 0), raw, 1.0)
        return {
            "tokens": tokens,
            "val": np.array([is_validation(k, self.val_fraction) for k in keys]),
            "n_bytes": np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64),
            "id": np.array(["" if i is None else i for i in ids], dtype=object),
            "has_id": np.array([i is not None for i in ids]),
            "key": np.array([key_digest(k) for k in keys], dtype=object),
            "augmented": np.array([s is not None for s in sources]),
            "group": np.array(groups, dtype=object),
            "weight": weights,
        }


def _pack_text_file(path: Path, tokenizer_file: Path, val_fraction: float) -> tuple[dict, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    text = path.read_text(encoding="utf-8")
    cut = int(len(text) * (1 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    out = {}
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        lines = part.splitlines(keepends=True)
        ids = [i for enc in tok.encode_batch(lines, add_special_tokens=False) for i in enc.ids]
        ids.append(tok.token_to_id(EOS_TOKEN))
        out[split] = ([np.asarray(ids, dtype=np.int64)], 1, len(part.encode("utf-8")))
    return out, cut


def _hold_out_tail(out: Path, dtype: np.dtype, counts: dict, fraction: float) -> list[str]:
    """A corpus too small for the hash split to pick any validation document still
    gets a validation set: its last whole training documents, at least ``fraction``
    of the training tokens (at least one document stays in training). Returns the
    keys of the documents moved."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = pq.read_table(out / f"{DOCUMENTS}.tmp").to_pylist()
    train_tokens = counts["train"]["tokens"]
    moved, n = 0, 0
    for doc in reversed(docs[1:]):
        if moved >= fraction * train_tokens:
            break
        moved += doc["tokens"]
        n += 1
    cut_doc = len(docs) - n
    cut = docs[cut_doc]["offset"]
    train = np.fromfile(out / "train.bin.tmp", dtype=dtype)
    train[cut:].tofile(out / "val.bin.tmp")
    train[:cut].tofile(out / "train.bin.tmp")
    moved_bytes = sum(d["n_bytes"] for d in docs[cut_doc:])
    for d in docs[cut_doc:]:
        d["split"], d["offset"] = "val", d["offset"] - cut
    schema = _documents_schema().append(pa.field("n_bytes", pa.int64()))  # dropped by the caller
    pq.write_table(pa.Table.from_pylist(docs, schema=schema), out / f"{DOCUMENTS}.tmp")
    counts["val"] = {"tokens": len(train) - cut, "documents": n, "bytes": moved_bytes, "held_out_tail": True}
    counts["train"]["tokens"] = cut
    counts["train"]["documents"] -= n
    counts["train"]["bytes"] -= moved_bytes
    return [d["key"] for d in docs[cut_doc:]]


def _drop_training_copies(out: Path, dtype: np.dtype, counts: dict, moved: set[str]) -> int:
    """After a tail hold-out: training documents split by the same key as a moved one
    (the augmented copies of a document now held out) leave the training tokens.
    Returns how many were removed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = pq.read_table(out / f"{DOCUMENTS}.tmp").to_pylist()
    gone = [d for d in docs if d["split"] == "train" and d["key"] in moved]
    if not gone:
        return 0
    train = np.fromfile(out / "train.bin.tmp", dtype=dtype)
    kept, pieces, offset = [], [], 0
    for d in docs:
        if d["split"] == "train":
            if d["key"] in moved:
                counts["train"]["tokens"] -= d["tokens"]
                counts["train"]["documents"] -= 1
                counts["train"]["bytes"] -= d["n_bytes"]
                continue
            pieces.append(train[d["offset"]:d["offset"] + d["tokens"]])
            d["offset"] = offset
            offset += d["tokens"]
        kept.append(d)
    (np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)).astype(dtype).tofile(out / "train.bin.tmp")
    schema = _documents_schema().append(pa.field("n_bytes", pa.int64()))
    pq.write_table(pa.Table.from_pylist(kept, schema=schema), out / f"{DOCUMENTS}.tmp")
    return len(gone)


def pack_shards(
    source: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_fraction: float = 0.01,
    num_cpus: int | None = None,
) -> dict[str, Any]:
    """Pack ``source`` (a shards folder or a text file) into ``out_dir``; returns the index."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from crawl2chat.stages.training.heldout import HeldOutSplit

    source, out = Path(source), Path(out_dir)
    tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
    vocab_size = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)

    files = {s: open(out / f"{s}.bin.tmp", "wb") for s in ("train", "val")}
    counts = {s: {"tokens": 0, "documents": 0, "bytes": 0} for s in ("train", "val")}
    # The documents table keeps each document's byte count until the end (the tail
    # hold-out moves bytes with documents); it is dropped before the final write.
    schema = _documents_schema().append(pa.field("n_bytes", pa.int64()))
    doc_writer = pq.ParquetWriter(out / f"{DOCUMENTS}.tmp", schema)

    def write(split: str, arrays, n_docs: int, n_bytes: int) -> None:
        for a in arrays:
            files[split].write(np.asarray(a, dtype=dtype).tobytes())
            counts[split]["tokens"] += len(a)
        counts[split]["documents"] += n_docs
        counts[split]["bytes"] += n_bytes

    augmented_held_out = 0
    cut_chars, weights = None, {"origin": "none: a text file is one document", "by": None, "balance_mode": None}
    try:
        if is_text_file(source):
            parts, cut_chars = _pack_text_file(source, tokenizer_file, val_fraction)
            rows = []
            for split, (arrays, n_docs, n_bytes) in parts.items():
                rows.append({"id": None, "key": None, "split": split, "group": "unknown", "weight": 1.0,
                             "offset": counts[split]["tokens"], "tokens": sum(len(a) for a in arrays),
                             "n_bytes": n_bytes})
                write(split, arrays, n_docs, n_bytes)
            doc_writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        else:
            files_in = shard_files(source)
            weights = weight_policy(source, pq.ParquetFile(files_in[0]).schema_arrow.names)
            tokenize = _ray_tokenize if packs_on_ray(source, files_in) else _local_tokenize
            for batch in tokenize(files_in, tokenizer_file, val_fraction, num_cpus, superseded_ids(source),
                                  weights["by"], weights["origin"] == "sample_weight"):
                rows = {c: [] for c in schema.names}
                for i, (toks, val, nb) in enumerate(zip(batch["tokens"], batch["val"], batch["n_bytes"])):
                    if val and batch["augmented"][i]:
                        augmented_held_out += 1  # the copy of a held-out document: neither trained nor evaluated on
                        continue
                    split = "val" if val else "train"
                    rows["id"].append(str(batch["id"][i]) if batch["has_id"][i] else None)
                    rows["key"].append(str(batch["key"][i]))
                    rows["split"].append(split)
                    rows["group"].append(str(batch["group"][i]))
                    rows["weight"].append(float(batch["weight"][i]))
                    rows["offset"].append(counts[split]["tokens"])
                    rows["tokens"].append(len(toks))
                    rows["n_bytes"].append(int(nb))
                    write(split, [toks], 1, int(nb))
                doc_writer.write_table(pa.Table.from_pydict(rows, schema=schema))
    finally:
        for f in files.values():
            f.close()
        doc_writer.close()
    tail_keys: list[str] = []
    if counts["val"]["tokens"] == 0 and counts["train"]["documents"] > 1:
        tail_keys = _hold_out_tail(out, dtype, counts, max(val_fraction, 0.05))
        augmented_held_out += _drop_training_copies(out, dtype, counts, set(tail_keys))
    pq.write_table(pq.read_table(out / f"{DOCUMENTS}.tmp").drop(["n_bytes"]), out / f"{DOCUMENTS}.tmp")
    for s in files:
        os.replace(out / f"{s}.bin.tmp", out / f"{s}.bin")
    os.replace(out / f"{DOCUMENTS}.tmp", out / DOCUMENTS)
    if counts["train"]["tokens"] == 0 or counts["val"]["tokens"] == 0:
        raise ValueError(f"packing {source} left an empty split: {counts}; adjust val_fraction or add data")

    if cut_chars is not None:
        split = HeldOutSplit("text_tail", val_fraction, source=str(source.resolve()), cut_chars=cut_chars)
    else:
        split = HeldOutSplit("id_hash", val_fraction, source=str(source.resolve()), tail_keys=frozenset(tail_keys))
    index = {
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": Tokenizer.from_file(str(tokenizer_file)).token_to_id(EOS_TOKEN),
        "source": str(source),
        "tokenizer": str(Path(tokenizer_dir).resolve()),
        "val_fraction": val_fraction,
        "split": split.to_dict(),
        "weights": weights,
        "documents_file": DOCUMENTS,
        "augmented_held_out": augmented_held_out,
        **counts,
    }
    tmp = out / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, out / INDEX)
    return index


def _columns(files: list[Path], group_column: str | None, use_weights: bool) -> list[str]:
    """The shard columns packing reads (``augmented_from`` when any shard has it)."""
    import pyarrow.parquet as pq

    names = pq.ParquetFile(files[0]).schema_arrow.names
    if any("augmented_from" in pq.ParquetFile(f).schema_arrow.names for f in files):
        names = [*names, "augmented_from"]
    wanted = ["id", "text", "drop_reason", group_column, "sample_weight" if use_weights else None, "augmented_from"]
    return [c for c in dict.fromkeys(wanted) if c and c in names]


def _local_tokenize(files: list[Path], tokenizer_file: Path, val_fraction: float, num_cpus: int | None,  # noqa: ARG001
                    superseded: frozenset[str] = frozenset(), group_column: str | None = None,
                    use_weights: bool = False):
    """The documents :func:`_ray_tokenize` keeps, tokenised here, file by file, in order."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    columns = _columns(files, group_column, use_weights)
    tokenize = _TokenizeBatch(str(tokenizer_file), val_fraction, group_column, use_weights)
    gone = pa.array(sorted(superseded), pa.string())
    for f in files:
        present = set(pq.ParquetFile(f).schema_arrow.names)
        table = pq.read_table(f, columns=[c for c in columns if c in present])
        table = pa.table({c: table[c] if c in table.column_names else pa.nulls(table.num_rows, pa.string())
                          for c in columns})
        keep = pc.fill_null(pc.not_equal(table["text"], ""), False)  # a null text is left out too
        if "drop_reason" in columns:
            keep = pc.and_(keep, pc.fill_null(pc.equal(table["drop_reason"], ""), True))  # null: kept
        if superseded:
            keep = pc.and_(keep, pc.and_(pc.is_valid(table["id"]), pc.invert(pc.is_in(table["id"], value_set=gone))))
            if "augmented_from" in columns:  # a superseded document's augmented copies go with it
                keep = pc.and_(keep, pc.invert(pc.is_in(table["augmented_from"], value_set=gone)))
        for batch in table.filter(keep).to_batches(max_chunksize=1024):
            yield tokenize({c: batch.column(c).to_numpy(zero_copy_only=False) for c in columns})


def _ray_tokenize(files: list[Path], tokenizer_file: Path, val_fraction: float, num_cpus: int | None,
                  superseded: frozenset[str] = frozenset(), group_column: str | None = None,
                  use_weights: bool = False):
    import ray

    # The caller connects Ray (a local instance, or the cluster named by RAY_ADDRESS);
    # without one, Ray Data starts a local instance itself.
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # same files in, same bytes out
    ctx.enable_progress_bars = False

    columns = _columns(files, group_column, use_weights)
    ds = ray.data.read_parquet([str(f) for f in files]).select_columns(columns)
    from ray.data.expressions import col

    # Column expressions: Ray evaluates them on Arrow batches, without a Python call per row.
    if "drop_reason" in columns:
        ds = ds.filter(expr=col("drop_reason").is_null() | (col("drop_reason") == ""))
    if superseded:
        ds = ds.filter(expr=col("id").not_in(sorted(superseded)))
        if "augmented_from" in columns:  # a superseded document's augmented copies go with it
            ds = ds.filter(expr=col("augmented_from").is_null() | col("augmented_from").not_in(sorted(superseded)))
    ds = ds.filter(expr=col("text").is_not_null() & (col("text") != ""))
    with warnings.catch_warnings():
        # ``max_restarts`` has no named parameter yet and goes through the (deprecated)
        # remote-args keywords. No actor restarts: packing is rerun whole after a failure,
        # and a restartable actor whose constructor arguments sit in the object store
        # makes Ray's core worker print a warning on the terminal at every start.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        ds = ds.map_batches(
            _TokenizeBatch,
            fn_constructor_args=(str(tokenizer_file), val_fraction, group_column, use_weights),
            batch_format="numpy",
            batch_size=256,
            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, (num_cpus or os.cpu_count() or 1))),
            max_restarts=0,
        )
    yield from ds.iter_batches(batch_format="numpy", batch_size=1024)


def load_index(data_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(data_dir) / INDEX).read_text())


def open_tokens(data_dir: str | os.PathLike, split: str) -> np.memmap:
    index = load_index(data_dir)
    return np.memmap(Path(data_dir) / f"{split}.bin", dtype=np.dtype(index["dtype"]), mode="r")


def load_documents(data_dir: str | os.PathLike, split: str = "train") -> dict[str, np.ndarray] | None:
    """Offsets, token counts, weights and groups of one split's documents, or None
    for a packing made before documents were recorded."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    path = Path(data_dir) / DOCUMENTS
    if not path.exists():
        return None
    table = pq.read_table(path, columns=["split", "group", "weight", "offset", "tokens"])
    table = table.filter(pc.equal(table["split"], split))
    return {"offset": table["offset"].to_numpy(), "tokens": table["tokens"].to_numpy(),
            "weight": table["weight"].to_numpy(), "group": np.asarray(table["group"].to_pylist(), dtype=object)}
