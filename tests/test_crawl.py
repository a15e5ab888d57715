"""The crawler against real HTTP servers on 127.0.0.1 (aiohttp.web in a thread, and pydoc)."""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import hashlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
import zlib
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from warcio.archiveiterator import ArchiveIterator

from crawl2chat.stages.data import crawl as crawl_module
from crawl2chat.stages.data.crawl import (
    AddressPolicy,
    BlockedAddressError,
    BodyDecoder,
    Crawler,
    CrawlResult,
    CrawlScope,
    PolicyResolver,
    RotatingWarcWriter,
    crawl,
    extract_links,
    is_public_address,
    parse_retry_after,
)
from crawl2chat.stages.data.local_site import PydocSite
from crawl2chat.stages.data.settings import CrawlConfig
from crawl2chat.stages.data.urls import normalize_url

pytestmark = pytest.mark.timeout(120)


class LocalServer:
    """An aiohttp.web application served on 127.0.0.1 (port 0) from a background thread.

    ``requests`` logs (path, monotonic start time) of every request as the
    server saw it, for assertions about what the crawler asked for and when.
    """

    def __init__(self, routes: list[web.RouteDef]) -> None:
        self.requests: list[tuple[str, float]] = []
        self.routes = routes
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @web.middleware
    async def _log(self, request: web.Request, handler):  # type: ignore[no-untyped-def]
        self.requests.append((request.path_qs, time.monotonic()))
        return await handler(request)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._log])
        app.add_routes(self.routes)
        # A short shutdown_timeout: the slow handler is still sleeping when a test ends.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "LocalServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


def html(*links: str, text: str = "") -> web.Response:
    body = "<html><body>" + text + "".join(f'<a href="{href}">{href}</a> ' for href in links) + "</body></html>"
    return web.Response(text=body, content_type="text/html")


def warc_records(result: CrawlResult) -> list[tuple[str, str | None, int | None, bytes]]:
    """(record type, target URI, HTTP status, payload) of every record this crawl wrote."""
    records = []
    for path in result.warc_paths:
        with open(path, "rb") as fh:
            for record in ArchiveIterator(fh):
                status = int(record.http_headers.get_statuscode()) if record.rec_type == "response" else None
                records.append(
                    (record.rec_type, record.rec_headers.get_header("WARC-Target-URI"), status, record.content_stream().read())
                )
    return records


def quick_config(seed: str, **overrides: object) -> CrawlConfig:
    settings: dict[str, object] = dict(seed_urls=[seed], per_host_delay_s=0.0, request_timeout_s=5.0, global_concurrency=4)
    settings.update(overrides)
    return CrawlConfig(**settings)


# ----------------------------------------------------------------------------- one site, many behaviours


@pytest.fixture(scope="module")
def other_host():
    """A second site on "localhost": links to it are off-domain for a crawl of 127.0.0.1."""

    async def page(request: web.Request) -> web.Response:
        return html()

    with LocalServer([web.get("/{tail:.*}", page)]) as server:
        yield server


@pytest.fixture(scope="module")
def mixed_site(other_host, tmp_path_factory):
    """A site exercising robots, redirects, errors, timeouts, content types and size limits, crawled once."""
    port = other_host.url.rsplit(":", 1)[1]
    offsite = f"http://localhost:{port}/offsite"

    async def robots(request: web.Request) -> web.Response:
        return web.Response(text="User-agent: *\nDisallow: /private/\n")

    async def home(request: web.Request) -> web.Response:
        return html(
            "/a#section", "a", "/private/secret", "/redir/start", "/loop/0", "/self", "/missing", "/boom",
            "/slow", "/data.json", "/big", "/plain.txt", offsite, "mailto:someone@example.org",
            "javascript:void(0)", "/gz",
        )

    async def page_a(request: web.Request) -> web.Response:
        return html("/", text="<p>Page A about the crawler.</p>")

    async def secret(request: web.Request) -> web.Response:
        return html(text="never fetched")

    async def redir_start(request: web.Request) -> web.Response:
        raise web.HTTPFound("/redir/hop")

    async def redir_hop(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("/landing")

    async def landing(request: web.Request) -> web.Response:
        return html(text="<p>Landed after two redirects.</p>")

    async def loop(request: web.Request) -> web.Response:
        # An endless chain of distinct URLs: only the redirect cap ends it.
        raise web.HTTPFound(f"/loop/{int(request.match_info['n']) + 1}")

    async def self_redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/self")

    async def gz(request: web.Request) -> web.Response:
        response = html("/gz-child", text="<p>Sent gzip-compressed.</p>")
        response.enable_compression(web.ContentCoding.gzip)
        return response

    async def gz_child(request: web.Request) -> web.Response:
        return html(text="<p>Found through a compressed page.</p>")

    async def boom(request: web.Request) -> web.Response:
        raise web.HTTPInternalServerError()

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return html(text="too late")

    async def data(request: web.Request) -> web.Response:
        return web.json_response({"not": "html"})

    async def big(request: web.Request) -> web.Response:
        return web.Response(text="<html><body>" + "x" * 50_000 + "</body></html>", content_type="text/html")

    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="Plain text is a page too.", content_type="text/plain")

    routes = [
        web.get("/robots.txt", robots), web.get("/", home), web.get("/a", page_a),
        web.get("/private/secret", secret), web.get("/redir/start", redir_start),
        web.get("/redir/hop", redir_hop), web.get("/landing", landing), web.get("/loop/{n}", loop),
        web.get("/self", self_redirect),
        web.get("/boom", boom), web.get("/slow", slow), web.get("/data.json", data),
        web.get("/big", big), web.get("/plain.txt", plain), web.get("/gz", gz), web.get("/gz-child", gz_child),
    ]
    with LocalServer(routes) as server:
        cfg = quick_config(server.url + "/", request_timeout_s=1.0, max_page_bytes=10_000, max_redirects=3)
        out_dir = tmp_path_factory.mktemp("mixed")
        result = crawl(cfg, out_dir)
        yield server, result, out_dir


def test_robots_disallow_is_honoured(mixed_site):
    server, result, _ = mixed_site
    assert "/private/secret" not in server.paths()
    assert server.paths().count("/robots.txt") == 1
    assert result.skipped["robots"] == 1


