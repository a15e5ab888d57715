"""Reading crawl archives (WARC, WET, ARC) into text documents.

Every response/resource/conversion record becomes one document: HTML is turned
into text right here so raw bodies never have to be stored. Records that cannot
be used are still yielded, with empty text and an ``extract:<rule>`` drop reason,
so every loss is counted. A file that breaks half-way (truncated gzip, garbage,
non-chunked gzip) ends quietly: what was read before the break is kept and the
error is listed in ``WarcReader.file_errors`` for the run report. A file that
ends inside a record (a download or copy cut off, in the record's gzip member,
its headers or its body) is reported with the byte it ends at and the offset of
the record it cuts; that record becomes one row dropped as
``extract:truncated_record`` (with whatever of its text was read), so the cut is
counted and quarantined rather than read as a shorter page or not at all.

Parsing is warcio's ``ArchiveIterator`` (per-record gzip, ARC converted to WARC,
chunked and gzip HTTP bodies decoded). cc_net-style uncompressed WET text dumps
(``*.wet.txt``), whose hand-edited records carry wrong Content-Length values that
warcio rightly rejects, are read the way cc_net reads them: a record starts at
each ``WARC/1.0`` line.
"""

from __future__ import annotations

import io
import zlib
from collections import Counter
from pathlib import PurePosixPath
from typing import IO, Any, Iterator
from urllib.parse import urlsplit

import fsspec
import xxhash
from warcio.archiveiterator import ArchiveIterator
from warcio.exceptions import ArchiveLoadFailed

from crawl2chat.stages.data.base import Document
from crawl2chat.stages.data.extract import body_to_text, looks_binary, parse_content_type, sniff_html
from crawl2chat.stages.data.settings import ExtractConfig
from crawl2chat.stages.settings import SettingsError

# Names picked up when a folder is given. Plain ``*.txt`` is not: folders of crawl
# samples usually also hold README/LICENSE text files.
INPUT_SUFFIXES = (
    ".warc", ".warc.gz", ".wet", ".wet.gz", ".arc", ".arc.gz", ".wet.txt", ".warc.txt", ".wet.txt.gz",
)
DOCUMENT_RECORD_TYPES = frozenset({"response", "resource", "conversion"})
# Drop reason of a record the file ends inside: whatever of it was read stays in the quarantine.
TRUNCATED = "truncated_record"
_READ_CHUNK = 1 << 20
# Errors of the byte stream itself: after one of these nothing further in the file can be trusted.
_STREAM_ERRORS = (ArchiveLoadFailed, EOFError, zlib.error, OSError)
# Also what warcio raises on header garbage between records.
_FILE_BREAKING_ERRORS = (*_STREAM_ERRORS, ValueError, UnicodeError)


def list_input_files(paths: list[str]) -> list[str]:
    """Crawl files named by ``paths``: files as given, folders (local or fsspec URLs such as
    ``s3://bucket/prefix/``) searched recursively for archive names, glob patterns expanded.
    Sorted and without duplicates, so every worker and every rerun sees the same list. When
    nothing is found and a folder was given, the error names the folder and what it holds."""
    found: set[str] = set()
    empty: list[tuple[str, list[str]]] = []  # folders given that hold no crawl file
    for path in paths:
        try:
            fs, root = fsspec.core.url_to_fs(path)
        except (ValueError, ImportError) as e:  # an unknown protocol, or its package not installed
            raise SettingsError(f"data.inputs: cannot open {path!r}: {e}") from None
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        local = "file" in protocols

        def name(p: str) -> str:
            return p if local else fs.unstrip_protocol(p)

        if any(ch in root for ch in "*?["):
            matches = fs.glob(root)
            if not matches:
                raise FileNotFoundError(f"no input file matches {path!r}")
            found.update(name(p) for p in matches if fs.isfile(p))
        elif not fs.exists(root):
            raise FileNotFoundError(f"input path does not exist: {path!r}" if local else
                                    f"input path does not exist or cannot be reached: {path!r}")
        elif fs.isdir(root):
            inside = fs.find(root)
            archives = [name(p) for p in inside if p.lower().endswith(INPUT_SUFFIXES)]
            found.update(archives)
            if not archives:
                empty.append((path, inside))
        else:
            found.add(name(root))
    if not found and empty:
        path, inside = empty[0]
        others = f"; it holds {len(inside)} other files, such as {', '.join(p.rsplit('/', 1)[-1] for p in inside[:3])}"
        raise FileNotFoundError(f"{path}: no WARC, ARC or WET file in this folder (names ending "
                                f"{', '.join(INPUT_SUFFIXES)}){others if inside else ''}")
    return sorted(found)


