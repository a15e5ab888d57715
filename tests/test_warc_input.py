"""Reading WARC/WET/ARC files: the shared real samples (good and deliberately broken) and
small archives written here with warcio to pin down encodings, HTTP errors and limits."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import fsspec
import pytest
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from crawl2chat.stages.data.base import TEXT_COLUMNS
from crawl2chat.stages.data.settings import ExtractConfig
from crawl2chat.stages.data.warc_input import WarcReader, list_input_files

WARC_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "warc"

needs_data = pytest.mark.skipif(not WARC_DATA.is_dir(), reason="shared WARC samples not present")


def kept(docs):
    return [d for d in docs if not d["drop_reason"]]


# -- archives written here ---------------------------------------------------------------


def http_response(writer, url, body: bytes, headers=(("Content-Type", "text/html"),), status="200 OK"):
    http = StatusAndHeaders(status, list(headers), protocol="HTTP/1.1")
    record = writer.create_warc_record(
        url, "response", payload=io.BytesIO(body), length=len(body), http_headers=http
    )
    writer.write_record(record)


def raw_response_record(url: str, block: bytes) -> bytes:
    """A response record written byte by byte: warcio's writer refuses a broken HTTP head."""
    head = (
        "WARC/1.0\r\nWARC-Type: response\r\n"
        f"WARC-Target-URI: {url}\r\nWARC-Date: 2024-05-01T00:00:00Z\r\n"
        "WARC-Record-ID: <urn:uuid:00000000-0000-0000-0000-00000000beef>\r\n"
        f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(block)}\r\n\r\n"
    )
    return head.encode() + block + b"\r\n\r\n"


def html(body: str, head: str = "") -> str:
    return f"<html><head>{head}<title>t</title></head><body><article>{body}</article></body></html>"


GERMAN = "<p>Die Größe der Straße überrascht alle Besucher: über hundert Häuser stehen dort am Fluss.</p>"
CHINESE = "<p>广东省人民政府门户网站发布最新政务信息，欢迎市民查阅各项公共服务的办理指南。</p>"
JAPANESE = "<p>日本語のウェブページです。東京の天気は晴れで、明日は雨が降るでしょう。</p>"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00"


@pytest.fixture
def crafted_warc(tmp_path) -> Path:
    path = tmp_path / "crafted.warc.gz"
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        http_response(
            writer, "http://gbk.example.com/news", html(CHINESE).encode("gbk"),
            [("Content-Type", "text/html; charset=gbk")],
        )
        sjis_meta = '<meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS">'
        http_response(writer, "http://sjis.example.com/", html(JAPANESE, sjis_meta).encode("shift_jis"))
        http_response(
            writer, "http://latin1.example.com/", html(GERMAN).encode("latin-1"),
            [("Content-Type", "text/html; charset=utf-8")],
        )
        http_response(writer, "http://empty.example.com/", b"")
        http_response(writer, "http://image.example.com/a.png", PNG, [("Content-Type", "image/png")])
        http_response(writer, "http://png-as-html.example.com/", PNG)
        http_response(writer, "http://missing.example.com/", html("<p>gone</p>").encode(), status="404 Not Found")
        http_response(writer, "http://nav-only.example.com/", b"<html><body><script>x()</script></body></html>")
        plain = "Plain text served as text/plain, one line of prose.".encode()
        http_response(writer, "http://text.example.com/a.txt", plain, [("Content-Type", "text/plain")])
        request = writer.create_warc_record(
            "http://text.example.com/a.txt", "request", payload=io.BytesIO(b"GET / HTTP/1.1\r\n\r\n")
        )
        writer.write_record(request)
    with open(path, "ab") as out:  # uncompressed records may follow gzip members in one file
        out.write(raw_response_record("http://broken.example.com/", b"NOT-HTTP\r\n\r\n<p>hello</p>"))
    return path