def test_redirects_followed_and_loop_capped(mixed_site):
    server, result, _ = mixed_site
    assert server.url + "/landing" in result.changed_urls
    assert result.skipped["redirect_limit"] == 1
    # max_redirects=3: the first request plus three hops, then the crawler gives up.
    assert [p for p in server.paths() if p.startswith("/loop/")] == ["/loop/0", "/loop/1", "/loop/2", "/loop/3"]
    assert (server.url + "/loop/0", "redirect_limit") in result.errors
    # A redirect back to a URL the crawl already has is not fetched again.
    assert server.paths().count("/self") == 1
    assert result.skipped["redirect_seen"] == 1


def test_http_errors_and_timeout_counted(mixed_site):
    _, result, _ = mixed_site
    assert result.skipped["http_404"] == 1
    assert result.skipped["http_500"] == 1
    assert result.skipped["timeout"] == 1
    assert (mixed_site[0].url + "/slow", "timeout") in result.errors


def test_content_type_and_size_limits(mixed_site):
    server, result, _ = mixed_site
    assert result.skipped["content_type"] == 1
    assert result.skipped["too_large"] == 1
    stored = {uri for kind, uri, _, _ in warc_records(result) if kind == "response"}
    assert server.url + "/data.json" not in stored
    assert server.url + "/big" not in stored
    assert server.url + "/plain.txt" in stored


def test_off_domain_links_not_followed(mixed_site, other_host):
    _, result, _ = mixed_site
    assert result.skipped["off_domain"] == 1
    assert other_host.requests == []


def test_warc_holds_request_response_pairs(mixed_site):
    server, result, out_dir = mixed_site
    records = warc_records(result)
    responses = {uri: payload for kind, uri, status, payload in records if kind == "response" and status == 200}
    requests = [uri for kind, uri, _, _ in records if kind == "request"]
    expected = {server.url + p for p in ("/", "/a", "/landing", "/plain.txt", "/gz", "/gz-child")}
    assert set(responses) == expected
    assert sorted(requests) == sorted(responses)
    assert b"Page A about the crawler." in responses[server.url + "/a"]
    # The gzip body is stored as sent; warcio undoes the Content-Encoding on reading.
    assert b"Sent gzip-compressed." in responses[server.url + "/gz"]
    assert result.pages_fetched == 6
    assert all(Path(p).name.startswith("crawl-") and p.endswith(".warc.gz") for p in result.warc_paths)
    assert not list((out_dir / "warc").glob("*.tmp"))
    report = json.loads((out_dir / "crawl_report.json").read_text())
    assert report["pages_fetched"] == 6 and report["skipped"] == result.skipped


# ----------------------------------------------------------------------------- limits


