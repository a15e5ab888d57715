"""Exact and near-duplicate removal on Ray Data.

Web crawls repeat themselves: mirrors, syndicated articles, boilerplate pages
that differ in a date or a counter. Training on such copies wastes compute and
teaches memorisation, so each group of copies keeps one document. Inputs repeat
themselves too: a truncated re-download of a crawl file, the same archive listed
twice, or a refresh that reads a copy of a file an earlier version read all give
the same record (hence the same document id) more than once. Such *repeated
records* are settled first, so two rows with one id never both survive.

The step works on small *key rows* instead of documents, so no process ever
holds all documents, signatures or edges:

1. **Keys** (``map_batches``): for every document still in play, one *copy* row
   (band_index ``-3``; it names the row's copy, see below), one exact row
   (xxh3-64 of :func:`normalize_for_hash`, band_index ``-1``) and one row per
   LSH band: MinHash bands (``num_bands`` x ``rows_per_band`` permutations over
   word n-gram shingles) or SimHash blocks (the 64-bit fingerprint cut into
   ``simhash_max_hamming + 1`` blocks, so two fingerprints within that Hamming
   distance agree on at least one block exactly).
2. **Repeated records** (hash-sharded groupby on the document id): the copy
   rows of one id, together with one row per id of the earlier versions'
   shards (``previous_ids``), decide which copy of a repeated id stays: none
   when an earlier version holds the id, else the copy with the longest text,
   then the smallest source file name, then the smallest text hash. The key
   rows of every other copy are removed here, so a partial copy never links
   documents, and each repeated id gets one decision row.
3. **Buckets** (hash-sharded groupby on the band hash): documents sharing a
   bucket become candidate pairs. Each member is linked to the bucket's first
   document only (a star), which keeps connectivity with a linear number of
   edges. SimHash candidates are verified by Hamming distance first.
4. **Connected components** (hash-sharded groupby on the node, repeated):
   min-label propagation over adjacency lists; a node that changed its label
   sends it to its neighbours in the next round; stops when nothing changes.
5. **Attach** (hash-sharded groupby on the document id): the decisions are
   joined back onto the documents. Every copy of a repeated id but the chosen
   one gets ``drop_reason`` ``dedup:repeated_record`` (``dup_cluster``: the id
   itself); the chosen copy, like every other document, gets ``dedup:exact`` or
   ``dedup:near`` when it duplicates another document, and ``dup_cluster``
   names the kept document of its cluster.

Every groupby is on a coarse shard number (``num_shards`` values), so one
Python call handles one shard with plain dicts; per-key ``map_groups`` calls
would cost a Python round-trip per bucket.

Which document a cluster keeps is decided by a *node key*, a string whose
order is the keep rule: documents from an earlier dataset version (the
``previous_index``) sort first, so they are never dropped; then, with
``keep="quality"``, higher ``quality_score``; then the smaller id. The cluster
keeps its smallest node key, and a repeated id its smallest copy key, whatever
order Ray processes rows in, so two runs keep the same documents.

``ds`` is read twice (keys, then attach): pass a dataset read from Parquet or
materialised, not a costly lazy chain. Written against Ray Data's API, the step
runs on either data engine (:mod:`~crawl2chat.stages.data.engine`): the datasets it
makes are of ``ds``'s engine.
"""

from __future__ import annotations

import json
import logging
import struct
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash
from datasketch import MinHash

from crawl2chat.stages.data.counting import Counted
from crawl2chat.stages.data.engine import engine_of
from crawl2chat.stages.data.text import normalize_for_hash, split_words
from crawl2chat.stages.data.settings import MINHASH_SCHEME, DedupConfig

if TYPE_CHECKING:  # the step runs on either engine; only Ray's needs Ray imported
    import ray

log = logging.getLogger(__name__)

EXACT_BAND = -1  # band_index of the exact-hash key row
_COUNT_BAND = -2  # band_index of the per-batch counter row (never bucketed)
_COPY_BAND = -3  # band_index of a document's copy row (one per row in play)
_OLD_ID_BAND = -4  # band_index of an id held by an earlier version's shards
_REPEAT_BAND = -5  # band_index of a repeated id's decision (band_hash: copies dropped)
REPEATED_RECORD = "dedup:repeated_record"
_MAX_TEXT_LEN = (1 << 63) - 1  # copy keys store (this - text length): longer texts sort first
_OLD, _NEW = "0", "1"  # first character of a node key: indexed documents win
_QUALITY_WIDTH = 16  # hex digits of the encoded quality in a node key


KEY_SCHEMA = pa.schema(
    [
        ("node", pa.string()),
        ("band_index", pa.int32()),
        ("band_hash", pa.int64()),
        ("fingerprint", pa.int64()),  # SimHash fingerprint (0 for other rows)
        ("copy", pa.string()),  # copy key of the row the key was computed from ("" for old documents)
    ]
)
INDEX_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("band_index", pa.int32()),
        ("band_hash", pa.int64()),
        ("fingerprint", pa.int64()),
    ]
)


# ---------------------------------------------------------------- signatures


