"""Captures of one page: the newest one is the page.

A data folder meets the same URL many times: a refresh re-fetches a changed
page, a crawl stopped and rerun stores a page in two WARC files, Common Crawl
snapshots hold a page once per crawl, and a page taken off a site comes back as
a 404 answer. The rule is the one web archives use for a page's current state:
its newest capture (``WARC-Date``, then the larger document id, so the choice is
the same in every run) stands for the page.

* Within one build, a kept document whose URL has a newer capture (in this
  build, or among the current documents of the versions it extends) is dropped
  as ``dedup:older_capture``.
* A committed document is superseded by a newer capture of its URL read by a
  later version, whatever became of that capture (kept, a 404, dropped by a
  filter, a duplicate of another page), except when the capture was found to
  duplicate that very document: the page did not change, and its text stays.

Written here because the rule joins three things no library holds together:
the step folders' rows, the versions' shards and their superseded ids.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

OLDER_CAPTURE = "dedup:older_capture"
COLUMNS = ["id", "url", "fetched_at"]


def capture_order(table: pa.Table) -> pa.Array:
    """One string per row whose order is the captures' order: ``WARC-Date`` without its
    trailing ``Z`` (so ``...:00Z`` sorts before ``...:00.5Z``), then the id."""
    when = pc.fill_null(table["fetched_at"], "")
    when = pc.utf8_rtrim(when, characters="Z")
    return pc.binary_join_element_wise(when, pc.fill_null(table["id"], ""), "\x00")


def read_captures(step_dir: str | Path) -> pa.Table:
    """``id, url, fetched_at, order`` of the page captures an extract step folder holds
    (every record with a URL, kept or dropped; not the files' status rows)."""
    from crawl2chat.stages.data.pipeline import FILE_STATUS

    files = sorted(Path(step_dir).glob("*.parquet"))
    if not files:
        return empty()
    table = pq.read_table(files, columns=[*COLUMNS, "record_type"])
    keep = pc.and_(pc.fill_null(pc.not_equal(table["record_type"], FILE_STATUS), True),
                   pc.fill_null(pc.not_equal(table["url"], ""), False))
    return _ordered(table.filter(keep).select(COLUMNS))


def read_documents(shards: Sequence[str | Path], retired: Collection[str] = ()) -> pa.Table:
    """``id, url, fetched_at, order`` of the documents in committed shards, less the ``retired`` ids
    and the augmented copies (they go with the document they were made from)."""
    if not shards:
        return empty()
    dataset = pq.ParquetDataset([str(s) for s in shards])
    augmented = "augmented_from" in dataset.schema.names
    table = dataset.read(columns=COLUMNS + (["augmented_from"] if augmented else []))
    if augmented:
        table = table.filter(pc.is_null(table["augmented_from"])).select(COLUMNS)
    if retired:
        table = table.filter(pc.invert(pc.is_in(table["id"], value_set=pa.array(sorted(retired), pa.string()))))
    return _ordered(table)


def older_captures(captures: pa.Table, documents: pa.Table) -> set[str]:
    """Ids of ``captures`` whose URL has a newer capture among ``captures`` or ``documents``."""
    if not captures.num_rows:
        return set()
    both = pa.concat_tables([captures, documents.select(captures.column_names)]) if documents.num_rows else captures
    newest = both.group_by("url").aggregate([("order", "max")])
    joined = captures.join(newest, "url")
    older = joined.filter(pc.less(joined["order"], joined["order_max"]))
    return set(older["id"].to_pylist())


def superseded_documents(captures: pa.Table, documents: pa.Table, known: Collection[str],
                         duplicate_of: dict[str, str]) -> pa.Table:
    """``id, url`` of ``documents`` (the current documents of earlier versions) that a newer
    capture of their URL in ``captures`` (this version's) replaces.

    ``known``: ids already in earlier versions' shards (a capture read again is not newer);
    ``duplicate_of``: a dropped duplicate's id -> the id of the document its cluster kept."""
    empty = pa.table({"id": pa.array([], pa.string()), "url": pa.array([], pa.string())})
    if not captures.num_rows or not documents.num_rows:
        return empty
    if known:
        captures = captures.filter(pc.invert(pc.is_in(captures["id"], value_set=pa.array(sorted(known), pa.string()))))
    if not captures.num_rows:
        return empty
    newest = captures.group_by("url").aggregate([("order", "max")])
    # The newest capture's id, for its duplicate decision.
    top = captures.join(newest, "url")
    top = top.filter(pc.equal(top["order"], top["order_max"]))
    cluster_of = {url: duplicate_of.get(i) for url, i in zip(top["url"].to_pylist(), top["id"].to_pylist())}
    old = documents.join(newest, "url")
    old = old.filter(pc.less(old["order"], old["order_max"]))
    same = [cluster_of.get(u) == i for u, i in zip(old["url"].to_pylist(), old["id"].to_pylist())]
    old = old.filter(pc.invert(pa.array(same, pa.bool_())))
    return old.sort_by([("url", "ascending"), ("id", "ascending")]).select(["id", "url"])


def _ordered(table: pa.Table) -> pa.Table:
    table = table.cast(pa.schema([(c, pa.string()) for c in COLUMNS]))
    return table.append_column("order", capture_order(table))


def empty() -> pa.Table:
    """No captures (the columns the functions here take)."""
    return _ordered(pa.table({c: pa.array([], pa.string()) for c in COLUMNS}))