def chain_routes(length: int) -> list[web.RouteDef]:
    """Pages /p0 -> /p1 -> ... each linking to the next; /p0 also fans out to /f0../f9."""

    async def page(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        links = [f"/p{n + 1}"] if n + 1 < length else []
        if n == 0:
            links += [f"/f{i}" for i in range(10)]
        return html(*links)

    async def fan(request: web.Request) -> web.Response:
        return html()

    async def no_robots(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    return [web.get("/robots.txt", no_robots), web.get("/p{n:\\d+}", page), web.get("/f{n:\\d+}", fan)]


def test_depth_limit(tmp_path):
    with LocalServer(chain_routes(6)) as server:
        result = crawl(quick_config(server.url + "/p0", max_depth=2), tmp_path)
        fetched = set(server.paths()) - {"/robots.txt"}
    assert fetched == {"/p0", "/p1", "/p2"} | {f"/f{i}" for i in range(10)}
    assert result.pages_fetched == 13
    assert result.skipped["depth"] == 1  # /p3, the first link beyond depth 2


def test_a_signal_raised_inside_a_fetch_stops_the_crawl(tmp_path, monkeypatch):
    """SIGTERM's exception (Prefect's TerminationSignal, a BaseException) can land while a
    worker task runs Python code rather than while the loop waits: asyncio keeps such an
    exception on the task, and the other workers used to crawl the whole site on. The crawl
    now raises it: no page is asked for after it, and what was written is committed."""
    from prefect.exceptions import TerminationSignal

    follow = crawl_module.Crawler._follow
    visits = []

    async def signal_at_the_third(self, url, depth):
        visits.append(url)
        if len(visits) == 3:
            raise TerminationSignal(signal=signal.SIGTERM)  # as the signal handler raises it, here
        return await follow(self, url, depth)

    monkeypatch.setattr(crawl_module.Crawler, "_follow", signal_at_the_third)
    with LocalServer(chain_routes(6)) as server:
        with pytest.raises(TerminationSignal):
            crawl(quick_config(server.url + "/p0", global_concurrency=2), tmp_path)
        asked = [p for p in server.paths() if p != "/robots.txt"]
    assert len(asked) <= 3, asked  # the ones in flight; nothing after the signal
    assert json.loads((tmp_path / "crawl_state.json").read_text())  # what was written is committed


def test_warc_files_rotate(tmp_path):
    with LocalServer(chain_routes(3)) as server:
        result = crawl(quick_config(server.url + "/p0", warc_max_bytes=1), tmp_path)
    assert result.pages_fetched == 13
    assert len(result.warc_paths) == 13  # every request/response pair overflows its file
    assert sorted(result.warc_paths) == sorted(str(p) for p in (tmp_path / "warc").glob("*.warc.gz"))
    assert sum(1 for kind, *_ in warc_records(result) if kind == "response") == 13


def test_max_total_bytes_stops_queueing(tmp_path):
    with LocalServer(chain_routes(3)) as server:
        result = crawl(quick_config(server.url + "/p0", max_total_bytes=1, global_concurrency=1), tmp_path)
    assert result.pages_fetched == 1
    assert result.skipped["max_total_bytes"] == 11  # /p1 and /f0../f9


def test_max_total_bytes_holds_for_pages_already_waiting_for_the_host(tmp_path):
    """Pages queued before the budget ran out and waiting at the politeness gate are not
    fetched once it has: the crawl goes over by at most the requests in flight."""
    with LocalServer(chain_routes(3)) as server:
        first_page = crawl(quick_config(server.url + "/p0", max_pages=1, global_concurrency=1), tmp_path / "one")
        cfg = quick_config(server.url + "/p0", max_total_bytes=first_page.bytes_fetched + 1, global_concurrency=16,
                           per_host_concurrency=2, per_host_delay_s=0.05)
        result = crawl(cfg, tmp_path / "all")
    # /p0, then at most the two requests in flight when the budget ran out (11 were queued).
    assert result.pages_fetched <= 3
    assert result.skipped["max_total_bytes"] >= 9


def test_exclude_patterns_hold_for_redirect_targets(tmp_path):
    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/skip/page")

    async def page(request: web.Request) -> web.Response:
        return html("/go", text="a page")

    with LocalServer([web.get("/", page), web.get("/go", moved), web.get("/skip/page", page)]) as server:
        result = crawl(quick_config(server.url + "/", exclude_url_patterns=["/skip/"]), tmp_path)
        assert "/skip/page" not in server.paths()
    assert result.pages_fetched == 1 and result.skipped["excluded"] == 1


def test_pages_that_failed_for_a_passing_reason_are_asked_for_again(tmp_path, capsys):
    """The data stage's crawl task: a page the site could not serve (503 after the retries)
    is on the done marker's retry list; the next run asks for it alone, follows its links,
    and stores what it gives in a new WARC file; the run after that has nothing to ask."""
    import mlflow

    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.tasks.data import CRAWL_MARKER, crawl_task

    down = {"/a"}

    async def page(request: web.Request) -> web.Response:
        if request.path in down:
            raise web.HTTPServiceUnavailable()
        links = {"/": ["/a", "/b"], "/a": ["/c"]}.get(request.path, [])
        return html(*links, text=f"page {request.path}")

    setup_tracking(tmp_path, "crawl", f"sqlite:///{tmp_path / 'mlflow.db'}")
    routes = [web.get(p, page) for p in ("/", "/a", "/b", "/c")]
    try:
        with LocalServer(routes) as server:
            cfg = quick_config(server.url + "/", max_retries=0)
            first = crawl_task.fn(cfg, str(tmp_path / "out"))
            marker = json.loads((tmp_path / "out" / "crawl" / CRAWL_MARKER).read_text())
            assert marker["retry"] == [[server.url + "/a", 1]]
            assert "1 pages could not be fetched for now; the next run asks for them again" in capsys.readouterr().out
            down.clear()
            asked = len(server.requests)
            second = crawl_task.fn(cfg, str(tmp_path / "out"))
            assert sorted(server.paths()[asked:]) == ["/a", "/c", "/robots.txt"]  # robots.txt read afresh
            assert "asking again for the 1 pages the last crawl could not fetch" in capsys.readouterr().out
            asked = len(server.requests)
            assert crawl_task.fn(cfg, str(tmp_path / "out")) == second
            assert server.paths()[asked:] == []
    finally:
        mlflow.set_tracking_uri(None)
    (added,) = set(second) - set(first)
    with open(added, "rb") as fh:
        stored = [r.rec_headers.get_header("WARC-Target-URI") for r in ArchiveIterator(fh) if r.rec_type == "response"]
    assert sorted(stored) == [server.url + "/a", server.url + "/c"]
    assert json.loads((tmp_path / "out" / "crawl" / CRAWL_MARKER).read_text())["retry"] == []


TEXT = ("Tomatoes need a sunny place and water at the roots in the morning, not on the leaves. Beans climb "
        "whatever they find, so give them poles before they start. Lettuce grows quickly in spring and turns "
        "bitter in the heat of summer, when it flowers. Carrots like loose soil without stones; in heavy clay "
        "they split and fork. Mulch keeps the ground moist and the weeds down, and worms turn it into soil over "
        "the winter. A small pond brings frogs, and frogs eat the slugs that would otherwise eat the seedlings.")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_data_command_commits_its_crawl_state_with_its_warc_files(tmp_path, sig):
    """SIGTERM or Ctrl-C to ``crawl2chat data`` mid-crawl: the pages written so far and the
    state that knows them commit together, so the rerun sends conditional requests for
    them and stores no page twice."""
    count = 30

    async def page(request: web.Request) -> web.Response:
        n = int(request.match_info["n"] or 0)
        body = (f"<html><body><p>This is page {n} of a small site about gardens. {TEXT}</p>"
                + "".join(f'<a href="/{i}">{i}</a>' for i in range(count)) + "</body></html>")
        etag = f'"p{n}"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(text=body, content_type="text/html", headers={"ETag": etag})

    async def no_robots(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    command = [str(Path(sys.executable).parent / "crawl2chat"), "data", "--out", "out"]
    with LocalServer([web.get("/robots.txt", no_robots), web.get("/{n:\\d*}", page)]) as server:
        command += ["--seed-url", server.url + "/", "--set", "data.crawl.per_host_delay_s=0.15",
                    "--set", "data.crawl.per_host_concurrency=1", "--set", "data.crawl.checkpoint_pages=1000"]
        # Ctrl-C reaches the command as in a terminal, even when this test runs in the background
        # (a background job's children start with SIGINT ignored).
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 120
        while len(server.requests) < 10 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        # One sentence, the shell's status for the signal, and the MLflow runs closed as killed.
        assert proc.returncode == 128 + sig, out.decode()[-2000:]
        assert out.decode().strip().splitlines()[-1] == (
            f"stopped ({signal.Signals(sig).name}); rerunning the same command resumes where it stopped")
        import mlflow

        client = mlflow.MlflowClient(f"sqlite:///{tmp_path / '.crawl2chat' / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert runs and {r.info.status for r in runs} == {"KILLED"}
        crawl_dir = tmp_path / "out" / "crawl"
        state = json.loads((crawl_dir / "crawl_state.json").read_text())

        def responses() -> list[str]:
            uris = []
            for path in sorted((crawl_dir / "warc").glob("*.warc.gz")):
                with open(path, "rb") as fh:
                    uris += [r.rec_headers.get_header("WARC-Target-URI") for r in ArchiveIterator(fh)
                             if r.rec_type == "response"]
            return uris

        stored = responses()
        assert 0 < len(stored) < count and sorted(stored) == sorted(state)
        asked = len(server.requests)
        rerun = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert sorted(responses()) == sorted({server.url + "/"} | {f"{server.url}/{i}" for i in range(count)})
    assert len(server.requests) - asked == count + 2  # robots.txt, /, /0 .. /29: each page asked for once
    assert not list((crawl_dir / "warc").glob("*.tmp"))


def test_max_pages_limit(tmp_path):
    with LocalServer(chain_routes(6)) as server:
        result = crawl(quick_config(server.url + "/p0", max_pages=5), tmp_path)
        fetched = [p for p in server.paths() if p != "/robots.txt"]
    assert result.pages_fetched == 5
    assert len(fetched) == 5
    # Every URL discovered but not fetched was counted under max_pages.
    state = json.loads((tmp_path / "crawl_state.json").read_text())
    discovered = {server.url + "/p0"} | {link for entry in state.values() for link in entry["outlinks"]}
    assert result.skipped["max_pages"] == len(discovered) - 5 > 0


# ----------------------------------------------------------------------------- incremental re-crawl


def test_second_crawl_sends_conditional_requests(tmp_path):
    pages = {"/": '<a href="/a">a</a> <a href="/b">b</a>', "/a": "first page", "/b": '<a href="/c">c</a> old'}
    pages["/c"] = "only reachable through b"

    async def page(request: web.Request) -> web.Response:
        body = f"<html><body>{pages[request.path]}</body></html>"
        etag = '"' + hashlib.sha1(body.encode()).hexdigest()[:16] + '"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(text=body, content_type="text/html", headers={"ETag": etag})

    with LocalServer([web.get(p, page) for p in pages]) as server:
        first = crawl(quick_config(server.url + "/"), tmp_path)
        assert sorted(first.changed_urls) == sorted(server.url + p for p in pages)
        pages["/b"] = '<a href="/c">c</a> new text'
        second = crawl(quick_config(server.url + "/"), tmp_path)

    assert second.changed_urls == [server.url + "/b"]
    assert second.pages_not_modified == 3  # /, /a and /c, reached through the stored outlinks of /
    assert second.pages_fetched == 1
    records = warc_records(second)
    assert [(kind, uri) for kind, uri, _, _ in records if kind == "response"] == [("response", server.url + "/b")]
    assert sorted(uri for kind, uri, _, _ in records if kind == "revisit") == sorted(
        server.url + p for p in ("/", "/a", "/c")
    )
    assert set(first.warc_paths).isdisjoint(second.warc_paths)
    state = json.loads((tmp_path / "crawl_state.json").read_text())
    assert set(state) == {server.url + p for p in pages}
    assert state[server.url + "/"]["outlinks"] == [server.url + "/a", server.url + "/b"]


def test_unchanged_payload_without_validators_is_a_revisit(tmp_path):
    """A server that sends no ETag/Last-Modified: the payload digest decides what changed."""
    with LocalServer(chain_routes(1)) as server:
        first = crawl(quick_config(server.url + "/p0"), tmp_path)
        second = crawl(quick_config(server.url + "/p0"), tmp_path)
    assert len(first.changed_urls) == first.pages_fetched == 11
    assert second.pages_fetched == 11 and second.pages_not_modified == 0
    assert second.changed_urls == []
    kinds = [kind for kind, *_ in warc_records(second)]
    assert kinds.count("revisit") == 11 and "response" not in kinds


# ----------------------------------------------------------------------------- politeness


def test_per_host_delay_measured_by_server(tmp_path):
    with LocalServer(chain_routes(3)) as server:
        cfg = quick_config(server.url + "/p0", per_host_concurrency=1, per_host_delay_s=0.05, global_concurrency=8)
        result = crawl(cfg, tmp_path)
        starts = [t for _, t in server.requests]
    assert result.pages_fetched == 13
    assert len(starts) == 14  # robots.txt + 13 pages
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:])]
    assert min(gaps) >= 0.05


def test_robots_crawl_delay_wins_over_configured_delay(tmp_path):
    async def robots(request: web.Request) -> web.Response:
        # Fractions of a second are honoured.
        return web.Response(text="User-agent: crawl2chat\nCrawl-delay: 0.6\nDisallow:\n")

    async def page(request: web.Request) -> web.Response:
        return html("/1")

    with LocalServer([web.get("/robots.txt", robots), web.get("/{n:\\d*}", page)]) as server:
        result = crawl(quick_config(server.url + "/", per_host_delay_s=0.01), tmp_path)
        starts = [t for _, t in server.requests]
    assert result.pages_fetched == 2
    assert [path for path, _ in server.requests] == ["/robots.txt", "/", "/1"]
    # robots.txt's own request counts: the first page waits the Crawl-delay too.
    assert min(later - earlier for earlier, later in zip(starts, starts[1:])) >= 0.6


def test_failing_robots_disallows_the_site(tmp_path):
    async def robots(request: web.Request) -> web.Response:
        raise web.HTTPInternalServerError()

    async def page(request: web.Request) -> web.Response:
        return html()

    with LocalServer([web.get("/robots.txt", robots), web.get("/", page)]) as server:
        result = crawl(quick_config(server.url + "/"), tmp_path)
        assert server.paths() == ["/robots.txt"]
    assert result.pages_fetched == 0
    assert result.skipped == {"robots_unavailable": 1}
    assert result.warc_paths == []


def test_unreachable_server_is_counted(tmp_path):
    with LocalServer([]) as server:
        dead_url = server.url + "/"
    # The server is gone; its port now refuses connections.
    result = crawl(quick_config(dead_url, respect_robots=False), tmp_path)
    assert result.skipped == {"connection_error": 1}
    assert result.errors == [(dead_url, "connection_error")]


# ----------------------------------------------------------------------------- pure helpers


def test_url_normalisation():
    assert normalize_url("b.html#x", "http://Example.COM:80/a/") == "http://example.com/a/b.html"
    assert normalize_url("https://example.com") == "https://example.com/"
    assert normalize_url("mailto:a@b.c") is None
    assert normalize_url("//other.example.org/p?q=1", "https://example.com/") == "https://other.example.org/p?q=1"
    assert normalize_url("http://[::1]:8080/x") == "http://[::1]:8080/x"
    assert normalize_url("http://h.example.org:notaport/") is None


def test_link_extraction_honours_base_and_nofollow():
    page = b'<html><head><base href="/docs/"></head><body><a href="a.html">a</a><a href="#top">t</a></body></html>'
    # A fragment-only link resolves against <base>, as browsers do.
    assert extract_links(page, "http://h.example.org/index.html") == ["http://h.example.org/docs/a.html", "http://h.example.org/docs/"]
    nofollow = b'<html><head><meta name="robots" content="noindex, nofollow"></head><a href="/x">x</a></html>'
    assert extract_links(nofollow, "http://h.example.org/") == []


def test_unfinished_warc_file_never_carries_the_final_name(tmp_path):
    sink = RotatingWarcWriter(tmp_path, max_bytes=1 << 20, user_agent="test")
    record = sink.writer.create_warc_record("http://h.example.org/", "resource", payload=io.BytesIO(b"x"), length=1)
    sink.write(record)
    # Until close (a crawl killed here), only the .tmp name exists.
    assert [p.name.endswith(".warc.gz.tmp") for p in tmp_path.iterdir()] == [True]
    sink.close()
    assert [p.name for p in tmp_path.iterdir()] == [Path(sink.paths[0]).name]
    with open(sink.paths[0], "rb") as fh:
        assert [r.rec_type for r in ArchiveIterator(fh)] == ["warcinfo", "resource"]


# ----------------------------------------------------------------------------- the embedded default target


def test_pydoc_site_crawl(tmp_path):
    with PydocSite() as site:
        assert site.url.startswith("http://127.0.0.1:")
        result = crawl(quick_config(site.url, max_pages=20), tmp_path)
    assert result.pages_fetched == 20
    responses = [payload for kind, _, status, payload in warc_records(result) if kind == "response" and status == 200]
    assert len(responses) == 20
    titles = [re.search(rb"<title>(.*?)</title>", payload).group(1).decode() for payload in responses]
    assert "Pydoc: Index of Modules" in titles
    module_pages = [t for t in titles if re.fullmatch(r"Pydoc: (built-in )?module \w+", t)]
    assert len(module_pages) >= 10
    index = responses[titles.index("Pydoc: Index of Modules")]
    assert b"builtins" in index and b"sys" in index


# ----------------------------------------------------------------------------- robots.txt (RFC 9309)


def test_gzip_compressed_robots_txt_is_obeyed(tmp_path):
    """A robots.txt sent with Content-Encoding: gzip is decompressed before it is parsed."""

    async def robots(request: web.Request) -> web.Response:
        body = gzip.compress(b"User-agent: *\nDisallow: /private/\n")
        return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})

    async def page(request: web.Request) -> web.Response:
        return html("/private/secret", "/ok", text="<p>home</p>")

    routes = [web.get("/robots.txt", robots), web.get("/{tail:.*}", page)]
    with LocalServer(routes) as server:
        result = crawl(quick_config(server.url + "/"), tmp_path)
    assert "/private/secret" not in server.paths()
    assert "/ok" in server.paths()
    assert result.skipped == {"robots": 1}