def word_shingles(text: str, ngram_size: int) -> set[str]:
    """Word n-grams of normalised ``text`` (a text shorter than n is one shingle)."""
    words = split_words(normalize_for_hash(text))
    if not words:
        return set()
    if len(words) <= ngram_size:
        return {" ".join(words)}
    return {" ".join(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)}


def _signed64(value: int) -> int:
    """uint64 -> int64 with the same bits (Arrow/Parquet handle int64 everywhere)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def minhash_band_hashes(shingles: Iterable[str], cfg: DedupConfig, prototype: MinHash | None = None) -> list[int]:
    """One 64-bit hash per LSH band of the shingles' MinHash signature.

    The shingle hash is xxh32, so signatures agree across processes and runs
    (Python's ``hash`` is salted per process).
    """
    proto = prototype or MinHash(
        num_perm=cfg.num_perm, seed=cfg.seed, hashfunc=xxhash.xxh32_intdigest, scheme=MINHASH_SCHEME
    )
    sig = proto.copy()
    sig.update_batch([s.encode() for s in shingles])
    bands = sig.hashvalues.astype(np.uint32).reshape(cfg.num_bands, cfg.rows_per_band)
    return [_signed64(xxhash.xxh3_64_intdigest(band.tobytes())) for band in bands]


def simhash(shingles: Iterable[str], bits: int = 64) -> int:
    """Charikar SimHash: bit j is set when most shingle hashes have bit j set.

    Hand-written (a dozen numpy lines): no maintained package computes SimHash
    from a caller-chosen stable hash and returns the raw fingerprint for banding.
    """
    hashes = np.fromiter((xxhash.xxh3_64_intdigest(s.encode()) for s in shingles), dtype=np.uint64)
    if hashes.size == 0:
        return 0
    positions = np.arange(bits, dtype=np.uint64)
    ones = ((hashes[:, None] >> positions) & np.uint64(1)).sum(axis=0)
    set_bits = np.flatnonzero(ones * 2 > hashes.size)
    return int(sum(1 << int(j) for j in set_bits))


def simhash_blocks(fingerprint: int, bits: int, max_hamming: int) -> list[int]:
    """The fingerprint cut into ``max_hamming + 1`` contiguous blocks: two
    fingerprints that differ in at most ``max_hamming`` bits agree on one block
    (pigeonhole), so bucketing by block finds every such pair."""
    n_blocks = max_hamming + 1
    edges = np.linspace(0, bits, n_blocks + 1).astype(int)
    return [(fingerprint >> int(lo)) & ((1 << int(hi - lo)) - 1) for lo, hi in zip(edges[:-1], edges[1:])]


def _quality_code(score: float | None) -> str:
    """Hex string that sorts in *descending* score order; missing scores last."""
    if score is None or score != score:
        return "f" * _QUALITY_WIDTH
    (bits,) = struct.unpack(">Q", struct.pack(">d", float(score)))
    ascending = bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | (1 << 63)
    return f"{0xFFFFFFFFFFFFFFFF - ascending:016x}"


def _prefix_len(cfg: DedupConfig) -> int:
    return 1 + (_QUALITY_WIDTH if cfg.keep == "quality" else 0)


def _node_key(doc_id: str, cfg: DedupConfig, quality: float | None = None, old: bool = False) -> str:
    if old:
        return _OLD + ("0" * _QUALITY_WIDTH if cfg.keep == "quality" else "") + doc_id
    return _NEW + (_quality_code(quality) if cfg.keep == "quality" else "") + doc_id


def _shard_of(values: Sequence[str], num_shards: int) -> pa.Array:
    return pa.array([xxhash.xxh3_64_intdigest(v.encode()) % num_shards for v in values], pa.int64())


def copy_key(text: str | None, source: str | None) -> str:
    """Order of the copies of one repeated record: the smallest key is kept.

    Longer text first (a truncated copy loses to the whole record), then the
    smaller source file name, then the smaller text hash, so the choice depends
    only on the copies themselves, never on the order Ray delivers them in.
    """
    text = text or ""
    digest = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
    return f"{_MAX_TEXT_LEN - len(text):016x}{source or ''}\x00{digest:016x}"


def _doc_keys(batch: pa.Table, cfg: DedupConfig) -> pa.Table:
    """Documents -> one copy row per document in play, its key rows (exact + LSH
    bands), plus one counter row per batch (band_index -2; band_hash: rows in,
    fingerprint: documents compared). ``shard`` is the id's shard."""
    prototype = None
    if cfg.method == "minhash":
        prototype = MinHash(
            num_perm=cfg.num_perm, seed=cfg.seed, hashfunc=xxhash.xxh32_intdigest, scheme=MINHASH_SCHEME
        )
    n = batch.num_rows
    ids = batch.column("id").to_pylist()
    texts = batch.column("text").to_pylist()
    reasons = _column_or_nulls(batch, "drop_reason")
    sources = _column_or_nulls(batch, "source")
    qualities = _column_or_nulls(batch, "quality_score") if cfg.keep == "quality" else [None] * n
    nodes, bands, hashes, fps, copies, shard_ids = [], [], [], [], [], []
    active = 0
    for doc_id, text, reason, source, quality in zip(ids, texts, reasons, sources, qualities):
        if reason:
            continue
        node = _node_key(doc_id, cfg, quality)
        copy = copy_key(text, source)
        # Every row in play has a copy row, even one with nothing to compare: it may repeat another.
        rows: list[tuple[int, int, int]] = [(_COPY_BAND, 0, 0)]
        normalized = normalize_for_hash(text) if text else ""
        if normalized:  # else nothing left to compare (empty, markup, numbers only)
            active += 1
            if cfg.exact:
                rows.append((EXACT_BAND, _signed64(xxhash.xxh3_64_intdigest(normalized.encode())), 0))
            if cfg.method != "none":
                shingles = word_shingles(normalized, cfg.ngram_size)
                if cfg.method == "minhash":
                    rows += [(i, h, 0) for i, h in enumerate(minhash_band_hashes(shingles, cfg, prototype))]
                else:
                    fp = simhash(shingles, cfg.simhash_bits)
                    blocks = simhash_blocks(fp, cfg.simhash_bits, cfg.simhash_max_hamming)
                    rows += [(i, b, _signed64(fp)) for i, b in enumerate(blocks)]
        for band, value, fp in rows:
            nodes.append(node)
            bands.append(band)
            hashes.append(value)
            fps.append(fp)
            copies.append(copy)
            shard_ids.append(doc_id)
    nodes.append("")
    bands.append(_COUNT_BAND)
    hashes.append(n)
    fps.append(active)
    copies.append("")
    shard_ids.append("")
    table = pa.table([nodes, bands, hashes, fps, copies], schema=KEY_SCHEMA)
    return table.append_column("shard", _shard_of(shard_ids, cfg.num_shards))


def _column_or_nulls(batch: pa.Table, name: str) -> list:
    if name in batch.column_names:
        return batch.column(name).to_pylist()
    return [None] * batch.num_rows


def _with_band_shard(table: pa.Table, num_shards: int) -> pa.Table:
    if "shard" in table.column_names:
        table = table.drop_columns(["shard"])
    # Mixing in the band index spreads SimHash blocks (small integers) over shards.
    mixed = np.asarray(table.column("band_hash")).astype(np.uint64) ^ (
        np.asarray(table.column("band_index")).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    )
    return table.append_column("shard", pa.array((mixed % np.uint64(num_shards)).astype(np.int64)))


def _index_to_keys(batch: pa.Table, cfg: DedupConfig) -> pa.Table:
    """Band rows of a persisted index -> key rows whose node sorts before any new document."""
    nodes = [_node_key(i, cfg, old=True) for i in batch.column("id").to_pylist()]
    table = pa.table(
        [
            nodes,
            batch.column("band_index"),
            batch.column("band_hash"),
            batch.column("fingerprint"),
            pa.array([""] * batch.num_rows, pa.string()),
        ],
        schema=KEY_SCHEMA,
    )
    return _with_band_shard(table, cfg.num_shards)


# ---------------------------------------------------------- repeated records


def _old_id_rows(batch: pa.Table, cfg: DedupConfig) -> pa.Table:
    """Ids of an earlier version's shards -> one row each, sharded by id."""
    ids = [i for i in batch.column("id").to_pylist() if i]
    n = len(ids)
    table = pa.table(
        [[_node_key(i, cfg, old=True) for i in ids], [_OLD_ID_BAND] * n, [0] * n, [0] * n, [""] * n],
        schema=KEY_SCHEMA,
    )
    return table.append_column("shard", _shard_of(ids, cfg.num_shards))


def _load_previous_ids(paths: Sequence[str], cfg: DedupConfig, eng: Any) -> ray.data.Dataset | None:
    if not paths:
        return None
    return eng.read_parquet(list(paths)).select_columns(["id"]).map_batches(
        _old_id_rows, fn_kwargs={"cfg": cfg}, batch_format="pyarrow"
    )


def _resolve_repeats(part: pa.Table, cfg: DedupConfig) -> pa.Table:
    """One id shard of key rows (and old-id rows) -> the key rows of the one
    copy each id keeps, plus a decision row (band_index -5) per repeated id:
    ``copy`` is the kept copy's key ("" when an earlier version holds the id,
    so every copy goes), ``band_hash`` the number of copies dropped."""
    cut = _prefix_len(cfg)
    nodes = part.column("node").to_pylist()
    bands = part.column("band_index").to_pylist()
    copies = part.column("copy").to_pylist()
    old_ids: set[str] = set()
    copies_of: dict[str, list[str]] = defaultdict(list)
    for node, band, copy in zip(nodes, bands, copies):
        if band == _OLD_ID_BAND:
            old_ids.add(node[cut:])
        elif band == _COPY_BAND:
            copies_of[node[cut:]].append(copy)
    keep: dict[str, str | None] = {}
    repeat_nodes, repeat_counts, repeat_keep = [], [], []
    for doc_id, found in copies_of.items():
        if doc_id in old_ids:
            keep[doc_id] = None
        elif len(found) > 1:
            keep[doc_id] = min(found)
        else:
            continue
        repeat_nodes.append(_node_key(doc_id, cfg, old=True))
        repeat_counts.append(len(found) - (0 if doc_id in old_ids else 1))
        repeat_keep.append(keep[doc_id] or "")
    mask = []
    seen: set[tuple[str, int]] = set()
    for node, band, copy in zip(nodes, bands, copies):
        if band < EXACT_BAND:
            mask.append(False)
            continue
        doc_id = node[cut:]
        if doc_id not in keep:
            mask.append(True)
            continue
        # Identical copies (the same file read twice) bring identical key rows: keep one of each.
        take = copy == keep[doc_id] and (node, band) not in seen
        if take:
            seen.add((node, band))
        mask.append(take)
    kept = part.select(KEY_SCHEMA.names).filter(pa.array(mask, pa.bool_()))
    n = len(repeat_nodes)
    decisions = pa.table(
        [repeat_nodes, [_REPEAT_BAND] * n, repeat_counts, [0] * n, repeat_keep], schema=KEY_SCHEMA
    )
    return pa.concat_tables([kept.cast(KEY_SCHEMA), decisions])


def _only_bands(batch: pa.Table, num_shards: int) -> pa.Table:
    batch = batch.filter(pc.greater_equal(batch.column("band_index"), EXACT_BAND))
    return _with_band_shard(batch, num_shards)


def _repeat_decisions(batch: pa.Table, cfg: DedupConfig) -> pa.Table:
    """Decision rows of repeated ids -> attach rows (see DECISION_SCHEMA)."""
    batch = batch.filter(pc.equal(batch.column("band_index"), _REPEAT_BAND))
    cut = _prefix_len(cfg)
    ids = [node[cut:] for node in batch.column("node").to_pylist()]
    n = len(ids)
    return pa.table(
        [
            ids,
            pa.nulls(n, pa.string()),
            pa.nulls(n, pa.string()),
            [True] * n,
            batch.column("copy"),
            _shard_of(ids, cfg.num_shards),
        ],
        schema=DECISION_SCHEMA,
    )


def _count_repeats(batch: pa.Table) -> pa.Table:
    repeats = batch.filter(pc.equal(batch.column("band_index"), _REPEAT_BAND))
    return pa.table({"n": [int(pc.sum(repeats.column("band_hash")).as_py() or 0)]})


# ------------------------------------------------------------------- buckets

EDGE_SCHEMA = pa.schema([("node", pa.string()), ("nbr", pa.string()), ("exact", pa.bool_())])


def _bucket_edges(part: pa.Table, cfg: DedupConfig) -> pa.Table:
    """One shard of key rows -> directed edges (both directions of each linked pair).

    ``exact`` marks a node whose normalised text equals that of a document that
    sorts before it, which makes it an exact (not near) duplicate. Pairs of two
    indexed documents are skipped: old documents are never dropped, and the
    stars still connect every new document of a bucket to the bucket's head.
    """
    buckets: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
    for node, band, value, fp in zip(
        part.column("node").to_pylist(),
        part.column("band_index").to_pylist(),
        part.column("band_hash").to_pylist(),
        part.column("fingerprint").to_pylist(),
    ):
        buckets[(band, value)].append((node, fp))
    edges: set[tuple[str, str, bool]] = set()
    for (band, _), members in buckets.items():
        if len(members) < 2:
            continue
        if band == EXACT_BAND or cfg.method != "simhash":
            _link_star(sorted({node for node, _ in members}), band == EXACT_BAND, edges)
        else:
            _link_verified(members, cfg.simhash_max_hamming, edges)
    nodes, nbrs, exact = [], [], []
    for a, b, is_exact in edges:
        nodes += [a, b]
        nbrs += [b, a]
        exact += [is_exact, False]
    return pa.table([nodes, nbrs, exact], schema=EDGE_SCHEMA)


def _link_star(nodes: list[str], exact: bool, edges: set) -> None:
    """Link every new member of a sorted bucket to its head."""
    head = nodes[0]
    for node in nodes[1:]:
        if node[0] == _NEW:
            edges.add((node, head, exact))


def _link_verified(members: list[tuple[str, int]], max_hamming: int, edges: set) -> None:
    """SimHash bucket: equal fingerprints form a star; the heads of distinct
    fingerprints are linked when their Hamming distance is within the limit."""
    by_fp: dict[int, set[str]] = defaultdict(set)
    for node, fp in members:
        by_fp[fp].add(node)
    heads = []
    for fp, nodes in by_fp.items():
        ordered = sorted(nodes)
        _link_star(ordered, False, edges)
        heads.append((fp, ordered[0]))
    if len(heads) < 2:
        return
    fps = np.array([fp for fp, _ in heads], dtype=np.int64).view(np.uint64)
    close = np.bitwise_count(fps[:, None] ^ fps[None, :]) <= max_hamming
    for i, j in zip(*np.nonzero(np.triu(close, k=1))):
        a, b = sorted((heads[i][1], heads[j][1]))
        if b[0] == _NEW:
            edges.add((b, a, False))


# ---------------------------------------------------------- components

STATE_SCHEMA = pa.schema(
    [
        ("node", pa.string()),
        ("label", pa.string()),
        ("nbrs", pa.list_(pa.string())),  # null on message rows
        ("exact", pa.bool_()),
        ("changed", pa.bool_()),
    ]
)


def _adjacency(part: pa.Table) -> pa.Table:
    """Edges of one node shard -> one state row per node, labelled with the
    smallest key among itself and its neighbours (the first propagation round)."""
    nbrs: dict[str, set[str]] = defaultdict(set)
    exact: dict[str, bool] = defaultdict(bool)
    for node, nbr, is_exact in zip(
        part.column("node").to_pylist(), part.column("nbr").to_pylist(), part.column("exact").to_pylist()
    ):
        nbrs[node].add(nbr)
        exact[node] |= bool(is_exact)
    nodes = sorted(nbrs)
    return pa.table(
        [
            nodes,
            [min(node, min(nbrs[node])) for node in nodes],
            [sorted(nbrs[node]) for node in nodes],
            [exact[node] for node in nodes],
            [True] * len(nodes),
        ],
        schema=STATE_SCHEMA,
    )


def _edges_with_shard(batch: pa.Table, num_shards: int) -> pa.Table:
    if "exact" not in batch.column_names:
        batch = batch.append_column("exact", pa.array([False] * batch.num_rows, pa.bool_()))
    batch = batch.select(EDGE_SCHEMA.names).cast(EDGE_SCHEMA)
    return batch.append_column("shard", _shard_of(batch.column("node").to_pylist(), num_shards))


def _send_labels(state: pa.Table, num_shards: int) -> pa.Table:
    """State -> the state itself plus one message per neighbour of every node
    whose label changed last round (the others already sent theirs)."""
    state = state.select(STATE_SCHEMA.names).cast(STATE_SCHEMA)
    senders = state.filter(state.column("changed"))
    nbrs = senders.column("nbrs")
    targets = pc.list_flatten(nbrs)
    n = len(targets)
    messages = pa.table(
        [
            targets,
            pc.take(senders.column("label"), pc.list_parent_indices(nbrs)),
            pa.nulls(n, pa.list_(pa.string())),
            pa.nulls(n, pa.bool_()),
            pa.nulls(n, pa.bool_()),
        ],
        schema=STATE_SCHEMA,
    )
    both = pa.concat_tables([state, messages])
    return both.append_column("shard", _shard_of(both.column("node").to_pylist(), num_shards))


def _take_min_label(part: pa.Table) -> pa.Table:
    """One node shard of state rows and messages -> next state (label = min of own and received)."""
    is_state = pc.is_valid(part.column("nbrs"))
    state = part.filter(is_state)
    messages = part.filter(pc.invert(is_state))
    best: dict[str, str] = {}
    for node, label in zip(messages.column("node").to_pylist(), messages.column("label").to_pylist()):
        if node not in best or label < best[node]:
            best[node] = label
    new_labels, changed = [], []
    for node, label in zip(state.column("node").to_pylist(), state.column("label").to_pylist()):
        received = best.get(node, label)
        new_labels.append(min(label, received))
        changed.append(received < label)
    return pa.table(
        [state.column("node"), new_labels, state.column("nbrs"), state.column("exact"), changed],
        schema=STATE_SCHEMA,
    )


def _count_changed(batch: pa.Table) -> pa.Table:
    return pa.table({"n": [int(pc.sum(batch.column("changed").cast(pa.int64())).as_py() or 0)]})


def _reduce_on_driver(ds: ray.data.Dataset, partial_fn) -> list[dict]:
    """Run ``partial_fn`` over every block (a few rows each) and bring those rows
    to the driver: a distributed reduction whose result is small."""
    return ds.map_batches(partial_fn, batch_format="pyarrow", batch_size=None).take_all()


def connected_components(
    edges: ray.data.Dataset, num_shards: int, max_rounds: int
) -> tuple[ray.data.Dataset, int]:
    """Min-label propagation on Ray.

    ``edges`` holds (node, nbr[, exact]) rows, each link in both directions.
    Returns the final state (node, label, nbrs, exact, changed), where ``label``
    is the smallest node of the component, and the number of rounds run. Every
    round is one hash-sharded shuffle of the changed labels, so the work per
    process is bounded by a shard, never by the whole graph.
    """
    state = (
        edges.map_batches(_edges_with_shard, fn_kwargs={"num_shards": num_shards}, batch_format="pyarrow")
        .groupby("shard", num_partitions=num_shards)
        .map_groups(_adjacency, batch_format="pyarrow")
        .materialize()
    )
    rounds = 1
    while rounds < max_rounds:
        state = (
            state.map_batches(_send_labels, fn_kwargs={"num_shards": num_shards}, batch_format="pyarrow")
            .groupby("shard", num_partitions=num_shards)
            .map_groups(_take_min_label, batch_format="pyarrow")
            .materialize()
        )
        rounds += 1
        changed = sum(row["n"] for row in _reduce_on_driver(state, _count_changed))
        log.info("dedup: connected components round %d, %d labels changed", rounds, changed)
        if changed == 0:
            break
    else:
        log.warning("dedup: connected components stopped at max_rounds=%d before converging", max_rounds)
    return state, rounds


# ---------------------------------------------------------------- attach

DECISION_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("_dedup_reason", pa.string()),
        ("_dedup_cluster", pa.string()),
        ("_dedup_decision", pa.bool_()),  # tells decision rows from document rows after the union
        # Repeated ids only: the copy key of the copy to keep ("" for none); null on cluster decisions.
        ("_dedup_keep_copy", pa.string()),
        ("shard", pa.int64()),
    ]
)
_DECISION_COLUMNS = ["_dedup_reason", "_dedup_cluster", "_dedup_decision", "_dedup_keep_copy"]


