"""Site template lines: the header, navigation and footer a site repeats on every page.

Main-content extractors judge one page at a time, so chrome that looks like
content on its own (a version banner, "Module Index : Topics : Keywords", a
cookie notice written as a paragraph) survives extraction and is then trained on
once per page. Seen across pages of one host it is obvious: a line that occurs
on at least ``min_share`` of a host's pages is part of the site's template.
This is the cross-document line statistic CCNet uses for boilerplate, applied
per host within a window of documents that the extract step holds anyway (one
WARC file, at most a few hundred records), so memory stays bounded and the
result does not depend on how files are spread over workers. Written here
because no maintained package removes lines by cross-page frequency over
plain dicts (trafilatura's own duplicate cache works inside its extractor and
only for it). Lines are compared after stripping whitespace, so the rule is
the same in every language and script.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence


def template_lines(texts: Sequence[str], min_share: float) -> set[str]:
    """The stripped lines that occur on at least ``min_share`` of ``texts``."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update({line.strip() for line in text.splitlines() if line.strip()})
    cutoff = max(2.0, min_share * len(texts))
    return {line for line, n in counts.items() if n >= cutoff}


def strip_template_lines(docs: list[dict], min_pages: int, min_share: float) -> int:
    """Remove each host's template lines from the kept documents of ``docs`` in place.

    Only hosts with at least ``min_pages`` kept documents in the window are
    judged. Each document gets ``template_lines`` (lines removed from it);
    returns the total."""
    by_host: dict[str, list[dict]] = defaultdict(list)
    for doc in docs:
        if doc.get("drop_reason") is None and doc.get("text"):
            by_host[doc.get("host") or ""].append(doc)
    removed = 0
    for group in by_host.values():
        if len(group) < min_pages:
            continue
        template = template_lines([d["text"] for d in group], min_share)
        if not template:
            continue
        for doc in group:
            lines = doc["text"].splitlines()
            kept = [line for line in lines if line.strip() not in template]
            doc["template_lines"] = len(lines) - len(kept)
            removed += doc["template_lines"]
            doc["text"] = "\n".join(kept).strip("\n")
    return removed
