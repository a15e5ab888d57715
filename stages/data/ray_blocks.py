"""Run document blocks inside Ray Data.

Blocks (see :mod:`crawl2chat.stages.data.base`) work on plain dicts and know nothing
about Ray. This module adapts a list of blocks to ``Dataset.map_batches``: a
batch arrives as an Arrow table, becomes a list of documents, flows through the
blocks, and leaves as an Arrow table with a fixed schema, so every Parquet file
a step writes has the same columns whatever rows its batches happened to hold.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pyarrow as pa

from crawl2chat.stages.data.base import Block

# Column types of every step's output. Later steps add columns; a document that
# lacks one (dropped before that step) stores null.
COLUMN_TYPES: dict[str, pa.DataType] = {
    "id": pa.string(),
    "url": pa.string(),
    "source": pa.string(),
    "host": pa.string(),
    "content_type": pa.string(),
    "charset": pa.string(),
    "record_type": pa.string(),
    "fetched_at": pa.string(),
    "text": pa.large_string(),
    "drop_reason": pa.string(),
    "file_error": pa.string(),
    "records_read": pa.int64(),
    "template_lines": pa.int32(),
    "site_template": pa.string(),
    "lang": pa.string(),
    "lang_score": pa.float64(),
    "quality_score": pa.float64(),
    "repeated_lines": pa.int32(),
    "dup_cluster": pa.string(),
}

DOCUMENT_COLUMNS = (
    "id", "url", "source", "host", "content_type", "charset", "record_type",
    "fetched_at", "text", "drop_reason", "file_error", "records_read",
    "template_lines",
)
# site_template: on a file's status row, the template lines judged in its windows ({host: [line, ...]}, JSON)
EXTRACT_COLUMNS = DOCUMENT_COLUMNS + ("site_template",)
LANGID_COLUMNS = DOCUMENT_COLUMNS + ("lang", "lang_score")
QUALITY_COLUMNS = LANGID_COLUMNS + ("quality_score", "repeated_lines")
DEDUP_COLUMNS = QUALITY_COLUMNS + ("dup_cluster",)


def schema_for(columns: Sequence[str]) -> pa.Schema:
    return pa.schema([(name, COLUMN_TYPES[name]) for name in columns])


def to_table(docs: list[dict], columns: Sequence[str]) -> pa.Table:
    """Documents -> Arrow table with exactly ``columns`` (missing keys become null)."""
    return pa.Table.from_pylist(docs, schema=schema_for(columns))


class BlockBatchMapper:
    """A ``map_batches`` callable that runs ``make_blocks()`` over each batch.

    The blocks are built once per Ray worker process (on first use), so a model
    such as the language-ID classifier loads once, not once per batch.
    """

    def __init__(self, make_blocks: Callable[[], list[Block]], columns: Sequence[str]):
        self.make_blocks = make_blocks
        self.columns = tuple(columns)
        self._blocks: list[Block] | None = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self._blocks is None:
            self._blocks = self.make_blocks()
        docs = iter(batch.to_pylist())
        for block in self._blocks:
            docs = block.run(docs)
        return to_table(list(docs), self.columns)