def _decisions(state: pa.Table, cfg: DedupConfig) -> pa.Table:
    """Final state -> one row per new document in a cluster: its drop reason
    (null for the kept one) and cluster id (the kept document's id)."""
    cut = _prefix_len(cfg)
    ids, reasons, clusters = [], [], []
    for node, label, exact in zip(
        state.column("node").to_pylist(), state.column("label").to_pylist(), state.column("exact").to_pylist()
    ):
        if node[0] != _NEW:
            continue
        ids.append(node[cut:])
        clusters.append(label[cut:])
        reasons.append(None if node == label else ("dedup:exact" if exact else "dedup:near"))
    shards = _shard_of(ids, cfg.num_shards)
    n = len(ids)
    return pa.table(
        [ids, reasons, clusters, [True] * n, pa.nulls(n, pa.string()), shards], schema=DECISION_SCHEMA
    )


def _count_reasons(batch: pa.Table) -> pa.Table:
    counts = Counter(batch.column("_dedup_reason").to_pylist())
    return pa.table(
        {"reason": list(counts), "n": list(counts.values())},
        schema=pa.schema([("reason", pa.string()), ("n", pa.int64())]),
    )


def _docs_with_id_shard(batch: pa.Table, num_shards: int) -> pa.Table:
    if "dup_cluster" in batch.column_names:
        batch = batch.drop_columns(["dup_cluster"])
    return batch.append_column("shard", _shard_of(batch.column("id").to_pylist(), num_shards))