def test_crafted_records_each_become_one_document(crafted_warc):
    reader = WarcReader()
    docs = {d["url"]: d for d in reader.run(str(crafted_warc))}
    assert reader.file_errors == []
    assert len(docs) == 10  # the request record is not a document

    assert "广东省人民政府门户网站" in docs["http://gbk.example.com/news"]["text"]
    assert docs["http://gbk.example.com/news"]["charset"] == "gbk"
    assert "東京の天気は晴れ" in docs["http://sjis.example.com/"]["text"]
    assert "Größe der Straße" in docs["http://latin1.example.com/"]["text"]
    assert docs["http://text.example.com/a.txt"]["text"].startswith("Plain text served")

    reasons = {url: d["drop_reason"] for url, d in docs.items() if d["drop_reason"]}
    assert reasons == {
        "http://empty.example.com/": "extract:empty_body",
        "http://image.example.com/a.png": "extract:unsupported_content_type",
        "http://png-as-html.example.com/": "extract:binary_body",
        "http://missing.example.com/": "extract:http_status_404",
        "http://nav-only.example.com/": "extract:no_text",
        "http://broken.example.com/": "extract:bad_http_header",
    }
    assert all(docs[url]["text"] == "" for url in reasons)
    assert reader.stats["kept"] == 4 and reader.stats["dropped:http_status_404"] == 1


def test_document_fields(crafted_warc):
    doc = next(WarcReader().run(str(crafted_warc)))
    assert set(TEXT_COLUMNS) <= set(doc) and {"charset", "record_type"} <= set(doc)
    assert doc["source"] == "crafted.warc.gz"
    assert doc["host"] == "gbk.example.com"
    assert doc["content_type"] == "text/html"
    assert doc["record_type"] == "response"
    assert doc["fetched_at"].startswith("20")
    assert len(doc["id"]) == 16 and int(doc["id"], 16) >= 0