def document_id(url: str, record_key: str) -> str:
    """Stable id (xxhash64 hex) of url + record id: the same on every worker and every run."""
    return xxhash.xxh64_hexdigest(f"{url}\n{record_key}".encode("utf-8", "surrogatepass"))


def _host(url: str) -> str:
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


class _QuietArchiveIterator(ArchiveIterator):
    """warcio's iterator, quiet, and able to tell whether the file ended inside a gzip member.

    warcio treats a gzip member that stops early (a file cut off mid-record) like the
    end of the file; the member's decompressor, kept here past warcio's own cleanup,
    still knows it never reached the member's end."""

    # warcio writes a warning to stderr for each record whose Content-Length is off; the reader
    # reports those through ``err_count`` in ``file_errors`` instead.
    INC_RECORD = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._last_decompressor = None
        self.gzipped = False

    def close(self) -> None:
        if self.reader is not None:
            self._last_decompressor = self.reader.decompressor
            self.gzipped = self.gzipped or self.reader.decompressor is not None
        super().close()

    def member_cut(self) -> bool:
        """True when the file ended (or broke) inside a gzip member: the member's
        decompressor was fed data but never reached the member's end."""
        decompressor = self.reader.decompressor if self.reader is not None else self._last_decompressor
        if decompressor is None:
            return False
        self.gzipped = True
        return not decompressor.eof

    def end_offset(self) -> int:
        try:
            return int(self.fh.tell())
        except (OSError, ValueError, AttributeError):
            return -1