def _apply_decisions(part: pa.Table, columns: Sequence[str]) -> pa.Table:
    """One id shard of documents and decisions -> the documents with
    drop_reason and dup_cluster set.

    Of the copies of a repeated id, the one whose copy key the decision names
    (the first such row, when identical copies share it) takes the id's cluster
    decision; every other copy is dropped as a repeated record.
    """
    keep_copy: dict[str, str] = {}
    if "_dedup_decision" in part.column_names:
        is_decision = pc.fill_null(part.column("_dedup_decision"), False)
        decisions = part.filter(is_decision)
        docs = part.filter(pc.invert(is_decision))
        decided = {}
        for doc_id, reason, cluster, copy in zip(
            decisions.column("id").to_pylist(),
            decisions.column("_dedup_reason").to_pylist(),
            decisions.column("_dedup_cluster").to_pylist(),
            decisions.column("_dedup_keep_copy").to_pylist(),
        ):
            if copy is None:
                decided[doc_id] = (reason, cluster)
            else:
                keep_copy[doc_id] = copy
        docs = docs.drop_columns([c for c in _DECISION_COLUMNS if c in docs.column_names])
    else:
        docs, decided = part, {}
    reasons = _column_or_nulls(docs, "drop_reason")
    texts = docs.column("text").to_pylist() if keep_copy else []
    sources = _column_or_nulls(docs, "source") if keep_copy else []
    taken: set[str] = set()
    clusters = []
    for i, doc_id in enumerate(docs.column("id").to_pylist()):
        if reasons[i]:  # dropped before: passes through
            clusters.append(None)
            continue
        if doc_id in keep_copy:
            if doc_id in taken or copy_key(texts[i], sources[i]) != keep_copy[doc_id]:
                reasons[i] = REPEATED_RECORD
                clusters.append(doc_id)
                continue
            taken.add(doc_id)
        reason, cluster = decided.get(doc_id, (None, None))
        clusters.append(cluster)
        reasons[i] = reason
    docs = docs.drop_columns(["shard"] + (["drop_reason"] if "drop_reason" in docs.column_names else []))
    docs = docs.append_column("drop_reason", pa.array(reasons, pa.string()))
    docs = docs.append_column("dup_cluster", pa.array(clusters, pa.string()))
    # Shards see the union's columns in varying order; every output block gets the input's.
    return docs.select(list(columns))


