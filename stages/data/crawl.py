"""The crawler: seed URLs -> WARC files, politely and incrementally.

An asyncio crawler on one ``aiohttp`` session. It honours robots.txt (RFC 9309),
keeps a polite gap between requests to one host, stays inside the allowed
domains, and writes what it fetched to gzipped WARC files with ``warcio`` so the
extraction stage reads crawls and downloaded Common Crawl WARCs the same way.

What lands in the WARC files: a request/response pair for every page fetched
with status 200 and an allowed content type whose payload is new or changed,
and a ``revisit`` record for every page that is unchanged (a 304 answer to a
conditional request, or a 200 whose payload digest equals the stored one).
Redirects, error answers and skipped pages are counted in the report instead of
stored, because everything in a ``response`` record is meant to become text.

Re-crawls into the same ``out_dir`` are incremental: ``crawl_state.json`` keeps,
per URL, the validators (ETag, Last-Modified), the payload digest and the
outlinks, so an unchanged page costs a 304 and its links are still followed.

Nothing here raises on a bad page or a failing server: every URL that was not
fetched is counted under a reason in ``CrawlResult.skipped``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import os
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import urldefrag, urljoin, urlsplit, urlunsplit
from urllib.robotparser import RobotFileParser

import aiohttp
from resiliparse.parse.encoding import detect_encoding
from resiliparse.parse.html import HTMLTree
from warcio.statusandheaders import StatusAndHeaders
from warcio.timeutils import datetime_to_iso_date
from warcio.warcwriter import WARCWriter
from crawl2chat.stages.data.settings import CrawlConfig

STATE_FILE = "crawl_state.json"
REPORT_FILE = "crawl_report.json"
WARC_SUBDIR = "warc"

# RFC 9309 asks crawlers to parse at least the first 500 KiB of a robots.txt.
ROBOTS_MAX_BYTES = 512 * 1024
# Failures kept verbatim in the report; the counters in ``skipped`` stay exact.
MAX_ERRORS_KEPT = 1000
# The state file is rewritten after this many pages, so a killed crawl loses little.
STATE_FLUSH_EVERY = 50
# Reasons that are policy decisions rather than failures; they are counted but
# not listed in ``CrawlResult.errors``.
POLICY_SKIPS = frozenset({"robots", "off_domain", "depth", "max_pages", "max_total_bytes", "content_type"})


@dataclass
class CrawlResult:
    """What one crawl did; also written to ``out_dir/crawl_report.json``."""

    warc_paths: list[str] = field(default_factory=list)
    pages_fetched: int = 0
    pages_not_modified: int = 0
    bytes_fetched: int = 0
    changed_urls: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[tuple[str, str]] = field(default_factory=list)
    started_at: str = ""
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["errors"] = [list(e) for e in self.errors]
        return out


# ----------------------------------------------------------------------------- URLs


def normalize_url(href: str, base: str | None = None) -> str | None:
    """Absolute http(s) URL without fragment, default port or user info; None if unusable.

    Lower-cases scheme and host and gives an empty path "/", so the frontier sees
    one spelling per page.
    """
    href = href.strip()
    if not href:
        return None
    try:
        url = urljoin(base, href) if base else href
        url = urldefrag(url).url
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            return None
        host = parts.hostname
        if not host:
            return None
        port = parts.port
    except ValueError:  # bad port, broken IPv6 literal
        return None
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None or port == {"http": 80, "https": 443}[scheme] else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def host_allowed(url: str, allowed_domains: list[str]) -> bool:
    """True when the URL's host is one of the domains or a subdomain of one."""
    host = (urlsplit(url).hostname or "").lower()
    return any(host == d or host.endswith("." + d) for d in allowed_domains)