def test_ids_are_stable_across_processes(crafted_warc):
    here = [d["id"] for d in WarcReader().run(str(crafted_warc))]
    script = (
        "import sys; from crawl2chat.stages.data.warc_input import WarcReader; "
        "print(' '.join(d['id'] for d in WarcReader().run(sys.argv[1])))"
    )
    other = subprocess.run(
        [sys.executable, "-c", script, str(crafted_warc)], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert other.stdout.split() == here
    assert len(set(here)) == len(here)


def test_oversized_body_is_dropped_with_bounded_memory(tmp_path):
    path = tmp_path / "big.warc"
    paragraph = b"<p>" + b"word " * 200 + b"</p>\n"
    body = b"<html><body>" + paragraph * (50_000_000 // len(paragraph)) + b"</body></html>"
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=False)
        http_response(writer, "http://big.example.com/", body)
        http_response(writer, "http://small.example.com/", html(GERMAN).encode())
    del body

    reader = WarcReader(ExtractConfig(max_record_bytes=2_000_000))
    tracemalloc.start()
    try:
        docs = list(reader.run(str(path)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [d["drop_reason"] for d in docs] == ["extract:oversized", None]
    assert "Größe" in docs[1]["text"]
    assert peak < 12_000_000, f"reading a 50 MB record peaked at {peak / 1e6:.1f} MB"


def test_memory_filesystem_url_is_read_through_fsspec(crafted_warc):
    url = "memory://crawl/part-0/crafted.warc.gz"
    with fsspec.open(url, "wb") as out:
        out.write(crafted_warc.read_bytes())
    [listed] = list_input_files(["memory://crawl/"])
    assert listed.startswith("memory://") and listed.endswith("/crawl/part-0/crafted.warc.gz")
    docs = list(WarcReader().run(listed))
    assert len(kept(docs)) == 4 and docs[0]["source"] == "crafted.warc.gz"


def test_list_input_files_expands_folders_and_globs(tmp_path):
    names = ["a/x.warc.gz", "a/b/y.warc", "c.wet.gz", "d.warc.wet.gz", "e.arc", "f.arc.gz", "g.wet.txt",
             "README.txt", "notes.md", "a/b/skip.json"]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    found = list_input_files([str(tmp_path)])
    assert found == sorted(found)
    assert {Path(p).relative_to(tmp_path).as_posix() for p in found} == set(names[:7])
    # an explicitly named file is taken whatever its name; duplicates collapse
    assert list_input_files([str(tmp_path / "notes.md"), str(tmp_path / "notes.md")]) == [str(tmp_path / "notes.md")]
    assert len(list_input_files([str(tmp_path / "*.arc*")])) == 2
    assert list_input_files([f"file://{tmp_path}/a"]) == sorted([str(tmp_path / "a/x.warc.gz"), str(tmp_path / "a/b/y.warc")])


def test_list_input_files_names_the_missing_path(tmp_path):
    missing = str(tmp_path / "no-such-crawl")
    with pytest.raises(FileNotFoundError, match="no-such-crawl"):
        list_input_files([str(tmp_path), missing])


def test_a_folder_without_crawl_files_is_named_with_what_it_holds(tmp_path):
    docs, crawl = tmp_path / "docs", tmp_path / "crawl"
    docs.mkdir()
    crawl.mkdir()
    (docs / "part-0001.jsonl.gz").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"docs: no WARC, ARC or WET file .*part-0001\.jsonl\.gz"):
        list_input_files([str(docs)])
    (crawl / "a.warc.gz").write_bytes(b"")
    assert list_input_files([str(docs), str(crawl)]) == [str(crawl / "a.warc.gz")]  # found elsewhere: no error


@pytest.mark.parametrize(
    "name, content, error",
    [
        ("empty.warc.gz", b"", "empty file"),
        ("random.warc", random.Random(0).randbytes(4096), "ArchiveLoadFailed"),
        ("notes.warc", b"These are meeting notes.\nSecond line.\n", "ArchiveLoadFailed"),
        # five words on the first line would read as an ARC header: a WARC file holds WARC records only
        ("words.warc", b"These are five word notes\nSecond line.\n", "Invalid WARC record"),
        ("line.warc.gz", b"hello this is not a warc\n", "Invalid WARC record"),
        ("notes.wet.txt", b"These are meeting notes, not a WET dump.\n", "not a WET file"),
        ("cut.warc.gz", None, "truncated record"),
    ],
)
def test_broken_files_are_recorded_not_raised(tmp_path, crafted_warc, name, content, error):
    path = tmp_path / name
    if content is None:  # the crafted archive cut in the middle of its third gzip member
        data = crafted_warc.read_bytes()
        content = data[: len(data) // 3]
    path.write_bytes(content)
    reader = WarcReader()
    docs = list(reader.run(str(path)))
    assert len(reader.file_errors) == 1
    assert reader.file_errors[0]["path"] == str(path) and error in reader.file_errors[0]["error"]
    assert reader.file_errors[0]["records_read"] == len(docs)
    if name == "cut.warc.gz":
        assert docs and "广东省人民政府" in docs[0]["text"]
    else:
        assert kept(docs) == []


# -- the shared real samples ---------------------------------------------------------------


@needs_data
@pytest.mark.parametrize("name", ["dolma/sample-0000.warc.gz", "dolma/sample-0001.warc.gz"])
def test_dolma_samples_give_english_pages(name):
    reader = WarcReader()
    docs = list(reader.run(str(WARC_DATA / name)))
    assert reader.file_errors == []
    assert len(kept(docs)) >= 15
    assert all(d["content_type"] in ("text/html", "text/plain") for d in kept(docs))
    assert sum(len(d["text"]) for d in kept(docs)) > 20_000
    assert all(d["host"] and d["url"].startswith("http") for d in docs if d["record_type"] == "response")


@needs_data
def test_common_crawl_chinese_excerpt():
    reader = WarcReader()
    docs = kept(reader.run(str(WARC_DATA / "resiliparse/warcfile.warc.gz")))
    assert reader.file_errors == [] and len(docs) == 16
    assert sum(any("\u4e00" <= c <= "\u9fff" for c in d["text"][:500]) for d in docs) >= 8


@needs_data
def test_clueweb_japanese_pages():
    docs = kept(WarcReader().run(str(WARC_DATA / "resiliparse/clueweb-quirk.warc.gz")))
    assert len(docs) == 29
    assert all(any("\u3040" <= c <= "\u30ff" or "\u4e00" <= c <= "\u9fff" for c in d["text"]) for d in docs)


@needs_data
def test_whirlwind_wet_conversion_record():
    reader = WarcReader()
    [doc] = list(reader.run(str(WARC_DATA / "whirlwind/whirlwind.warc.wet.gz")))
    assert doc["record_type"] == "conversion" and doc["drop_reason"] is None
    assert doc["url"] == "https://an.wikipedia.org/wiki/Escopete"
    assert "Escopete" in doc["text"] and doc["host"] == "an.wikipedia.org"


@needs_data
def test_cc_net_plain_text_wet():
    reader = WarcReader()
    docs = list(reader.run(str(WARC_DATA / "cc_net/sample.warc.wet.txt")))
    assert reader.file_errors == []
    assert [d["url"] for d in docs] == ["http://sample_english.com", "http://sample_chinese.zh", "http://sample_russian.ru"]
    assert "Mark Twain" in docs[0]["text"] and "馬克·吐溫" in docs[1]["text"]
    assert any("\u0400" <= c <= "\u04ff" for c in docs[2]["text"])


@needs_data
@pytest.mark.parametrize("name", ["warcio/example.arc", "warcio/example.arc.gz", "warcio/example.warc.gz",
                                  "warcio/example-iana.org-chunked.warc", "warcio/example-resource.warc.gz"])
def test_warcio_fixtures_arc_chunked_resource(name):
    reader = WarcReader()
    docs = kept(reader.run(str(WARC_DATA / name)))
    assert reader.file_errors == [] and len(docs) == 1
    assert "Example Domain" in docs[0]["text"] or "Internet Assigned Numbers Authority" in docs[0]["text"]


@needs_data
def test_arc_ids_are_stable_between_reads():
    path = str(WARC_DATA / "warcio/example.arc")
    assert [d["id"] for d in WarcReader().run(path)] == [d["id"] for d in WarcReader().run(path)]


@needs_data
@pytest.mark.parametrize(
    "name, error, documents",
    [
        ("resiliparse/clipped.warc.gz", "truncated record", 1),
        ("warcio/example-trunc.warc", "invalid Content-Length", 1),
        ("warcio/example-bad.warc.gz.bad", "non-chunked gzip", 0),
        ("warcio/example-bad-non-chunked.warc.gz", "non-chunked gzip", 0),
        ("warcio/example-wrong-chunks.warc.gz", "ArchiveLoadFailed", 1),
    ],
)
def test_broken_samples_keep_what_was_read(name, error, documents):
    reader = WarcReader()
    docs = list(reader.run(str(WARC_DATA / name)))
    assert len(docs) == documents
    [failure] = reader.file_errors
    assert error in failure["error"] and failure["records_read"] >= documents
    if name == "resiliparse/clipped.warc.gz":
        assert len(docs[0]["text"]) > 1000  # the part before the cut is still usable text


@needs_data
def test_whole_sample_folder_never_raises():
    reader = WarcReader()
    files = list_input_files([str(WARC_DATA)])
    assert not any(p.endswith(("LICENSE", "SOURCE.txt")) for p in files)
    docs = [doc for path in files for doc in reader.run(path)]
    assert len(kept(docs)) >= 100
    for path in files:  # example.warc and example.warc.gz hold the same records, hence per file
        ids = [d["id"] for d in docs if path.endswith("/" + d["source"])]
        assert len(set(ids)) == len(ids)
    assert {e["path"] for e in reader.file_errors} >= {str(WARC_DATA / "resiliparse/clipped.warc.gz")}


# -- files cut inside a gzip member ----------------------------------------------------------


def _member_offsets(data: bytes) -> list[int]:
    """Start of every gzip member, then the end of the file."""
    import zlib

    offsets, pos = [0], 0
    while pos < len(data):
        d = zlib.decompressobj(31)
        d.decompress(data[pos:])
        pos = len(data) - len(d.unused_data)
        offsets.append(pos)
    return offsets


def _request_and_response_warc(path: Path, n: int = 8) -> None:
    """Request/response pairs, as a crawler writes them (request records are no documents)."""
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        for i in range(n):
            url = f"http://cut.example.org/page{i}"
            writer.write_record(writer.create_warc_record(
                url, "request", payload=io.BytesIO(f"GET /page{i} HTTP/1.1\r\n\r\n".encode())))
            words = " ".join(f"word{i}x{j}" for j in range(300))
            http_response(writer, url, html(f"<p>Page {i} of the town archive: {words}.</p>").encode())


def _cut_cases(seed: int = 20251203, per_file: int = 4) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    files = ["built"] + (["dolma/sample-0000.warc.gz", "resiliparse/warcfile.warc.gz"] if WARC_DATA.is_dir() else [])
    return [(name, round(rng.uniform(0.05, 0.95), 3)) for name in files for _ in range(per_file)] + [
        (name, 0.3) for name in files]


@pytest.mark.parametrize("name, fraction", _cut_cases())
def test_file_cut_inside_a_gzip_member_is_reported_and_the_cut_record_quarantined(tmp_path, name, fraction):
    """A .warc.gz cut part-way into one record's gzip member (a download or copy that
    stopped): every record before the member is read as from the whole file, the file is
    reported naming itself and the member's offset, and the cut record is one quarantine
    row (``extract:truncated_record``), whether the cut falls in its headers or its body."""
    source = tmp_path / "whole.warc.gz"
    if name == "built":
        _request_and_response_warc(source)
    else:
        source.write_bytes((WARC_DATA / name).read_bytes())
    data = source.read_bytes()
    offsets = _member_offsets(data)
    rng = random.Random(f"{name}:{fraction}")
    member = rng.randrange(1, len(offsets) - 1)
    start, end = offsets[member], offsets[member + 1]
    cut_at = start + max(1, int((end - start) * fraction))
    path = tmp_path / "cut.warc.gz"
    path.write_bytes(data[:cut_at])

    whole = list(WarcReader().run(str(source)))
    prefix_path = tmp_path / "prefix.warc.gz"  # the members before the cut one, intact
    prefix_path.write_bytes(data[:start])
    prefix_reader = WarcReader()
    prefix = list(prefix_reader.run(str(prefix_path)))
    assert prefix_reader.file_errors == []
    reader = WarcReader()
    docs = list(reader.run(str(path)))

    [failure] = reader.file_errors
    assert failure["path"] == str(path) and failure["records_read"] >= len(docs)
    assert f"ends at byte {cut_at}" in failure["error"] and f"record starting at byte {start}" in failure["error"]
    assert reader.stats["dropped:truncated_record"] == 1
    # Every record before the cut member reads as from the whole file; the cut record is
    # one quarantine row, last.
    *before, cut_row = docs
    assert cut_row["drop_reason"] == "extract:truncated_record" and cut_row["source"] == "cut.warc.gz"
    key = lambda d: (d["id"], d["url"], d["text"], d["drop_reason"])  # noqa: E731
    assert [key(d) for d in before] == [key(d) for d in prefix] == [key(d) for d in whole[: len(prefix)]]
    # A cut document whose headers were read keeps its id (and what of its text was read).
    if cut_row["url"] and cut_row["record_type"] == "response":
        assert cut_row["id"] == whole[len(prefix)]["id"]
        # What was read of its text begins the whole text, unless the body was cut inside its
        # first tag (the extractor then sees a bare "<").
        assert whole[len(prefix)]["text"].startswith(cut_row["text"][:200]) or cut_row["text"].strip() == "<"


def test_a_page_under_two_urls_gives_two_documents_with_one_text(tmp_path, monkeypatch):
    from crawl2chat.stages.data import extract

    calls = []
    real = extract.html_to_text
    monkeypatch.setattr(extract, "html_to_text", lambda h, e="resiliparse": calls.append(e) or real(h, e))
    page = html(GERMAN + "<p>Eine Seite, zwei Adressen, einmal gelesen.</p>").encode("utf-8")
    path = tmp_path / "twice.warc.gz"
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        http_response(writer, "http://example.com/page?utm_source=a", page, [("Content-Type", "text/html; charset=utf-8")])
        http_response(writer, "https://example.com/page", page, [("Content-Type", "text/html; charset=utf-8")])
    docs = kept(WarcReader(ExtractConfig(min_text_chars=10)).run(str(path)))
    assert [d["url"] for d in docs] == ["http://example.com/page?utm_source=a", "https://example.com/page"]
    assert docs[0]["id"] != docs[1]["id"]
    assert docs[0]["text"] == docs[1]["text"] and "zwei Adressen" in docs[0]["text"]
    assert len(calls) == 1
