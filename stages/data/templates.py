"""Site template lines: the header, navigation and footer a site repeats on every page.

Main-content extractors judge one page at a time, so chrome that looks like
content on its own (a version banner, "Module Index : Topics : Keywords", a
cookie notice written as a paragraph) survives extraction and is then trained on
once per page. Seen across pages of one host it is obvious: a line that occurs
on at least ``min_share`` of a host's pages is part of the site's template.
The lines judged so are kept with each dataset version (``site_templates.json``)
and removed again from the pages of a later refresh, which often holds only a
few changed pages of a host: too few to judge there.
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
from collections.abc import Collection, Mapping, Sequence


def template_lines(texts: Sequence[str], min_share: float) -> set[str]:
    """The stripped lines that occur on at least ``min_share`` of ``texts``."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update({line.strip() for line in text.splitlines() if line.strip()})
    cutoff = max(2.0, min_share * len(texts))
    return {line for line, n in counts.items() if n >= cutoff}


def strip_template_lines(docs: list[dict], min_pages: int, min_share: float,
                         known: Mapping[str, Collection[str]] | None = None,
                         found: dict[str, set[str]] | None = None) -> int:
    """Remove each host's template lines from the kept documents of ``docs`` in place.

    Hosts with at least ``min_pages`` kept documents in the window are judged
    here (and what is found is added to ``found``); the lines of ``known``
    (host -> lines judged in earlier builds) are removed whatever the window
    holds. Each document gets ``template_lines`` (lines removed from it);
    returns the total."""
    known = known or {}
    by_host: dict[str, list[dict]] = defaultdict(list)
    for doc in docs:
        if doc.get("drop_reason") is None and doc.get("text"):
            by_host[doc.get("host") or ""].append(doc)
    removed = 0
    for host, group in by_host.items():
        judged = template_lines([d["text"] for d in group], min_share) if len(group) >= min_pages else set()
        if judged and found is not None:
            found.setdefault(host, set()).update(judged)
        template = judged | set(known.get(host, ()))
        if not template:
            continue
        for doc in group:
            lines = doc["text"].splitlines()
            kept = [line for line in lines if line.strip() not in template]
            doc["template_lines"] = len(lines) - len(kept)
            removed += doc["template_lines"]
            doc["text"] = "\n".join(kept).strip("\n")
    return removed