def _site_key(url: str) -> str:
    """scheme://host[:port] -- the unit robots.txt and politeness apply to."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def extract_links(body: bytes, page_url: str, charset: str | None = None) -> list[str]:
    """Normalised outlinks of an HTML page (``<a href>``, honouring ``<base href>``).

    Returns no links when the page says ``<meta name="robots" content="nofollow">``.
    """
    tree = HTMLTree.parse_from_bytes(body, charset or detect_encoding(body))
    root = tree.document
    if root is None:
        return []
    for meta in root.query_selector_all('meta[name="robots" i]'):
        if "nofollow" in (meta.getattr("content") or "").lower():
            return []
    base = page_url
    base_el = root.query_selector("base[href]")
    if base_el is not None:
        base = normalize_url(base_el.getattr("href") or "", page_url) or page_url
    links: list[str] = []
    seen: set[str] = set()
    for anchor in root.query_selector_all("a[href]"):
        url = normalize_url(anchor.getattr("href") or "", base)
        if url and url not in seen:
            seen.add(url)
            links.append(url)
    return links


def _decoded_body(body: bytes, content_encoding: str) -> bytes:
    """The payload without its Content-Encoding (we ask only for gzip/deflate)."""
    encoding = content_encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompress(body, wbits=16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:  # raw deflate without zlib header, as some servers send
            return zlib.decompress(body, wbits=-zlib.MAX_WBITS)
    raise ValueError(f"unsupported content-encoding {encoding!r}")


def payload_digest(body: bytes) -> str:
    """SHA-1 in the WARC spelling ("sha1:" + base32), as in WARC-Payload-Digest."""
    return "sha1:" + base64.b32encode(hashlib.sha1(body).digest()).decode("ascii")


def _utc_now_iso() -> str:
    return datetime_to_iso_date(datetime.now(timezone.utc).replace(tzinfo=None))


def _write_json_atomically(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- WARC output


class RotatingWarcWriter:
    """Gzipped WARC files of bounded size, each renamed into place only when complete.

    A file is written as ``<name>.tmp`` and renamed to ``<name>`` on close, so a
    killed crawl never leaves a truncated file under a ``.warc.gz`` name.
    """

    def __init__(self, warc_dir: Path, max_bytes: int, user_agent: str) -> None:
        self.warc_dir = warc_dir
        self.max_bytes = max_bytes
        self.user_agent = user_agent
        # Microseconds keep two crawls into one out_dir within a second apart.
        self.stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        self.paths: list[str] = []
        self._file: io.BufferedWriter | None = None
        self._writer: WARCWriter | None = None
        self._final_path: Path | None = None

    def _open(self) -> WARCWriter:
        self.warc_dir.mkdir(parents=True, exist_ok=True)
        name = f"crawl-{self.stamp}-{len(self.paths):05d}.warc.gz"
        self._final_path = self.warc_dir / name
        self._file = open(self._final_path.with_name(name + ".tmp"), "wb")
        self._writer = WARCWriter(self._file, gzip=True)
        info = {"software": "crawl2chat crawler", "format": "WARC File Format 1.1", "http-header-user-agent": self.user_agent}
        self._writer.write_record(self._writer.create_warcinfo_record(name, info))
        return self._writer

    @property
    def writer(self) -> WARCWriter:
        """The open file's writer (opening one if needed), for building records."""
        return self._writer or self._open()

    def write(self, *records: Any) -> None:
        """Write one record, or a request/response pair (request first), to the current file."""
        writer = self.writer
        if len(records) == 2:
            writer.write_request_response_pair(*records)
        else:
            writer.write_record(records[0])
        if self._file is not None and self._file.tell() >= self.max_bytes:
            self.close()

    def close(self) -> None:
        if self._file is None or self._final_path is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._final_path.with_name(self._final_path.name + ".tmp"), self._final_path)
        self.paths.append(str(self._final_path))
        self._file = self._writer = self._final_path = None


# ----------------------------------------------------------------------------- politeness