RFC_ROBOTS = """\
User-agent: crawl2chat
Crawl-delay: 0.3
Allow: /
Disallow: /private/
Disallow: /*.gif$
Allow: /page
Disallow: /*.html
Allow: /folder
Disallow: /folder

User-agent: *
Disallow: /
"""


def test_robots_matching_follows_rfc_9309(tmp_path):
    """Longest match wins whatever the order, * and $ wildcards, Allow wins a tie; the own group wins over *."""
    allowed = ["/", "/img.gif?v=1", "/page", "/folder/x", "/plain"]
    disallowed = ["/private/a", "/img.gif", "/page.html", "/other.html"]

    async def robots(request: web.Request) -> web.Response:
        return web.Response(text=RFC_ROBOTS)

    async def page(request: web.Request) -> web.Response:
        return html(*(allowed + disallowed)) if request.path == "/" else html()

    routes = [web.get("/robots.txt", robots), web.get("/{tail:.*}", page)]
    with LocalServer(routes) as server:
        result = crawl(quick_config(server.url + "/", per_host_concurrency=2), tmp_path)
        starts = [t for path, t in server.requests if path != "/robots.txt"]
    assert sorted(p for p in server.paths() if p != "/robots.txt") == sorted(allowed)
    assert result.pages_fetched == len(allowed)
    assert result.skipped == {"robots": len(disallowed)}
    # Crawl-delay 0.3 from the crawler's own group, fractions honoured.
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 0.3


