"""Tokenise documents into packed token files for pretraining.

Output (``out_dir``):

* ``train.bin`` / ``val.bin`` — flat arrays of token ids, every document
  followed by ``<|endoftext|>``; uint16 when the vocabulary fits, else uint32.
  Training reads them through ``np.memmap`` so a corpus larger than memory
  costs nothing to open and any window is one slice.
* ``index.json`` — dtype, vocabulary size, and per split the token, document
  and UTF-8 byte counts. Bytes are what turn a validation loss in nats per
  token into bits per byte, a figure comparable across tokenizers.
  ``index.json`` is written last: its presence marks a complete packing.

Parquet shards are tokenised by a Ray Data job (``map_batches`` over record
batches, one tokenizer per worker); documents go to validation by a stable
hash of their id (or text, when there is no id), so the split never changes
when shards are re-packed or re-ordered. A plain text file is one continuous
document: its last ``val_fraction`` (cut at a line break) is validation, as in
nanoGPT's Tiny Shakespeare setup.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from crawl2chat.stages.data.versions import shard_files, superseded_ids
from crawl2chat.stages.training.tokenizer import EOS_TOKEN, is_text_file

INDEX = "index.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_validation(key: str, val_fraction: float) -> bool:
    """Stable split: xxhash64 of the document key mapped to [0, 1)."""
    import xxhash

    return xxhash.xxh64_intdigest(key.encode("utf-8")) / 2.0**64 < val_fraction


class _TokenizeBatch:
    """Ray Data callable: loads the tokenizer once per worker, then turns a
    record batch of documents into token arrays, split labels and byte counts."""

    def __init__(self, tokenizer_file: str, val_fraction: float):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(tokenizer_file)
        self.eos = self.tok.token_to_id(EOS_TOKEN)
        self.val_fraction = val_fraction

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        texts = [str(t) for t in batch["text"]]
        keys = [str(k) for k in batch["id"]] if "id" in batch else texts
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        tokens = [np.asarray(e.ids + [self.eos], dtype=np.int64) for e in encs]
        return {
            "tokens": tokens,
            "val": np.array([is_validation(k, self.val_fraction) for k in keys]),
            "n_bytes": np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64),
        }


def _pack_text_file(path: Path, tokenizer_file: Path, val_fraction: float) -> dict[str, tuple[list, int, int]]:
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
    return out


def _hold_out_tail(out: Path, dtype: np.dtype, counts: dict, fraction: float) -> None:
    """A corpus too small for the hash split to pick any validation document still
    gets a validation set: the last ``fraction`` of the training tokens. Its byte
    count is prorated by tokens, so bits per byte is an estimate on such corpora."""
    train = np.fromfile(out / "train.bin.tmp", dtype=dtype)
    cut = int(len(train) * (1 - fraction))
    train[cut:].tofile(out / "val.bin.tmp")
    train[:cut].tofile(out / "train.bin.tmp")
    moved_bytes = int(counts["train"]["bytes"] * (len(train) - cut) / max(1, len(train)))
    counts["val"] = {"tokens": len(train) - cut, "documents": 0, "bytes": moved_bytes, "held_out_tail": True}
    counts["train"]["tokens"] = cut
    counts["train"]["bytes"] -= moved_bytes


def pack_shards(
    source: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_fraction: float = 0.01,
    num_cpus: int | None = None,
) -> dict[str, Any]:
    """Pack ``source`` (a shards folder or a text file) into ``out_dir``; returns the index."""
    from tokenizers import Tokenizer

    source, out = Path(source), Path(out_dir)
    tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
    vocab_size = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)

    files = {s: open(out / f"{s}.bin.tmp", "wb") for s in ("train", "val")}
    counts = {s: {"tokens": 0, "documents": 0, "bytes": 0} for s in ("train", "val")}

    def write(split: str, arrays, n_docs: int, n_bytes: int) -> None:
        for a in arrays:
            files[split].write(np.asarray(a, dtype=dtype).tobytes())
            counts[split]["tokens"] += len(a)
        counts[split]["documents"] += n_docs
        counts[split]["bytes"] += n_bytes

    try:
        if is_text_file(source):
            for split, (arrays, n_docs, n_bytes) in _pack_text_file(source, tokenizer_file, val_fraction).items():
                write(split, arrays, n_docs, n_bytes)
        else:
            for batch in _ray_tokenize(shard_files(source), tokenizer_file, val_fraction, num_cpus,
                                       superseded_ids(source)):
                for toks, val, nb in zip(batch["tokens"], batch["val"], batch["n_bytes"]):
                    write("val" if val else "train", [toks], 1, int(nb))
    finally:
        for f in files.values():
            f.close()
    if counts["val"]["tokens"] == 0 and counts["train"]["documents"] > 1:
        _hold_out_tail(out, dtype, counts, max(val_fraction, 0.05))
    for s in files:
        os.replace(out / f"{s}.bin.tmp", out / f"{s}.bin")
    if counts["train"]["tokens"] == 0 or counts["val"]["tokens"] == 0:
        raise ValueError(f"packing {source} left an empty split: {counts}; adjust val_fraction or add data")

    index = {
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": Tokenizer.from_file(str(tokenizer_file)).token_to_id(EOS_TOKEN),
        "source": str(source),
        "tokenizer": str(Path(tokenizer_dir).resolve()),
        "val_fraction": val_fraction,
        **counts,
    }
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def _ray_tokenize(files: list[Path], tokenizer_file: Path, val_fraction: float, num_cpus: int | None,
                  superseded: frozenset[str] = frozenset()):
    import pyarrow.parquet as pq
    import ray

    # The caller connects Ray (a local instance, or the cluster named by RAY_ADDRESS);
    # without one, Ray Data starts a local instance itself.
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # same files in, same bytes out
    ctx.enable_progress_bars = False

    names = pq.ParquetFile(files[0]).schema_arrow.names
    columns = [c for c in ("id", "text", "drop_reason") if c in names]
    ds = ray.data.read_parquet([str(f) for f in files]).select_columns(columns)
    if "drop_reason" in columns:
        ds = ds.filter(lambda row: not row["drop_reason"])
    if superseded:
        ds = ds.filter(lambda row: row["id"] not in superseded)
    ds = ds.filter(lambda row: bool(row["text"]))
    ds = ds.map_batches(
        _TokenizeBatch,
        fn_constructor_args=(str(tokenizer_file), val_fraction),
        batch_format="numpy",
        batch_size=256,
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, (num_cpus or os.cpu_count() or 1))),
    )
    yield from ds.iter_batches(batch_format="numpy", batch_size=1024)


def load_index(data_dir: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(data_dir) / INDEX).read_text())


def open_tokens(data_dir: str | os.PathLike, split: str) -> np.memmap:
    index = load_index(data_dir)
    return np.memmap(Path(data_dir) / f"{split}.bin", dtype=np.dtype(index["dtype"]), mode="r")