class HostGate:
    """Per-host limit on concurrent requests and on how soon the next one may start.

    A request may start no earlier than ``delay`` after the previous start and
    after the previous answer was finished, so one host never sees requests
    closer than ``delay`` apart, measured from either side.
    """

    def __init__(self, concurrency: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self._slots = asyncio.Semaphore(concurrency)
        self._start_lock = asyncio.Lock()
        self._next_start = 0.0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        async with self._slots:
            async with self._start_lock:
                while (wait := self._next_start - loop.time()) > 0:
                    await asyncio.sleep(wait)
                self._next_start = loop.time() + self.delay_s
            try:
                yield
            finally:
                self._next_start = max(self._next_start, loop.time() + self.delay_s)


# ----------------------------------------------------------------------------- fetching


@dataclass
class Fetched:
    """One HTTP exchange as received; ``skip`` names why it is not a page."""

    url: str
    status: int = 0
    reason: str = ""
    http_version: str = "HTTP/1.1"
    headers: list[tuple[str, str]] = field(default_factory=list)
    request_headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    content_type: str = ""
    charset: str | None = None
    skip: str | None = None

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def _stored_headers(raw_headers: Any) -> list[tuple[str, str]]:
    """Response headers as received, except Transfer-Encoding.

    aiohttp removes the chunk framing while reading, so the stored body is no
    longer chunked; a kept ``Transfer-Encoding: chunked`` would make WARC readers
    try to de-chunk it. It is kept under ``X-Crawler-Transfer-Encoding``.
    """
    headers = []
    for key, value in raw_headers:
        name, text = key.decode("latin-1"), value.decode("latin-1")
        if name.lower() == "transfer-encoding":
            name = "X-Crawler-Transfer-Encoding"
        headers.append((name, text))
    return headers


async def _read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """Up to ``limit`` bytes of a body (``StreamReader.read(n)`` may stop at the first chunk)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await stream.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class Crawler:
    """One crawl: frontier, workers, robots cache, politeness gates, WARC and state."""

    session: aiohttp.ClientSession  # open for the duration of run()

    def __init__(self, cfg: CrawlConfig, out_dir: str | Path) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.result = CrawlResult(started_at=_utc_now_iso())
        self.skipped: Counter[str] = Counter()
        self.allowed_content_types = {t.lower() for t in cfg.allowed_content_types}
        self.old_state: dict[str, dict[str, Any]] = self._load_state()
        self.state: dict[str, dict[str, Any]] = dict(self.old_state)
        self.seen: set[str] = set()
        self.off_domain_urls: set[str] = set()  # counted once, however often linked
        self.too_deep_urls: set[str] = set()  # counted once; forgiven if found again closer to a seed
        self.queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self.gates: dict[str, HostGate] = {}
        self.robots: dict[str, asyncio.Task[RobotFileParser]] = {}
        self.robots_unavailable: set[str] = set()
        self.pages_in_flight = 0  # fetches holding a max_pages slot
        self.pages_done = 0  # fetches that ended in a page (200 or 304)
        self.page_budget = asyncio.Condition()
        self.warc = RotatingWarcWriter(self.out_dir / WARC_SUBDIR, cfg.warc_max_bytes, cfg.user_agent)
        seed_hosts = [urlsplit(u).hostname for u in (normalize_url(s) for s in cfg.seed_urls) if u]
        self.allowed_domains = [d.lower().strip(".") for d in cfg.allowed_domains] or sorted(
            {h for h in seed_hosts if h}
        )

    # -- bookkeeping --------------------------------------------------------

    def _load_state(self) -> dict[str, dict[str, Any]]:
        path = self.out_dir / STATE_FILE
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}  # an unreadable state only costs a full re-crawl
        if not isinstance(data, dict):
            return {}
        return {url: entry for url, entry in data.items() if isinstance(entry, dict)}

    def _skip(self, url: str, reason: str) -> None:
        self.skipped[reason] += 1
        if reason not in POLICY_SKIPS and len(self.result.errors) < MAX_ERRORS_KEPT:
            self.result.errors.append((url, reason))

    def _enqueue(self, url: str, depth: int) -> None:
        if url in self.seen or url in self.off_domain_urls:
            return
        if not host_allowed(url, self.allowed_domains):
            self.off_domain_urls.add(url)
            self._skip(url, "off_domain")
            return
        if depth > self.cfg.max_depth:
            if url not in self.too_deep_urls:
                self.too_deep_urls.add(url)
                self._skip(url, "depth")
            return
        if url in self.too_deep_urls:
            self.too_deep_urls.discard(url)
            self.skipped["depth"] -= 1
        self.seen.add(url)
        self.queue.put_nowait((url, depth))

    def _gate(self, url: str) -> HostGate:
        key = _site_key(url)
        if key not in self.gates:
            self.gates[key] = HostGate(self.cfg.per_host_concurrency, self.cfg.per_host_delay_s)
        return self.gates[key]

    # -- robots.txt ---------------------------------------------------------

    async def _robots_verdict(self, url: str) -> str | None:
        """None when robots.txt allows the URL, else the skip reason.

        "robots_unavailable" marks sites whose robots.txt answered 5xx or not at
        all: RFC 9309 says to treat them as fully disallowed, and the report
        should tell that apart from an explicit Disallow.
        """
        if not self.cfg.respect_robots:
            return None
        key = _site_key(url)
        if key not in self.robots:
            self.robots[key] = asyncio.ensure_future(self._fetch_robots(key))
        rules = await self.robots[key]
        if rules.can_fetch(self.cfg.user_agent, url):
            return None
        return "robots_unavailable" if key in self.robots_unavailable else "robots"

    async def _fetch_robots(self, site: str) -> RobotFileParser:
        """Rules for one site per RFC 9309: 4xx allows all, 5xx or no answer disallows all."""
        rules = RobotFileParser(site + "/robots.txt")
        try:
            async with self._gate(site).slot():
                async with self.session.get(site + "/robots.txt", allow_redirects=True, max_redirects=5) as resp:
                    status = resp.status
                    body = await _read_at_most(resp.content, ROBOTS_MAX_BYTES)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            status, body = 0, b""
        if 400 <= status < 500:
            rules.allow_all = True
        elif status != 200:
            rules.disallow_all = True
            self.robots_unavailable.add(site)
        else:
            rules.parse(body.decode("utf-8", errors="replace").splitlines())
            delay = rules.crawl_delay(self.cfg.user_agent)
            if delay:
                gate = self._gate(site)
                gate.delay_s = max(gate.delay_s, float(delay))
        return rules

    # -- one HTTP exchange --------------------------------------------------

    def _conditional_headers(self, url: str) -> dict[str, str]:
        stored = self.old_state.get(url) if self.cfg.incremental else None
        headers: dict[str, str] = {}
        if stored:
            if stored.get("etag"):
                headers["If-None-Match"] = stored["etag"]
            if stored.get("last_modified"):
                headers["If-Modified-Since"] = stored["last_modified"]
        return headers

    async def _request(self, url: str) -> Fetched:
        """GET one URL without following redirects; the body is read only for pages worth storing."""
        fetched = Fetched(url=url)
        try:
            async with self._gate(url).slot():
                async with self.session.get(
                    url, allow_redirects=False, headers=self._conditional_headers(url)
                ) as resp:
                    fetched.status, fetched.reason = resp.status, resp.reason or ""
                    fetched.http_version = f"HTTP/{resp.version.major}.{resp.version.minor}" if resp.version else "HTTP/1.1"
                    fetched.headers = _stored_headers(resp.raw_headers)
                    fetched.request_headers = [(k, v) for k, v in resp.request_info.headers.items()]
                    fetched.content_type = resp.content_type.lower()
                    fetched.charset = resp.charset
                    if resp.status == 200:
                        await self._read_page_body(resp, fetched)
        except asyncio.TimeoutError:
            fetched.skip = "timeout"
        except aiohttp.InvalidURL:
            fetched.skip = "bad_url"
        except aiohttp.ClientPayloadError:
            fetched.skip = "payload_error"
        except (aiohttp.ClientError, OSError):
            fetched.skip = "connection_error"
        return fetched

    async def _read_page_body(self, resp: aiohttp.ClientResponse, fetched: Fetched) -> None:
        if fetched.content_type not in self.allowed_content_types:
            fetched.skip = "content_type"
            return
        limit = self.cfg.max_page_bytes
        if resp.content_length is not None and resp.content_length > limit:
            fetched.skip = "too_large"
            return
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(64 * 1024):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                fetched.skip = "too_large"
                break
        self.result.bytes_fetched += size
        if fetched.skip is None:
            fetched.body = b"".join(chunks)

    # -- one frontier entry -------------------------------------------------

    async def _acquire_page_slot(self) -> bool:
        """Reserve one of max_pages; waits while in-flight fetches may still free a slot."""
        async with self.page_budget:
            while self.pages_done < self.cfg.max_pages <= self.pages_done + self.pages_in_flight:
                await self.page_budget.wait()
            if self.pages_done >= self.cfg.max_pages:
                return False
            self.pages_in_flight += 1
            return True

    async def _release_page_slot(self, was_page: bool) -> None:
        async with self.page_budget:
            self.pages_in_flight -= 1
            self.pages_done += int(was_page)
            self.page_budget.notify_all()

    async def _visit(self, url: str, depth: int) -> None:
        verdict = await self._robots_verdict(url)
        if verdict:
            self._skip(url, verdict)
            return
        if self.result.bytes_fetched >= self.cfg.max_total_bytes:
            self._skip(url, "max_total_bytes")
            return
        if not await self._acquire_page_slot():
            self._skip(url, "max_pages")
            return
        was_page = False
        try:
            was_page = await self._follow(url, depth)
        finally:
            await self._release_page_slot(was_page)

    async def _follow(self, url: str, depth: int) -> bool:
        """Fetch a URL, following redirects hop by hop; True when it ended in a page."""
        current = url
        for hop in range(self.cfg.max_redirects + 1):
            if hop:
                if not host_allowed(current, self.allowed_domains):
                    self._skip(current, "off_domain")
                    return False
                verdict = await self._robots_verdict(current)
                if verdict:
                    self._skip(current, verdict)
                    return False
            fetched = await self._request(current)
            if fetched.skip:
                self._skip(current, fetched.skip)
                return False
            location = fetched.header("Location")
            if fetched.status in (301, 302, 303, 307, 308) and location:
                target = normalize_url(location, current)
                if target is None:
                    self._skip(current, "bad_redirect")
                    return False
                current = target
                self.seen.add(current)
                continue
            if fetched.status == 304 and current in self.old_state:
                self._not_modified(fetched, depth)
                return True
            if fetched.status != 200:
                self._skip(current, f"http_{fetched.status}")
                return False
            self._page(fetched, depth)
            return True
        self._skip(url, "redirect_limit")
        return False

    def _not_modified(self, fetched: Fetched, depth: int) -> None:
        stored = dict(self.old_state[fetched.url])
        self.warc.write(self._revisit_record(fetched, stored))
        stored["fetched_at"] = _utc_now_iso()
        stored["etag"] = fetched.header("ETag") or stored.get("etag")
        stored["last_modified"] = fetched.header("Last-Modified") or stored.get("last_modified")
        self.state[fetched.url] = stored
        self.result.pages_not_modified += 1
        self._after_page(stored.get("outlinks", []), depth)

    def _page(self, fetched: Fetched, depth: int) -> None:
        digest = payload_digest(fetched.body)
        outlinks: list[str] = []
        if fetched.content_type in ("text/html", "application/xhtml+xml"):
            try:
                html = _decoded_body(fetched.body, fetched.header("Content-Encoding") or "")
                outlinks = extract_links(html, fetched.url, fetched.charset)
            except (ValueError, zlib.error, UnicodeError) as exc:
                self._skip(fetched.url, f"links_unreadable:{type(exc).__name__}")
        previous = self.old_state.get(fetched.url)
        if previous and previous.get("payload_sha1") == digest:
            self.warc.write(self._revisit_record(fetched, previous))
        else:
            writer = self.warc.writer
            request = writer.create_warc_record(
                fetched.url, "request", http_headers=self._request_status_headers(fetched)
            )
            response = writer.create_warc_record(
                fetched.url,
                "response",
                payload=io.BytesIO(fetched.body),
                length=len(fetched.body),
                http_headers=StatusAndHeaders(
                    f"{fetched.status} {fetched.reason}".strip(), fetched.headers, protocol=fetched.http_version
                ),
            )
            self.warc.write(request, response)
            self.result.changed_urls.append(fetched.url)
        self.state[fetched.url] = {
            "etag": fetched.header("ETag"),
            "last_modified": fetched.header("Last-Modified"),
            "payload_sha1": digest,
            "fetched_at": _utc_now_iso(),
            "outlinks": outlinks,
        }
        self.result.pages_fetched += 1
        self._after_page(outlinks, depth)

    def _after_page(self, outlinks: list[str], depth: int) -> None:
        for link in outlinks:
            self._enqueue(link, depth + 1)
        if (self.result.pages_fetched + self.result.pages_not_modified) % STATE_FLUSH_EVERY == 0:
            _write_json_atomically(self.out_dir / STATE_FILE, self.state)

    @staticmethod
    def _request_status_headers(fetched: Fetched) -> StatusAndHeaders:
        parts = urlsplit(fetched.url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return StatusAndHeaders(f"GET {target} HTTP/1.1", fetched.request_headers, is_http_request=True)

    def _revisit_record(self, fetched: Fetched, stored: dict[str, Any]) -> Any:
        """A revisit record pointing at the earlier capture with the same payload digest."""
        return self.warc.writer.create_revisit_record(
            fetched.url,
            digest=stored.get("payload_sha1") or payload_digest(fetched.body),
            refers_to_uri=fetched.url,
            refers_to_date=stored.get("fetched_at") or _utc_now_iso(),
            http_headers=StatusAndHeaders(
                f"{fetched.status} {fetched.reason}".strip(), fetched.headers, protocol=fetched.http_version
            ),
        )

    # -- the crawl ----------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            url, depth = await self.queue.get()
            try:
                await self._visit(url, depth)
            except Exception as exc:  # one bad page must never end the crawl
                self._skip(url, f"internal:{type(exc).__name__}")
            finally:
                self.queue.task_done()

    async def run(self) -> CrawlResult:
        started = time.monotonic()
        for seed in self.cfg.seed_urls:
            url = normalize_url(seed)
            if url is None:
                self._skip(seed, "bad_url")
            else:
                self._enqueue(url, 0)
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        connector = aiohttp.TCPConnector(
            limit=self.cfg.global_concurrency, limit_per_host=self.cfg.per_host_concurrency
        )
        headers = {"User-Agent": self.cfg.user_agent, "Accept-Encoding": "gzip, deflate"}
        # auto_decompress=False: the WARC keeps the body exactly as the server sent it.
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, headers=headers, auto_decompress=False
        ) as self.session:
            workers = [asyncio.create_task(self._worker()) for _ in range(self.cfg.global_concurrency)]
            try:
                await self.queue.join()
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                for task in self.robots.values():
                    task.cancel()
                self.warc.close()
        _write_json_atomically(self.out_dir / STATE_FILE, self.state)
        self.result.warc_paths = list(self.warc.paths)
        self.result.skipped = {reason: n for reason, n in sorted(self.skipped.items()) if n}
        self.result.elapsed_s = round(time.monotonic() - started, 3)
        _write_json_atomically(self.out_dir / REPORT_FILE, self.result.to_dict())
        return self.result


async def crawl_async(cfg: CrawlConfig, out_dir: str | Path) -> CrawlResult:
    """Crawl ``cfg.seed_urls`` into ``out_dir`` (WARC files, state, report)."""
    return await Crawler(cfg, out_dir).run()


def crawl(cfg: CrawlConfig, out_dir: str | Path) -> CrawlResult:
    """Blocking form of :func:`crawl_async`, for callers without an event loop."""
    return asyncio.run(crawl_async(cfg, out_dir))