def test_robots_redirect_followed_on_the_same_host_only(tmp_path):
    async def page(request: web.Request) -> web.Response:
        return html("/x", "/y")

    with LocalServer([web.get("/{tail:.*}", page)]) as elsewhere:
        port = elsewhere.url.rsplit(":", 1)[1]

        async def moved_robots(request: web.Request) -> web.Response:
            raise web.HTTPMovedPermanently("/rules.txt")

        async def rules(request: web.Request) -> web.Response:
            return web.Response(text="User-agent: *\nDisallow: /x\n")

        same_host = [web.get("/robots.txt", moved_robots), web.get("/rules.txt", rules), web.get("/{tail:.*}", page)]
        with LocalServer(same_host) as server:
            result = crawl(quick_config(server.url + "/"), tmp_path / "same")
        assert "/x" not in server.paths() and "/y" in server.paths()
        assert result.skipped == {"robots": 1}

        async def robots_elsewhere(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"http://localhost:{port}/robots.txt")

        with LocalServer([web.get("/robots.txt", robots_elsewhere), web.get("/{tail:.*}", page)]) as server:
            result = crawl(quick_config(server.url + "/"), tmp_path / "other")
        # The redirect to another host is not followed: the rules are unknown, the site is off limits.
        assert server.paths() == ["/robots.txt"]
        assert result.skipped == {"robots_unavailable": 1}
        assert elsewhere.requests == []


# ----------------------------------------------------------------------------- compressed bodies


