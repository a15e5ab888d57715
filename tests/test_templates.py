"""Site template lines: a header or footer repeated on most of a host's pages is
removed from each of them (in any language), page content and other hosts stay,
and the extract step does it on real pages of the embedded documentation site."""

from __future__ import annotations

import io
import unicodedata
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from crawl2chat.stages.data.templates import strip_template_lines


def _pages(host: str, header: list[str], bodies: list[str]) -> list[dict]:
    return [{"host": host, "drop_reason": None, "text": "\n".join(header + [body, "© 2024 " + host])}
            for body in bodies]


def test_lines_on_most_pages_of_a_host_are_removed_in_any_language():
    de = _pages("nachrichten.de", ["Startseite : Politik : Wirtschaft", "Anmelden"],
                [f"Der Stadtrat beschloss am {i}. Mai einen neuen Haushalt für die Schulen." for i in range(6)])
    zh = _pages("新闻.cn", ["首页 ｜ 新闻 ｜ 体育"],
                [f"市政府第{i}次会议讨论了城市交通和公共住房的问题。" for i in range(5)])
    # Four of the five pages share a "related" line: a share of 0.8 is still template.
    for doc in zh[:4]:
        doc["text"] += "\n相关文章"
    few = _pages("small.example", ["Home | About"], ["One page.", "Another page."])  # too few pages to judge
    dropped = {"host": "nachrichten.de", "drop_reason": "langid:low_score", "text": "Startseite : Politik : Wirtschaft"}
    docs = de + zh + few + [dropped]

    removed = strip_template_lines(docs, min_pages=5, min_share=0.5)

    assert [d["text"] for d in de] == [f"Der Stadtrat beschloss am {i}. Mai einen neuen Haushalt für die Schulen."
                                       for i in range(6)]
    assert all(d["template_lines"] == 3 for d in de)
    assert [d["text"] for d in zh] == [f"市政府第{i}次会议讨论了城市交通和公共住房的问题。" for i in range(5)]
    assert [d["template_lines"] for d in zh] == [3, 3, 3, 3, 2]
    assert [d["text"] for d in few] == ["Home | About\nOne page.\n© 2024 small.example",
                                        "Home | About\nAnother page.\n© 2024 small.example"]
    assert dropped["text"] == "Startseite : Politik : Wirtschaft" and "template_lines" not in dropped
    assert removed == 6 * 3 + 4 * 3 + 2


def test_a_line_repeated_on_a_minority_of_pages_stays():
    docs = _pages("docs.example", [], [f"Chapter {i} text." for i in range(10)])
    for doc in docs[:4]:
        doc["text"] += "\nSee also: the tutorial."
    strip_template_lines(docs, min_pages=5, min_share=0.5)
    assert sum("See also: the tutorial." in d["text"] for d in docs) == 4
    assert all("© 2024 docs.example" not in d["text"] for d in docs)


def test_extract_step_removes_the_documentation_sites_banner(ray_local, tmp_path):
    from crawl2chat.stages.data import pipeline as steps
    from crawl2chat.stages.data.local_site import PydocSite
    from crawl2chat.stages.settings import load_config

    modules = ["json", "csv", "glob", "shlex", "textwrap", "string", "bisect", "heapq"]
    warc = tmp_path / "in" / "docs.warc.gz"
    warc.parent.mkdir()
    with PydocSite() as site, open(warc, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        for name in modules:
            url = f"{site.url}{name}.html"
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=60) as resp:
                body = resp.read()
            http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(body),
                                                          length=len(body), http_headers=http))

    def extract(out: Path, **overrides):
        cfg = load_config(overrides={f"data.extract.{k}": v for k, v in overrides.items()})
        result = steps.extract_step([str(warc)], str(out), cfg.data.extract)
        rows = pq.read_table(sorted(Path(result.out_dir).glob("*.parquet"))).to_pylist()
        return result, [r for r in rows if r["record_type"] != steps.FILE_STATUS]

    result, pages = extract(tmp_path / "default")
    assert len(pages) == len(modules) and all(p["drop_reason"] is None for p in pages)
    assert not any("Module Index : Topics : Keywords" in p["text"] for p in pages)
    assert all(p["template_lines"] >= 2 for p in pages)
    assert result.extra["files"][0]["template_lines"] == sum(p["template_lines"] for p in pages)
    json_page = next(p for p in pages if p["url"].endswith("/json.html"))
    # The page's own content stays (pydoc spaces words with &nbsp;, which the tokenizer's NFKC maps to spaces).
    assert "JSON (JavaScript Object Notation)" in unicodedata.normalize("NFKC", json_page["text"])

    _, untouched = extract(tmp_path / "off", template_min_share=None)
    assert all("Module Index : Topics : Keywords" in p["text"] for p in untouched)