# ------------------------------------------------------------------ index


def _load_previous_index(paths: Sequence[str], cfg: DedupConfig, eng: Any,
                         retired: frozenset[str] = frozenset()) -> ray.data.Dataset | None:
    band_dirs = []
    for path in paths:
        fs, root = fsspec.core.url_to_fs(path)
        with fs.open(f"{root}/meta.json") as f:
            meta = json.load(f)
        if meta != cfg.index_format():
            raise ValueError(f"dedup index {path} was built with {meta}; this run uses {cfg.index_format()}")
        band_dirs.append(f"{path.rstrip('/')}/bands")
    if not band_dirs:
        return None
    rows = eng.read_parquet(band_dirs)
    if retired:
        rows = rows.map_batches(_without_ids, fn_kwargs={"ids": pa.array(sorted(retired), pa.string())},
                                batch_format="pyarrow")
    return rows.map_batches(_index_to_keys, fn_kwargs={"cfg": cfg}, batch_format="pyarrow")


def _without_ids(batch: pa.Table, ids: pa.Array) -> pa.Table:
    return batch.filter(pc.invert(pc.fill_null(pc.is_in(batch["id"], value_set=ids), False)))


def _with_node_shard(batch: pa.Table, num_shards: int) -> pa.Table:
    if "shard" in batch.column_names:
        batch = batch.drop_columns(["shard"])
    return batch.append_column("shard", _shard_of(batch.column("node").to_pylist(), num_shards))