def gzip_bomb(size: int) -> bytes:
    """``size`` zero bytes, gzipped (about 1000:1), built without holding them in memory."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    parts = [packer.compress(block) for _ in range(size >> 20)]
    return b"".join(parts) + packer.flush()


def test_decompression_bomb_is_cut_off(tmp_path):
    bomb = gzip_bomb(50 << 20)
    assert len(bomb) < 100_000

    async def home(request: web.Request) -> web.Response:
        return html("/bomb", "/fine")

    async def bomb_page(request: web.Request) -> web.Response:
        return web.Response(body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "text/html"})

    async def fine(request: web.Request) -> web.Response:
        response = html("/child", text="<p>" + "small compressed page " * 20 + "</p>")
        response.enable_compression(web.ContentCoding.gzip)
        return response

    routes = [web.get("/", home), web.get("/bomb", bomb_page), web.get("/fine", fine), web.get("/child", home)]
    with LocalServer(routes) as server:
        cfg = quick_config(server.url + "/", respect_robots=False, max_page_bytes=200_000)
        tracemalloc.start()
        started = time.monotonic()
        try:
            result = crawl(cfg, tmp_path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        elapsed = time.monotonic() - started
    # The compressed body (~50 KB) is under the limit; what it expands to is not.
    assert result.skipped == {"too_large": 1}
    assert (server.url + "/bomb", "too_large") in result.errors
    assert peak < 20 << 20, f"peak Python memory {peak / 2**20:.1f} MiB while 50 MiB were on offer"
    assert elapsed < 10
    stored = {uri for kind, uri, _, _ in warc_records(result) if kind == "response"}
    assert stored == {server.url + p for p in ("/", "/fine", "/child")}  # links read from a gzip page


def test_body_decoder_bounds_and_formats():
    body = b"<p>hello</p>" * 100
    for encoded, encoding in [
        (gzip.compress(body), "gzip"),
        (zlib.compress(body), "deflate"),
        (zlib.compress(body)[2:-4], "deflate"),  # raw deflate, as some servers send it
        (gzip.compress(body[:600]) + gzip.compress(body[600:]), "gzip"),  # two gzip members
        (body, ""),
    ]:
        decoder = BodyDecoder(encoding, limit=10_000)
        for i in range(0, len(encoded), 7):
            decoder.feed(encoded[i : i + 7])
        decoder.finish()
        assert (decoder.output() if encoding else body) == body, encoding
    small = BodyDecoder("gzip", limit=100)
    small.feed(gzip_bomb(1 << 20))
    assert small.overflow and len(small.output()) == 101
    truncated = BodyDecoder("gzip", limit=10_000)
    truncated.feed(gzip.compress(body)[:-10])
    with pytest.raises(ValueError):
        truncated.finish()
    with pytest.raises(ValueError):
        BodyDecoder("br", limit=10)


# ----------------------------------------------------------------------------- scope and addresses


def test_scope_is_the_seed_origin_port_included(tmp_path):
    """A seed on 127.0.0.1:A does not reach another local service on 127.0.0.1:B unless allowed_domains says so."""

    async def other(request: web.Request) -> web.Response:
        return html(text="<p>another local service</p>")

    with LocalServer([web.get("/{tail:.*}", other)]) as service:
        port_b = service.url.rsplit(":", 1)[1]

        async def home(request: web.Request) -> web.Response:
            return html(
                f"http://127.0.0.1:{port_b}/api", f"http://localhost:{port_b}/", "https://127.0.0.1/",
                "http://169.254.169.254/latest/meta-data/", "/own",
            )

        with LocalServer([web.get("/", home), web.get("/own", other)]) as server:
            narrow = crawl(quick_config(server.url + "/", respect_robots=False), tmp_path / "narrow")
            assert service.requests == []
            assert narrow.pages_fetched == 2
            assert narrow.skipped == {"off_domain": 4}

            widened = quick_config(server.url + "/", respect_robots=False, allowed_domains=[f"127.0.0.1:{port_b}"])
            wide = crawl(widened, tmp_path / "wide")
        assert service.paths() == ["/api"]
        assert wide.pages_fetched == 3
        assert wide.skipped == {"off_domain": 3}


def test_scope_rules():
    scope = CrawlScope(["http://example.org/"], ["docs.example.com", "api.example.net:8443", "[::1]:8080"])
    assert scope.allows("http://example.org/a")
    assert scope.allows("https://example.org/a")  # the upgrade to https on its default port
    assert not scope.allows("http://example.org:8080/")
    assert not scope.allows("http://www.example.org/")  # seeds admit their own host only
    assert scope.allows("https://docs.example.com/") and scope.allows("http://v2.docs.example.com/x")
    assert not scope.allows("http://docs.example.com:9000/")
    assert scope.allows("https://api.example.net:8443/") and not scope.allows("https://api.example.net/")
    assert scope.allows("http://[::1]:8080/") and not scope.allows("http://[::1]:8081/")
    local = CrawlScope(["http://127.0.0.1:8000/"], [])
    assert local.allows("http://127.0.0.1:8000/x")
    assert not local.allows("http://127.0.0.1:5000/") and not local.allows("https://127.0.0.1:8000/")
    assert CrawlConfig(allowed_domains=["Example.ORG.", "h.example.org:81", "[::1]:8080"]).allowed_domains == [
        "example.org", "h.example.org:81", "[::1]:8080"
    ]
    for bad in ["http://example.org", "example.org/path", "example.org:http", "example.org:0", "user@example.org", ""]:
        with pytest.raises(ValueError):
            CrawlConfig(allowed_domains=[bad])
    with pytest.raises(ValueError):
        CrawlConfig(site_aliases={"http://127.0.0.1:1/path": "http://127.0.0.1:2"})


def test_address_policy_of_a_public_seed():
    """No network: the policy a crawl of public seeds runs under."""
    policy = AddressPolicy()
    for public in ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"]:
        assert policy.allows(public), public
    for private in [
        "127.0.0.1", "127.1.2.3", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
        "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fe80::1%eth0", "fc00::1", "fd12::3",
        "::ffff:127.0.0.1", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "not an address",
    ]:
        assert not policy.allows(private), private
        assert not is_public_address(private), private
    # A seed on a non-public address admits exactly that address, nothing else non-public.
    local = asyncio.run(AddressPolicy.for_hosts(["127.0.0.1"]))
    assert local.allows("127.0.0.1") and local.allows("::ffff:127.0.0.1") and local.allows("8.8.8.8")
    assert not local.allows("127.0.0.2") and not local.allows("169.254.169.254") and not local.allows("10.0.0.1")
    # The socket factory refuses before a socket exists.
    with pytest.raises(BlockedAddressError):
        policy.socket_factory((socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", 80)))


def test_resolver_drops_non_public_answers():
    """No network: a name that resolves (or re-resolves, DNS rebinding) to a private address is refused."""

    class FakeResolver(AbstractResolver):
        def __init__(self, answers: list[str]) -> None:
            self.answers = answers

        async def resolve(self, host, port=0, family=socket.AF_INET):  # type: ignore[no-untyped-def]
            return [
                {"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
                for a in self.answers
            ]

        async def close(self) -> None:
            pass

    async def resolve(answers: list[str]) -> list[str]:
        resolver = PolicyResolver(AddressPolicy(), inner=FakeResolver(answers))
        return [a["host"] for a in await resolver.resolve("rebind.example.org", 80)]

    assert asyncio.run(resolve(["169.254.169.254", "93.184.216.34"])) == ["93.184.216.34"]
    with pytest.raises(BlockedAddressError):
        asyncio.run(resolve(["127.0.0.1", "10.1.1.1"]))


def test_crawl_under_a_public_policy_never_connects_to_loopback(tmp_path, monkeypatch):
    """The whole request path with the policy of a public seed: the local server sees no connection."""

    async def public_only(cls, hosts):  # type: ignore[no-untyped-def]
        return cls()

    async def page(request: web.Request) -> web.Response:
        return html()

    monkeypatch.setattr(crawl_module.AddressPolicy, "for_hosts", classmethod(public_only))
    with LocalServer([web.get("/{tail:.*}", page)]) as server:
        result = crawl(quick_config(server.url + "/", respect_robots=False), tmp_path)
        assert server.requests == []
    assert result.skipped == {"blocked_address": 1}
    assert result.errors == [(server.url + "/", "blocked_address")]


# ----------------------------------------------------------------------------- politeness


def test_one_gate_per_host(tmp_path):
    crawler = Crawler(CrawlConfig(seed_urls=["http://h.example.org/"]), tmp_path)
    assert crawler._gate("http://h.example.org/") is crawler._gate("https://h.example.org:8443/x")
    assert crawler._gate("http://h.example.org/") is not crawler._gate("http://other.example.org/")


def test_two_ports_of_one_host_share_the_politeness_gap(tmp_path):
    async def leaf(request: web.Request) -> web.Response:
        return html()

    with LocalServer([web.get("/{tail:.*}", leaf)]) as second:
        port_b = second.url.rsplit(":", 1)[1]

        async def home(request: web.Request) -> web.Response:
            return html(*[f"/a{i}" for i in range(4)], *[f"{second.url}/b{i}" for i in range(4)])

        with LocalServer([web.get("/", home), web.get("/{tail:.*}", leaf)]) as first:
            cfg = quick_config(
                first.url + "/", allowed_domains=[f"127.0.0.1:{port_b}"], per_host_concurrency=1,
                per_host_delay_s=0.1, global_concurrency=8,
            )
            result = crawl(cfg, tmp_path)
            starts = sorted(t for server in (first, second) for _, t in server.requests)
    assert result.pages_fetched == 9
    assert len(starts) == 11  # two robots.txt + nine pages
    assert min(b - a for a, b in zip(starts, starts[1:])) >= 0.1


def test_retry_after_honoured_and_bounded(tmp_path):
    calls: dict[str, int] = {}

    async def home(request: web.Request) -> web.Response:
        return html("/slow-down", "/busy", "/always-busy", "/come-back-tomorrow")

    async def answer(request: web.Request) -> web.Response:
        n = calls[request.path] = calls.get(request.path, 0) + 1
        if request.path == "/slow-down" and n == 1:
            return web.Response(status=429, headers={"Retry-After": "1"})
        if request.path == "/busy" and n == 1:
            when = email.utils.format_datetime(datetime.now(timezone.utc) + timedelta(seconds=2), usegmt=True)
            return web.Response(status=503, headers={"Retry-After": when})
        if request.path == "/always-busy":
            return web.Response(status=503, headers={"Retry-After": "0"})
        if request.path == "/come-back-tomorrow":
            return web.Response(status=429, headers={"Retry-After": "86400"})
        return html(text=f"<p>{request.path} at last</p>")

    routes = [web.get("/", home), web.get("/{tail:.+}", answer)]
    with LocalServer(routes) as server:
        cfg = quick_config(
            server.url + "/", respect_robots=False, per_host_concurrency=1, max_retries=2, retry_backoff_s=0.1,
            max_retry_wait_s=2.5, global_concurrency=1,
        )
        result = crawl(cfg, tmp_path)
        log = list(server.requests)

    def starts(path: str) -> list[float]:
        return [t for p, t in log if p == path]

    slow, busy = starts("/slow-down"), starts("/busy")
    assert len(slow) == 2 and slow[1] - slow[0] >= 1.0
    # The host as a whole waits: nothing else started during the Retry-After.
    assert not [t for _, t in log if slow[0] < t < slow[0] + 0.99]
    assert len(busy) == 2 and busy[1] - busy[0] >= 1.0  # an HTTP date 2 s ahead (1 s resolution)
    assert len(starts("/always-busy")) == 3  # the first request and max_retries=2 retries
    assert len(starts("/come-back-tomorrow")) == 1  # asks for more than max_retry_wait_s
    assert result.pages_fetched == 3
    assert result.skipped == {"http_503": 1, "http_429": 1}


def test_parse_retry_after():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after("Thu, 01 Jan 2026 12:00:30 GMT", now) == 30.0
    assert parse_retry_after("Thu, 01 Jan 2026 11:00:00 GMT", now) == 0.0
    assert parse_retry_after("soon", now) is None and parse_retry_after(None, now) is None
    assert parse_retry_after("-5", now) is None


def test_redirect_to_an_already_fetched_page_is_not_fetched_again(tmp_path):
    async def home(request: web.Request) -> web.Response:
        return html("/landing", "/old-address")

    async def landing(request: web.Request) -> web.Response:
        return html(text="<p>the landing page</p>")

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("/landing")

    routes = [web.get("/", home), web.get("/landing", landing), web.get("/old-address", moved)]
    with LocalServer(routes) as server:
        result = crawl(quick_config(server.url + "/", respect_robots=False, global_concurrency=1), tmp_path)
    assert server.paths() == ["/", "/landing", "/old-address"]
    assert result.pages_fetched == 2
    assert result.skipped == {"redirect_seen": 1}


# ----------------------------------------------------------------------------- a killed crawl


KILLABLE_CRAWL = """
import sys
from crawl2chat.stages.data.crawl import crawl
from crawl2chat.stages.data.settings import CrawlConfig
crawl(CrawlConfig.model_validate_json(sys.argv[1]), sys.argv[2])
"""


def test_killed_crawl_loses_no_page(tmp_path):
    """SIGKILL mid-crawl, then the same crawl again: every page's text is in a response record."""
    texts = {f"/p{i}": f"Page {i} carries the marker token{i:04d}z." for i in range(100)}

    async def home(request: web.Request) -> web.Response:
        return html(*texts)

    async def page(request: web.Request) -> web.Response:
        return html(text=f"<p>{texts[request.path]}</p>")

    routes = [web.get("/", home), web.get("/p{n:\\d+}", page)]
    out_dir = tmp_path / "crawl"
    with LocalServer(routes) as server:
        cfg = quick_config(
            server.url + "/", respect_robots=False, per_host_concurrency=1, per_host_delay_s=0.02,
            checkpoint_pages=10, max_pages=1000,
        )
        proc = subprocess.Popen([sys.executable, "-c", KILLABLE_CRAWL, cfg.model_dump_json(), str(out_dir)])
        try:
            deadline = time.monotonic() + 90
            while len(server.requests) < 60 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the crawl ended before it could be killed"
        killed_at = len(server.requests)
        committed = json.loads((out_dir / "crawl_state.json").read_text())
        assert 50 <= len(committed) <= killed_at <= 101  # checkpoints every 10 pages; pages since then unsaved
        rerun = crawl(cfg, out_dir)

    responses: dict[str, bytes] = {}
    for path in sorted((out_dir / "warc").glob("*.warc.gz")):
        with open(path, "rb") as fh:
            for record in ArchiveIterator(fh):
                if record.rec_type == "response":
                    responses[record.rec_headers.get_header("WARC-Target-URI")] = record.content_stream().read()
    for path, text in texts.items():
        assert text.encode() in responses.get(server.url + path, b""), path
    assert rerun.pages_fetched == 101
    # Pages the killed crawl had committed are unchanged revisits; the others are stored now.
    assert sorted(rerun.changed_urls) == sorted(set(responses) - set(committed))
    assert not [p for p in out_dir.rglob("*") if p.name.endswith(".tmp")]


