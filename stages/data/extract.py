"""Turning an HTTP body into clean text: decoding bytes, then HTML to text.

The web mislabels encodings all the time (GBK pages served as ``utf-8``,
Latin-1 pages declared as UTF-8, Shift-JIS pages with only a ``<meta>``
charset), so decoding tries what the page claims first and only keeps a claim
that decodes without errors, then falls back to byte-level detection
(resiliparse's uchardet wrapper). Main-content extraction removes navigation,
menus and footers so later quality filters judge the page's prose, not its
chrome. Both extractors used by the big open web corpora are available:
resiliparse (fast, C++; used by e.g. DCLM's tooling) and trafilatura (Python,
used by FineWeb); ``benchmarks/bench_extract.py`` compares them on real pages.
"""

from __future__ import annotations

import re
import threading

import xxhash
from cachetools import LRUCache
from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.encoding import bytes_to_str, detect_encoding, map_encoding_to_html5
from crawl2chat.stages.data.settings import Extractor


_META_CHARSET_RE = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([a-zA-Z0-9_:.\-]+)""", re.IGNORECASE)
_CHARSET_RE = re.compile(r"""charset\s*=\s*["']?\s*([a-zA-Z0-9_:.\-]+)""", re.IGNORECASE)
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def parse_content_type(value: str | None) -> tuple[str | None, str | None]:
    """``("text/html", "gbk")`` from a header like ``text/html; charset=GBK``."""
    if not value:
        return None, None
    mime = value.split(";", 1)[0].strip().lower() or None
    match = _CHARSET_RE.search(value)
    return mime, (match.group(1).lower() if match else None)


def sniff_html(body: bytes) -> bool:
    """Whether a body without a declared type looks like HTML (a tag in its first KiB)."""
    head = body[:1024].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html", b"<head", b"<body")) or b"<html" in head


def looks_binary(body: bytes) -> bool:
    """NUL bytes in the first 8 KiB mean a binary payload mislabelled as text (UTF-16 with a BOM
    is the one text encoding that legitimately contains NULs)."""
    head = body[:8192]
    return b"\x00" in head and not head.startswith(_UTF16_BOMS)


def _strict_decode(body: bytes, label: str | None) -> str | None:
    if not label:
        return None
    # WHATWG label mapping: "iso-8859-1" really means windows-1252 on the web, "x-sjis" is
    # Shift-JIS, etc. Unknown labels map to utf-8, which is then tried strictly like any other.
    encoding = map_encoding_to_html5(label)
    try:
        return body.decode(encoding)
    except (LookupError, UnicodeDecodeError):
        return None


def decode_body(body: bytes, http_charset: str | None = None) -> str:
    """Decode an HTTP body: the HTTP charset if it decodes cleanly, else the HTML ``<meta>``
    charset if it does, else the encoding uchardet detects (decoded leniently, never raising)."""
    text = _strict_decode(body, http_charset)
    if text is None:
        meta = _META_CHARSET_RE.search(body[:4096])
        text = _strict_decode(body, meta.group(1).decode("ascii") if meta else None)
    if text is None:
        text = bytes_to_str(body, detect_encoding(body), errors="replace")
    return text.removeprefix("\ufeff")


# The main text of the HTML bodies this process extracted lately, by body digest, charset and
# extractor. Crawls repeat bodies byte for byte: one page under several URLs (tracking and
# session parameters, http and https, mirrors), soft-404 and parked-domain pages, the same
# pages in overlapping crawl files. Extraction is the costliest per-page work of the data
# stage (~2.5 ms a page with Resiliparse, ~36 ms with Trafilatura) and gives the same text for
# the same bytes, so a body met again costs one hash of it. Bounded by the characters held.
REPEATED_BODY_CHARS = 16 << 20
_texts_by_body: LRUCache = LRUCache(maxsize=REPEATED_BODY_CHARS, getsizeof=len)
_texts_lock = threading.Lock()  # a cachetools cache is not safe for concurrent use


def body_to_text(body: bytes, charset: str | None, is_html: bool, extractor: Extractor = "resiliparse") -> str:
    """The text of an HTTP body: decoded (:func:`decode_body`) and, for HTML, its main
    content (:func:`html_to_text`); an HTML body this process extracted lately is not
    extracted again."""
    if not is_html:
        return decode_body(body, charset)
    key = (xxhash.xxh3_128_digest(body), charset, extractor)
    with _texts_lock:
        text = _texts_by_body.get(key)
    if text is None:
        text = html_to_text(decode_body(body, charset), extractor)
        if len(text) <= REPEATED_BODY_CHARS // 64:  # one page never pushes out most of the others
            with _texts_lock:
                _texts_by_body[key] = text
    return text


def html_to_text(html: str, extractor: Extractor = "resiliparse") -> str:
    """Main content of an HTML page as plain text, one block per line ("" if none)."""
    if extractor == "resiliparse":
        return extract_plain_text(html, preserve_formatting=True, main_content=True, alt_texts=False)
    if extractor == "trafilatura":
        # Imported lazily: trafilatura pulls in lxml, dateparser, ... which workers that use
        # resiliparse never need.
        import trafilatura

        text = trafilatura.extract(
            html, include_comments=False, include_tables=True, deduplicate=False, with_metadata=False
        )
        return text or ""
    raise ValueError(f"unknown extractor {extractor!r}")


# A page whose main content is too short for Trafilatura's own extractor, so it takes the
# library's fallback path (readability, then jusText) as many real pages do.
_WARM_UP_PAGE = ("<html><head><title>t</title></head><body><nav><a href='/'>Home</a></nav><article>"
                 "<p>A short paragraph.</p><p>Another line.</p></article><footer>(c)</footer></body></html>")


def warm_up(extractor: Extractor) -> None:
    """Pay an extractor's one-off costs now: Trafilatura compiles patterns and builds
    jusText's all-language stop-word list on first use (~0.15-0.3 s a process, paid by
    whichever page first takes its fallback path); a command does this while it waits
    for its Prefect API, an extract worker before it takes any file. Resiliparse has none."""
    if extractor == "trafilatura":
        html_to_text(_WARM_UP_PAGE, extractor)