def _dropped_markers(state: pa.Table, num_shards: int) -> pa.Table:
    dropped = state.filter(pc.not_equal(state.column("node"), state.column("label")))
    table = pa.table({"node": dropped.column("node"), "dropped": pa.array([True] * dropped.num_rows, pa.bool_())})
    return _with_node_shard(table, num_shards)


def _kept_index_rows(part: pa.Table, cfg: DedupConfig) -> pa.Table:
    """One node shard of key rows and dropped-node markers -> index rows of kept documents."""
    if "dropped" in part.column_names:
        is_marker = pc.fill_null(part.column("dropped"), False)
        dropped = set(part.filter(is_marker).column("node").to_pylist())
        part = part.filter(pc.invert(is_marker))
        part = part.filter(pa.array([node not in dropped for node in part.column("node").to_pylist()], pa.bool_()))
    cut = _prefix_len(cfg)
    ids = [node[cut:] for node in part.column("node").to_pylist()]
    return pa.table(
        [ids, part.column("band_index"), part.column("band_hash"), part.column("fingerprint")],
        schema=INDEX_SCHEMA,
    )


def _write_index(keys: ray.data.Dataset, state: ray.data.Dataset | None, cfg: DedupConfig, work_dir: str) -> None:
    """Persist this run's key rows of kept documents under ``work_dir/index``:
    ``bands/*.parquet`` (id, band_index, band_hash, fingerprint; the exact hash
    is band_index -1) and ``meta.json`` (the settings the rows depend on)."""
    index_dir = f"{work_dir.rstrip('/')}/index"
    fs, root = fsspec.core.url_to_fs(index_dir)
    if fs.exists(root):
        fs.rm(root, recursive=True)
    fs.makedirs(root, exist_ok=True)
    keyed = keys.map_batches(_with_node_shard, fn_kwargs={"num_shards": cfg.num_shards}, batch_format="pyarrow")
    if state is not None:
        keyed = keyed.union(
            state.map_batches(_dropped_markers, fn_kwargs={"num_shards": cfg.num_shards}, batch_format="pyarrow")
        )
    rows = keyed.groupby("shard", num_partitions=cfg.num_shards).map_groups(
        _kept_index_rows, fn_kwargs={"cfg": cfg}, batch_format="pyarrow"
    )
    rows.write_parquet(f"{index_dir}/bands")
    with fs.open(f"{root}/meta.json", "w") as f:
        json.dump(cfg.index_format(), f)