def test_crawl_that_got_nothing_is_not_marked_done(tmp_path):
    """The data stage's crawl task: a site that is down leaves no done marker, so the next run crawls again."""
    import mlflow

    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.stages.data.pipeline import NothingUsableError
    from crawl2chat.tasks.data import CRAWL_MARKER, crawl_task

    with LocalServer([]) as server:
        dead_url = server.url + "/"
    # Not the experiment an earlier test made active in another store; artifacts under tmp_path.
    setup_tracking(tmp_path, "crawl", f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        cfg = quick_config(dead_url)
        assert crawl_task.fn(cfg, str(tmp_path / "out")) == []
        assert not (tmp_path / "out" / "crawl" / CRAWL_MARKER).exists()
        # The crawl as the only input: the build stops with why no page was fetched.
        with pytest.raises(NothingUsableError) as err:
            crawl_task.fn(cfg, str(tmp_path / "out"), only_input=True)
        assert str(err.value) == (
            "The crawl got no page (robots_unavailable 1: its robots.txt did not answer, so the site counts as "
            f"disallowed (RFC 9309)); nothing was built, see {tmp_path / 'out' / 'crawl' / 'crawl_report.json'}.")
    finally:
        mlflow.set_tracking_uri(None)


# ----------------------------------------------------------------------------- the embedded site's identity


def test_embedded_site_keeps_its_identity_between_crawls(tmp_path):
    """Re-crawls of the pydoc site into one folder find every page unchanged, even when its port was taken."""
    identity = tmp_path / "crawl" / PydocSite.IDENTITY_FILE
    out_dir = tmp_path / "crawl"

    def crawl_site() -> tuple[PydocSite, CrawlResult]:
        with PydocSite(identity_file=identity) as site:
            cfg = quick_config(site.url, max_pages=12, site_aliases=site.aliases)
            return site, crawl(cfg, out_dir)

    first_site, first = crawl_site()
    assert first.pages_fetched == 12 and len(first.changed_urls) == 12
    second_site, second = crawl_site()
    assert second_site.url == first_site.url and second_site.aliases == {}  # the same port, free again
    port = int(first_site.url.rsplit(":", 1)[1].strip("/"))
    with socket.socket() as squatter:  # another program on the recorded port
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port may still be in TIME_WAIT
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        third_site, third = crawl_site()
    assert third_site.url != first_site.url and third_site.site_url == first_site.url
    for again in (second, third):
        assert again.pages_fetched == 12 and again.changed_urls == []
        records = warc_records(again)
        # Recorded under the stable address: revisits of the first crawl's captures, no new text.
        assert sorted(uri for kind, uri, _, _ in records if kind == "revisit") == sorted(first.changed_urls)
    state = json.loads((out_dir / "crawl_state.json").read_text())
    assert set(state) == set(first.changed_urls)


def test_embedded_site_serves_the_same_bytes_on_every_start():
    """pydoc renders some default values with their memory addresses, new on every start; the
    embedded site's pages carry none, so a refresh finds them unchanged (not new text)."""
    pages = ("collections.html", "logging.html", "ctypes.html")
    served = []
    for _ in range(2):
        with PydocSite() as site:
            direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, no proxy
            served.append({page: direct.open(site.url + page, timeout=120).read() for page in pages})
    assert served[0] == served[1]
    assert b"object object at 0x\xe2\x80\xa6" in served[0]["collections.html"]


def test_a_data_command_stopped_while_it_starts_says_so(tmp_path):
    """SIGTERM while the command still starts up (its project folder made, its local Prefect
    API not yet answering): the same sentence and the shell's status, no process left."""
    command = [str(Path(sys.executable).parent / "crawl2chat"), "data", "--input", str(tmp_path / "none.warc.gz")]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 60
    while not (tmp_path / ".crawl2chat").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out.decode()[-2000:]
    assert out.decode().strip().splitlines()[-1] == (
        "stopped (SIGTERM); rerunning the same command resumes where it stopped")
    time.sleep(1)
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, left