class WarcReader:
    """Streams documents out of one crawl file at a time; never raises on bad data."""

    def __init__(self, config: ExtractConfig | None = None) -> None:
        self.config = config or ExtractConfig()
        self.file_errors: list[dict] = []
        self.stats: Counter[str] = Counter()

    def run(self, path: str) -> Iterator[Document]:
        source = PurePosixPath(path.rstrip("/")).name
        records_read = 0
        try:
            with fsspec.open(path, "rb") as raw_file:
                if path.lower().endswith((".wet.txt", ".warc.txt", ".wet.txt.gz")):
                    text_file = io.TextIOWrapper(
                        _gunzip_if_needed(raw_file, path), encoding="utf-8", errors="replace"
                    )
                    records = self._wet_text_records(text_file, source)
                else:
                    records = self._warc_records(raw_file, source)
                for doc in records:
                    records_read += 1
                    if doc is None:  # a record that is not a document (request, warcinfo, ...)
                        continue
                    self._count(doc)
                    yield doc
        except _FILE_BREAKING_ERRORS as error:
            self._file_error(path, f"{type(error).__name__}: {str(error).strip()}", records_read)
        except _RecordStreamError as error:
            self._file_error(path, str(error), records_read)
        except Exception as error:  # noqa: BLE001 - a file no parser expected still must not end the job
            self._file_error(path, f"unexpected {type(error).__name__}: {error}", records_read)

    # -- WARC / ARC through warcio -------------------------------------------------------

    def _warc_records(self, raw_file: IO[bytes], source: str) -> Iterator[Document | None]:
        iterator = _QuietArchiveIterator(raw_file, arc2warc=True)
        if not source.lower().endswith((".arc", ".arc.gz")):
            # A WARC or WET file holds WARC records only: without this, warcio falls back to
            # reading any line of text as an ARC record's header (a text file "parses").
            iterator.known_format = "warc"
        records = iter(iterator)
        seen_any = False
        cut: tuple[int, str] | None = None  # (offset of the cut record, what of it is missing)
        # Each record's document is held back until the next record parses: a record whose
        # gzip member the file ends in can look whole (its headers cut before Content-Length).
        pending: tuple[Document | None, Any, int] | None = None
        while True:
            try:
                record = next(records)
            except StopIteration:
                break
            except Exception:
                # A gzip member that ends early makes warcio fail on its half-read headers in
                # many ways; the cut is the cause, so it is what gets reported.
                if cut is None and iterator.member_cut():
                    break
                if pending is not None:
                    yield pending[0]
                raise
            if pending is not None:
                yield pending[0]
                pending = None
            seen_any = True
            start = iterator.offset
            doc = self._record_to_document(record, source, start)
            missing = _drain(record)
            if missing and cut is None:
                # Reported once the iterator has had its say: if the stream is garbage from here
                # on, warcio's own error (raised on the next record) describes it better.
                cut = (start, f"{missing} bytes of its declared length missing")
                doc = _mark_cut(doc, record, source, start)
            pending = (doc, record, start)
        end = iterator.end_offset()
        if cut is None and end != 0 and iterator.member_cut():
            if pending is not None and iterator.offset >= end:
                # The file ends inside the last record that parsed.
                doc, record, start = pending
                pending = (_mark_cut(doc, record, source, start), record, start)
                cut = (start, "its end cut off")
            else:
                # Cut before the next record's headers were complete: warcio ends as if the file had.
                if pending is not None:
                    yield pending[0]
                pending = (_cut_row(None, source, iterator.offset, None), None, iterator.offset)
                cut = (iterator.offset, "its headers cut off")
            seen_any = True
        elif cut is None and 0 <= iterator.offset < end:
            # An uncompressed file that ends inside a record's headers: warcio stops before it.
            if pending is not None:
                yield pending[0]
            pending = (_cut_row(None, source, iterator.offset, None), None, iterator.offset)
            cut = (iterator.offset, "its headers cut off")
            seen_any = True
        elif cut is None and pending is not None and _headers_cut(pending[1]):
            # An uncompressed file that ends inside the last record's headers.
            doc, record, start = pending
            pending = (_mark_cut(doc, record, source, start), record, start)
            cut = (start, "its headers cut off")
        if pending is not None:
            yield pending[0]
        if cut is not None:
            start, what = cut
            gz = " in a gzip member" if iterator.gzipped else ""
            raise _RecordStreamError(
                f"truncated record: the file ends at byte {end}{gz}, inside the record starting at byte {start} "
                f"({what}); the records before it are kept, that record is quarantined as extract:{TRUNCATED}"
            )
        if not seen_any:
            raise _RecordStreamError("no WARC/ARC records (empty file)")
        if iterator.err_count:
            raise _RecordStreamError(f"{iterator.err_count} record(s) with an invalid Content-Length")

    def _record_to_document(self, record, source: str, offset: int) -> Document | None:
        record_type = record.rec_type
        if record_type not in DOCUMENT_RECORD_TYPES:
            return None
        headers = record.rec_headers
        url = (headers.get_header("WARC-Target-URI") or "").strip()
        # ARC records have no record id (warcio invents a random one): use the position instead.
        record_id = headers.get_header("WARC-Record-ID")
        is_arc = source.lower().endswith((".arc", ".arc.gz"))
        record_key = record_id if record_id and not is_arc else f"{source}@{offset}"
        doc = _new_document(url, record_key, source, headers.get_header("WARC-Date"), record_type)
        try:
            rule = self._fill_text(record, doc)
        except Exception as error:  # noqa: BLE001 - one bad page must not end the crawl file
            if isinstance(error, _STREAM_ERRORS):
                raise
            rule = "unreadable_body"
        if rule:
            doc["text"] = ""
            doc["drop_reason"] = f"extract:{rule}"
        return doc

    def _fill_text(self, record, doc: Document) -> str | None:
        config = self.config
        http = record.http_headers
        if record.rec_type == "conversion":
            doc["content_type"] = parse_content_type(
                record.rec_headers.get_header("WARC-Identified-Payload-Type")
                or record.rec_headers.get_header("Content-Type")
            )[0]
            body, rule = _read_bounded(record.content_stream(), config.max_record_bytes)
            if rule:
                return rule
            doc["text"] = body.decode("utf-8", errors="replace").strip()
            return None if len(doc["text"]) >= max(config.min_text_chars, 1) else "no_text"

        if http is not None and record.rec_type == "response":
            status = http.get_statuscode() or ""
            if not http.protocol.upper().startswith("HTTP/") or not (len(status) == 3 and status.isdigit()):
                return "bad_http_header"
            if not status.startswith("2"):
                return f"http_status_{status}"
            mime, charset = parse_content_type(http.get_header("Content-Type"))
        else:
            mime, charset = parse_content_type(record.rec_headers.get_header("Content-Type"))
            if mime and mime.startswith("application/http"):
                mime = None
        doc["charset"] = charset

        is_html = mime in config.html_content_types
        if mime is not None and not is_html and mime not in config.text_content_types:
            doc["content_type"] = mime
            return "unsupported_content_type"

        body, rule = _read_bounded(record.content_stream(), config.max_record_bytes)
        if rule:
            doc["content_type"] = mime
            return rule
        if not body.strip():
            doc["content_type"] = mime
            return "empty_body"
        if looks_binary(body):
            doc["content_type"] = mime
            return "binary_body"
        if mime is None:
            is_html = sniff_html(body)
            mime = "text/html" if is_html else "text/plain"
        doc["content_type"] = mime

        doc["text"] = body_to_text(body, charset, is_html, config.extractor).strip()
        return None if len(doc["text"]) >= max(config.min_text_chars, 1) else "no_text"

    # -- cc_net-style plain-text WET --------------------------------------------------------

    def _wet_text_records(self, lines: IO[str], source: str) -> Iterator[Document | None]:
        headers: dict[str, str] | None = None
        body: list[str] = []
        body_chars = 0
        in_headers = False
        seen_any = False
        for line in lines:
            if line.rstrip("\r\n") == "WARC/1.0":
                if headers is not None:
                    yield self._wet_document(headers, body, body_chars, source)
                headers, body, body_chars, in_headers, seen_any = {}, [], 0, True, True
            elif headers is None:
                raise _RecordStreamError("not a WET file: text before the first 'WARC/1.0' line")
            elif in_headers:
                if not line.strip():
                    in_headers = False
                elif ":" in line:
                    key, value = line.split(":", 1)
                    headers[key.strip().lower()] = value.strip()
            else:
                body_chars += len(line)
                if body_chars <= self.config.max_record_bytes:
                    body.append(line)
        if headers is not None:
            yield self._wet_document(headers, body, body_chars, source)
        if not seen_any:
            raise _RecordStreamError("no WET records (empty file)")

    def _wet_document(self, headers: dict[str, str], body: list[str], body_chars: int, source: str):
        record_type = headers.get("warc-type", "")
        if record_type not in DOCUMENT_RECORD_TYPES:
            return None
        url = headers.get("warc-target-uri", "")
        doc = _new_document(url, headers.get("warc-record-id", ""), source, headers.get("warc-date"), record_type)
        doc["content_type"] = parse_content_type(
            headers.get("warc-identified-payload-type") or headers.get("content-type")
        )[0]
        text = "".join(body).strip()
        if body_chars > self.config.max_record_bytes:
            doc["drop_reason"] = "extract:oversized"
        elif len(text) < max(self.config.min_text_chars, 1):
            doc["drop_reason"] = "extract:no_text"
        else:
            doc["text"] = text
        return doc

    # -- bookkeeping -------------------------------------------------------------------------

    def _count(self, doc: Document) -> None:
        self.stats["documents"] += 1
        if doc["drop_reason"]:
            self.stats[f"dropped:{doc['drop_reason'].split(':', 1)[1]}"] += 1
        else:
            self.stats["kept"] += 1

    def _file_error(self, path: str, error: str, records_read: int) -> None:
        self.stats["file_errors"] += 1
        self.file_errors.append({"path": path, "error": error, "records_read": records_read})