# ------------------------------------------------------------------- step


def _labels_by_shard(batch: pa.Table, num_shards: int) -> pa.Table:
    labels = batch.column("label")
    return pa.table({"label": labels, "shard": _shard_of(labels.to_pylist(), num_shards)})


def _component_sizes(part: pa.Table) -> pa.Table:
    histogram = Counter(Counter(part.column("label").to_pylist()).values())
    return pa.table(
        {"size": list(histogram), "count": list(histogram.values())},
        schema=pa.schema([("size", pa.int64()), ("count", pa.int64())]),
    )


def _cluster_size_histogram(state: ray.data.Dataset, num_shards: int) -> Counter:
    partial = (
        state.map_batches(_labels_by_shard, fn_kwargs={"num_shards": num_shards}, batch_format="pyarrow")
        .groupby("shard", num_partitions=num_shards)
        .map_groups(_component_sizes, batch_format="pyarrow")
    )
    histogram: Counter = Counter()
    for row in partial.take_all():
        histogram[row["size"]] += row["count"]
    return histogram


def _count_docs(batch: pa.Table) -> pa.Table:
    counters = batch.filter(pc.equal(batch.column("band_index"), _COUNT_BAND))
    return pa.table(
        {
            "rows": [int(pc.sum(counters.column("band_hash")).as_py() or 0)],
            "active": [int(pc.sum(counters.column("fingerprint")).as_py() or 0)],
        }
    )


def _without_counters(batch: pa.Table) -> pa.Table:
    return batch.filter(pc.not_equal(batch.column("band_index"), _COUNT_BAND))


