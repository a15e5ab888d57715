"""A page's life across refreshes: rewritten, reverted, deleted, unlinked, turned into a copy.

A real site on 127.0.0.1 is crawled and refreshed with `data_flow` (real Prefect
runs); after each refresh the documents readers get (`iter_documents`, what
training reads) must be the site as it is now, one document per page. Then two
captures of one URL in one build (two WARC files of a crawl stopped and rerun, or
two snapshots): only the newer is kept.
"""

from __future__ import annotations

import io
import shutil
import uuid

import pytest
from aiohttp import web
from test_crawl import LocalServer
from test_refresh import Site, page_text
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from crawl2chat.stages.data.versions import iter_documents
from crawl2chat.stages.settings import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class ChangingSite(Site):
    """``Site`` whose index links only ``linked`` pages (all of them by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.pages.update({f"/page{i}": page_text(i) for i in range(5, 7)})
        self.linked: set[str] | None = None

    def body(self, path: str) -> str:
        if path == "/":
            shown = sorted(p for p in self.pages if self.linked is None or p in self.linked)
            return "<html><body>" + "".join(f'<a href="{p}">{p}</a> ' for p in shown) + "</body></html>"
        return super().body(path)


def current(out) -> dict[str, str]:
    """URL path -> text of the documents readers get; fails on a URL held twice."""
    rows = list(iter_documents(out, ["url", "text"]))
    paths = [row["url"].split("/", 3)[3] for row in rows]
    assert len(paths) == len(set(paths)), sorted(paths)
    return {"/" + p: row["text"] for p, row in zip(paths, rows)}


def starts(html: str) -> str:
    return html[len("<p>"):][:40]


def test_the_current_version_holds_each_page_as_the_site_has_it_now(prefect_api, tmp_path):
    from crawl2chat.flows.data import data_flow

    site = ChangingSite()
    out = tmp_path / "data"
    with LocalServer([web.get("/{tail:.*}", site.handle)]) as server:
        cfg = load_config(overrides={
            "home": str(tmp_path / "home"), "data.out": str(out), "data.seed_urls": [server.url + "/"],
            "data.crawl.per_host_delay_s": 0.0, "data.crawl.respect_robots": False, "data.engine": "local",
        })
        first = data_flow(cfg)
        v1 = current(out)

        # page1 rewritten; page2 deleted but still linked; page3 deleted and unlinked;
        # page4 unlinked but still there.
        old_page1 = site.pages["/page1"]
        site.pages["/page1"] = page_text(101)
        del site.pages["/page2"], site.pages["/page3"]
        site.linked = {"/page0", "/page1", "/page2", "/page5", "/page6"}
        second = data_flow(cfg, refresh=True)
        v2 = current(out)

        # page1 back to its first text (the first version's copy of it was superseded).
        site.pages["/page1"] = old_page1
        third = data_flow(cfg, refresh=True)
        v3 = current(out)

        # page5 becomes a copy of page0.
        site.pages["/page5"] = site.pages["/page0"]
        fourth = data_flow(cfg, refresh=True)
        v4 = current(out)

        # A full build (no refresh) over every WARC file the crawls wrote: the same texts.
        fifth = data_flow(cfg)
        v5 = current(out)

    assert sorted(v1) == [f"/page{i}" for i in range(7)], first["drop_reasons"]

    assert "/page2" not in v2 and "/page3" not in v2, sorted(v2)
    assert "/page4" in v2  # unlinked, still on the site: asked for, unchanged
    assert v2["/page1"].startswith(starts(page_text(101)))
    assert second["version_documents_superseded"] == 3  # page1's old text, page2, page3
    assert second["drop_reasons"].get("extract:http_status_404") == 2
    assert second["content_digest"] != first["content_digest"]

    assert v3["/page1"].startswith(starts(old_page1)), v3["/page1"][:60]
    assert sorted(v3) == sorted(v2)

    assert "/page5" not in v4 and v4["/page0"].startswith(starts(page_text(0)))
    assert sorted(v4) == ["/page0", "/page1", "/page4", "/page6"]
    assert fourth["documents_kept"] == 4, fourth

    # (Of page0 and page5, now one text, a build of its own keeps either.)
    assert fifth["base_version"] is None and sorted(v5.values()) == sorted(v4.values()), sorted(v5)
    # page1's first two texts, page2 and page3 before their 404s, page5 before it became a copy
    assert fifth["drop_reasons"].get("dedup:older_capture") == 5


def capture(writer: WARCWriter, url: str, html: str, date: str, n: int) -> None:
    body = f"<html><body>{html}</body></html>".encode()
    http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
    writer.write_record(writer.create_warc_record(
        url, "response", payload=io.BytesIO(body), length=len(body), http_headers=http,
        warc_headers_dict={"WARC-Record-ID": f"<urn:uuid:{uuid.UUID(int=n)}>", "WARC-Date": date}))


def test_two_captures_of_a_page_in_one_build_keep_the_newer(prefect_api, tmp_path):
    from crawl2chat.flows.data import data_flow

    inputs, out = tmp_path / "in", tmp_path / "data"
    inputs.mkdir()
    # The newer capture is in the first file: the order of the files does not decide.
    with open(inputs / "a.warc.gz", "wb") as f:
        w = WARCWriter(f, gzip=True)
        capture(w, "http://town.example.org/news", page_text(202), "2024-06-01T00:00:00Z", 1)
        capture(w, "http://town.example.org/other", page_text(203), "2024-05-01T00:00:00Z", 2)
    with open(inputs / "b.warc.gz", "wb") as f:
        w = WARCWriter(f, gzip=True)
        capture(w, "http://town.example.org/news", page_text(201), "2024-05-01T00:00:00Z", 3)
    cfg = load_config(overrides={"home": str(tmp_path / "home"), "data.out": str(out),
                                 "data.inputs": [str(inputs)], "data.engine": "local"})
    manifest = data_flow(cfg)
    docs = current(out)
    assert sorted(docs) == ["/news", "/other"], manifest["drop_reasons"]
    assert docs["/news"].startswith(starts(page_text(202)))
    assert manifest["drop_reasons"].get("dedup:older_capture") == 1


class TemplatedSite(Site):
    """Every page carries the site's template in plain ``<div>``s (no header/nav/footer
    markup an extractor would drop by itself)."""

    LINES = ("If you enjoyed this story, please support the town paper with a small donation today.",
             "All stories on this website are written by local correspondents and edited in the valley.")

    def body(self, path: str) -> str:
        html = super().body(path)
        if path == "/":
            return html
        chrome = "".join(f"<div>{line}</div>" for line in self.LINES)
        return html.replace("<body>", "<body>" + chrome).replace("</body>", chrome + "</body>")


def test_a_refresh_of_a_few_pages_removes_the_site_template_its_versions_found(prefect_api, tmp_path):
    from crawl2chat.flows.data import data_flow
    from crawl2chat.stages.data.versions import load_site_templates, read_manifest

    site = TemplatedSite()
    out = tmp_path / "data"
    with LocalServer([web.get("/{tail:.*}", site.handle)]) as server:
        def settings(out):
            return load_config(overrides={
                "home": str(tmp_path / "home"), "data.out": str(out), "data.seed_urls": [server.url + "/"],
                "data.crawl.per_host_delay_s": 0.0, "data.crawl.respect_robots": False, "data.engine": "local",
            })
        cfg = settings(out)
        first = data_flow(cfg)
        site.pages["/page1"] = page_text(111)  # one changed page: a window too small to judge
        second = data_flow(cfg, refresh=True)
        # The data folder copied elsewhere: its refresh still knows which WARC files it has read.
        moved = tmp_path / "moved" / "data"
        shutil.copytree(out, moved)
        third = data_flow(settings(moved), refresh=True)

    assert first["documents_kept"] == 5, first["drop_reasons"]
    (lines,) = load_site_templates(out, read_manifest(out, "v0001")).values()  # one host
    assert set(TemplatedSite.LINES) <= set(lines)
    assert second["version_documents_kept"] == 1, second["drop_reasons"]
    texts = current(out)
    assert texts["/page1"].startswith(starts(page_text(111))), texts["/page1"][:120]
    for path, text in texts.items():
        assert not any(line in text for line in TemplatedSite.LINES), (path, text[-200:])
    assert load_site_templates(out, read_manifest(out)) == load_site_templates(out, read_manifest(out, "v0001"))
    extract = next(s for s in third["steps"] if s["name"] == "extract")
    assert extract["rows_in"] == 0 and not third["drop_reasons"], (extract, third["drop_reasons"])
    assert third["documents_kept"] == second["documents_kept"] == 5
