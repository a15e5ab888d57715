"""The contract every data pipeline block follows.

A document is a plain ``dict`` (one row of a Parquet/Arrow table). A block is a
small class with one ``run`` over documents: it yields every document it was
given, setting ``doc["drop_reason"]`` on those it rejects (``"<block>:<rule>"``,
e.g. ``"gopher_quality:too_few_words"``) instead of discarding them, so every
drop is counted and quarantined with its reason. Blocks know nothing about the
executor: the same block runs in a plain loop, in a test, or inside a Ray Data
``map_batches`` (see :mod:`crawl2chat.stages.data.ray_blocks`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Iterator

Document = dict[str, Any]

# Columns every document carries once text has been extracted.
TEXT_COLUMNS = (
    "id",  # stable hex digest (xxhash of url + record id); identical on every Ray worker
    "url",
    "source",  # where the document came from: the input file's name or the crawl's name
    "host",  # lower-cased host name of the url
    "content_type",  # MIME type from the HTTP header (or the WARC record)
    "fetched_at",  # WARC-Date, ISO 8601
    "text",
    "drop_reason",  # None while the document is kept
)


class Block:
    """One step over documents. Subclasses set ``name`` and implement ``process``.

    ``process`` returns ``None`` to keep the document (after annotating it) or a
    short rule name to drop it. ``run`` handles the bookkeeping: documents that an
    earlier block already dropped pass through untouched.
    """

    name: str = "block"

    def __init__(self) -> None:
        self.stats: Counter[str] = Counter()

    def process(self, doc: Document) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            if doc.get("drop_reason"):
                yield doc
                continue
            self.stats["seen"] += 1
            rule = self.process(doc)
            if rule:
                doc["drop_reason"] = f"{self.name}:{rule}"
                self.stats[f"dropped:{rule}"] += 1
            else:
                doc["drop_reason"] = None
                self.stats["kept"] += 1
            yield doc