def dedup(
    ds: ray.data.Dataset,
    cfg: DedupConfig,
    work_dir: str,
    previous_index: Sequence[str] = (),
    previous_ids: Sequence[str] = (),
    tally: Any = None,
    retired: frozenset[str] = frozenset(),
) -> tuple[ray.data.Dataset, dict]:
    """Mark repeated records, exact and near duplicates in ``ds``; returns (documents, stats).

    Every input row comes back (the returned dataset is lazy, row order is not
    kept). Rows already dropped pass through. Of the rows that share an id, one
    stays in play (longest text, then smallest ``source``, then smallest text
    hash) and the others get ``drop_reason`` ``dedup:repeated_record``; every
    row whose id is in ``previous_ids`` (Parquet files with an ``id`` column:
    the shards of the earlier versions of the dataset) gets it too, so ids stay
    unique across versions. Duplicates get ``dedup:exact`` or ``dedup:near``;
    members of a cluster get ``dup_cluster`` (the id of the document the cluster
    keeps; null for singletons; a repeated record's own id). A new document that
    duplicates one in ``previous_index`` (folders written by an earlier run as
    ``work_dir/index``) is dropped; indexed ones never are, and ``retired`` ones
    (documents a later capture of their page superseded) are left out of the
    comparison. This run's kept documents are indexed under ``work_dir/index``.

    ``tally`` (:mod:`~crawl2chat.stages.data.counting`) counts the documents
    whose keys are computed.

    Stats: docs_in, docs_checked (not dropped before, with text), repeated_records,
    exact_dups, near_dups, clusters, cluster_size_histogram (members incl.
    indexed ones -> clusters), candidate_links (links found in band and
    exact-hash buckets; a pair linked in several shards counts once per shard),
    cc_rounds.
    """
    keys = ds.map_batches(Counted(_doc_keys, tally), fn_kwargs={"cfg": cfg}, batch_format="pyarrow").materialize()
    counts = _reduce_on_driver(keys, _count_docs)
    keys = keys.map_batches(_without_counters, batch_format="pyarrow")
    old_ids = _load_previous_ids(previous_ids, cfg, engine_of(ds))
    if old_ids is not None:
        keys = keys.union(old_ids)
    resolved = (
        keys.groupby("shard", num_partitions=cfg.num_shards)
        .map_groups(_resolve_repeats, fn_kwargs={"cfg": cfg}, batch_format="pyarrow")
        .materialize()
    )
    repeats = resolved.map_batches(
        _repeat_decisions, fn_kwargs={"cfg": cfg}, batch_format="pyarrow"
    ).materialize()
    keys = resolved.map_batches(
        _only_bands, fn_kwargs={"num_shards": cfg.num_shards}, batch_format="pyarrow"
    ).materialize()
    stats: dict = {
        "docs_in": sum(row["rows"] for row in counts),
        "docs_checked": sum(row["active"] for row in counts),
        "repeated_records": sum(row["n"] for row in _reduce_on_driver(resolved, _count_repeats)),
        "exact_dups": 0,
        "near_dups": 0,
        "clusters": 0,
        "cluster_size_histogram": {},
        "candidate_links": 0,
        "cc_rounds": 0,
    }
    if stats["repeated_records"]:
        log.info("dedup: %d repeated records (ids already read)", stats["repeated_records"])
    all_keys = keys
    old_keys = _load_previous_index(previous_index, cfg, engine_of(ds), retired)
    if old_keys is not None:
        all_keys = keys.union(old_keys)
    edges = (
        all_keys.groupby("shard", num_partitions=cfg.num_shards)
        .map_groups(_bucket_edges, fn_kwargs={"cfg": cfg}, batch_format="pyarrow")
        .materialize()
    )
    stats["candidate_links"] = edges.count() // 2  # each link is stored in both directions
    if stats["candidate_links"] == 0:
        _write_index(keys, None, cfg, work_dir)
        if not stats["repeated_records"]:
            return ds.map_batches(_with_null_cluster, batch_format="pyarrow"), stats
        return _attach(ds, repeats, cfg), stats

    state, stats["cc_rounds"] = connected_components(edges, cfg.num_shards, cfg.max_rounds)
    log.info("dedup: connected components converged after %d rounds", stats["cc_rounds"])
    decisions = state.map_batches(_decisions, fn_kwargs={"cfg": cfg}, batch_format="pyarrow").materialize()
    reasons: Counter = Counter()
    for row in _reduce_on_driver(decisions, _count_reasons):
        reasons[row["reason"]] += row["n"]
    stats["exact_dups"] = reasons["dedup:exact"]
    stats["near_dups"] = reasons["dedup:near"]
    histogram = _cluster_size_histogram(state, cfg.num_shards)
    stats["clusters"] = sum(histogram.values())
    stats["cluster_size_histogram"] = dict(sorted(histogram.items()))
    _write_index(keys, state, cfg, work_dir)
    return _attach(ds, decisions.union(repeats), cfg), stats


def _attach(ds: ray.data.Dataset, decisions: ray.data.Dataset, cfg: DedupConfig) -> ray.data.Dataset:
    """Join the decision rows onto the documents by id shard."""
    columns = [c for c in ds.schema().names if c != "dup_cluster"]
    columns += [c for c in ("drop_reason", "dup_cluster") if c not in columns]
    docs = ds.map_batches(_docs_with_id_shard, fn_kwargs={"num_shards": cfg.num_shards}, batch_format="pyarrow")
    return (
        docs.union(decisions)
        .groupby("shard", num_partitions=cfg.num_shards)
        .map_groups(_apply_decisions, fn_kwargs={"columns": columns}, batch_format="pyarrow")
    )


def _with_null_cluster(batch: pa.Table) -> pa.Table:
    if "dup_cluster" in batch.column_names:
        batch = batch.drop_columns(["dup_cluster"])
    return batch.append_column("dup_cluster", pa.nulls(batch.num_rows, pa.string()))