class _RecordStreamError(Exception):
    """The file is not (or no longer) a readable sequence of records."""


def _new_document(url: str, record_key: str, source: str, fetched_at: str | None, record_type: str) -> Document:
    return {
        "id": document_id(url, record_key),
        "url": url,
        "source": source,
        "host": _host(url),
        "content_type": None,
        "fetched_at": fetched_at,
        "text": "",
        "drop_reason": None,
        "charset": None,
        "record_type": record_type,
    }


def _headers_cut(record) -> bool:
    """A WARC record without the Content-Length every WARC record has: its headers were cut."""
    return str(getattr(record, "format", "")).startswith("warc") and not record.rec_headers.get_header(
        "Content-Length")


def _mark_cut(doc: Document | None, record, source: str, offset: int) -> Document:
    """The record the file ends inside, as a quarantine row: its document (what was read of
    its text kept) or, for a record that is no document, a row standing for it."""
    if doc is None:
        doc = _cut_row(record.rec_headers.get_header("WARC-Target-URI"), source, offset, record.rec_type)
    doc["drop_reason"] = f"extract:{TRUNCATED}"
    return doc


def _cut_row(url: str | None, source: str, offset: int, record_type: str | None) -> Document:
    """The quarantine row of a cut-off record that is not a document (or whose headers were
    cut): its id is that of the position, so a rerun over the same file gives the same row."""
    url = (url or "").strip()
    doc = _new_document(url, f"{source}@{offset}", source, None, record_type or "unknown")
    doc["drop_reason"] = f"extract:{TRUNCATED}"
    return doc


def _read_bounded(stream, limit: int) -> tuple[bytes, str | None]:
    """Body of at most ``limit`` bytes, read in 1 MiB chunks; ``(b"", "oversized")`` past it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = stream.read(_READ_CHUNK)
        if not chunk:
            return b"".join(chunks), None
        size += len(chunk)
        if size > limit:
            return b"", "oversized"
        chunks.append(chunk)


def _drain(record) -> int:
    """Read what is left of the record and return how many of its declared bytes never came
    (a cut-off file); warcio itself would silently hand back the shorter record."""
    stream = record.raw_stream
    while stream.read(_READ_CHUNK):
        pass
    return int(getattr(stream, "limit", 0) or 0)


def _gunzip_if_needed(raw_file: IO[bytes], path: str) -> IO[bytes]:
    if path.lower().endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw_file)
    return raw_file
