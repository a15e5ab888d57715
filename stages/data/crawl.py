"""The crawler: seed URLs -> WARC files, politely, safely and incrementally.

An asyncio crawler on one ``aiohttp`` session. It honours robots.txt (RFC 9309,
matched by ``protego``: longest match wins, ``*`` and ``$`` wildcards, Allow over
an equally long Disallow), keeps a polite gap between requests to one host,
backs off when a host answers 429 or 503, stays inside its scope, and writes what
it fetched to gzipped WARC files with ``warcio`` so the extraction stage reads
crawls and downloaded Common Crawl WARCs the same way.

Scope: by default a crawl stays on the origins of its seeds (scheme, host and
port; a seed on a default port also admits the same host on the other scheme's
default port, the usual http -> https upgrade). ``allowed_domains`` widens it:
``example.org`` admits that host and its subdomains on the default ports,
``example.org:8080`` on that port. Whatever the scope, connections go only to
public addresses, plus the non-public ones (loopback, private, link-local) that
the seeds' hosts and the hosts named in ``allowed_domains`` resolve to when the
crawl starts: names are resolved before connecting and the address each socket
is about to connect to is checked again, so a DNS answer that changes during the
crawl (rebinding) cannot lead it to 169.254.169.254 or a local service.

What lands in the WARC files: a request/response pair for every page fetched
with status 200 and an allowed content type whose payload is new or changed,
and a ``revisit`` record for every page that is unchanged (a 304 answer to a
conditional request, or a 200 whose payload digest equals the stored one).
Redirects, error answers and skipped pages are counted in the report instead of
stored, because everything in a ``response`` record is meant to become text;
the one exception is a page an earlier crawl stored that now answers 404 or 410:
that answer is stored (without a body) as the page's latest capture, so the
data stage retires the page's text.
Bodies are stored as sent (Content-Encoding kept); their decompressed size is
bounded while they stream in, so a compression bomb costs ``max_page_bytes``.

Re-crawls into the same ``out_dir`` are incremental: ``crawl_state.json`` keeps,
per URL, the validators (ETag, Last-Modified), the payload digest and the
outlinks, so an unchanged page costs a 304 and its links are still followed.
A re-crawl also asks for the stored pages that no link led to this time (a page
taken off the site's navigation may still be there, or may be gone).
The state and the WARC files commit together: before each save of the state the
WARC file in progress is closed under its final name, and a restart discards
unfinished ``.tmp`` files, whose pages the saved state does not know and which
are therefore fetched again. A killed crawl loses no page's text.

Nothing here raises on a bad page or a failing server: every URL that was not
fetched is counted under a reason in ``CrawlResult.skipped``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import hashlib
import io
import ipaddress
import json
import os
import socket
import time
import re
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver
from protego import Protego
from warcio.statusandheaders import StatusAndHeaders
from warcio.timeutils import datetime_to_iso_date
from warcio.warcwriter import WARCWriter

from crawl2chat.stages.data.settings import CrawlConfig
from crawl2chat.stages.data.urls import DEFAULT_PORTS, host_key, normalize_url, origin, parse_domain_entry, parse_origin, site_key

try:
    import fcntl
except ImportError:  # not on POSIX: crawls into one out_dir are not guarded against each other
    fcntl = None  # type: ignore[assignment]

STATE_FILE = "crawl_state.json"
REPORT_FILE = "crawl_report.json"
LOCK_FILE = "crawl.lock"
WARC_SUBDIR = "warc"

# RFC 9309 asks crawlers to parse at least the first 500 KiB of a robots.txt.
ROBOTS_MAX_BYTES = 512 * 1024
# RFC 9309 asks crawlers to follow at least five redirects for robots.txt.
ROBOTS_MAX_REDIRECTS = 5
# Failures kept verbatim in the report; the counters in ``skipped`` stay exact.
MAX_ERRORS_KEPT = 1000
READ_CHUNK = 64 * 1024
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
RETRY_STATUSES = frozenset({429, 503})
# Reasons that are policy decisions rather than failures; they are counted but
# not listed in ``CrawlResult.errors``.
POLICY_SKIPS = frozenset(
    {"robots", "off_domain", "excluded", "depth", "max_pages", "max_total_bytes", "content_type", "redirect_seen"}
)
# Answers that say a page is gone for good; stored for a page an earlier crawl had stored.
GONE_STATUSES = frozenset({404, 410})
BODY_HEADERS = frozenset({"content-length", "content-encoding", "transfer-encoding"})
# Reasons a later request may not meet again: the site down or overloaded, a connection cut.
TRANSIENT_SKIPS = frozenset({"connection_error", "timeout", "payload_error", "robots_unavailable", "http_429"})


def transient(reason: str) -> bool:
    """Whether a URL skipped for ``reason`` is worth asking for again on the next run."""
    return reason in TRANSIENT_SKIPS or reason.startswith("http_5")


# What a crawl's skip reasons mean to someone who sees only the counts.
_WHY_NOT_FETCHED = {
    "robots_unavailable": "its robots.txt did not answer, so the site counts as disallowed (RFC 9309)",
    "connection_error": "the connection was refused or cut",
    "timeout": "no answer within data.crawl.request_timeout_s",
    "robots": "robots.txt disallows it",
    "bad_url": "it is not an http(s) URL",
    "excluded": "data.crawl.exclude_url_patterns excludes it",
    "blocked_address": "it resolves to an address the crawl may not connect to",
}


def why_nothing_fetched(result: "CrawlResult") -> str:
    """The skip counts of a crawl that got no page, most frequent first, and what the first means."""
    reasons = sorted(result.skipped.items(), key=lambda kv: -kv[1])
    if not reasons:
        return "no page answered"
    why = ", ".join(f"{reason} {n}" for reason, n in reasons)
    meaning = _WHY_NOT_FETCHED.get(reasons[0][0])
    return f"{why}: {meaning}" if meaning else why


# ----------------------------------------------------------------------------- settings


@dataclass
class CrawlResult:
    """What one crawl did; also written to ``out_dir/crawl_report.json``."""

    warc_paths: list[str] = field(default_factory=list)
    pages_fetched: int = 0
    pages_not_modified: int = 0
    # Pages an earlier crawl stored that now answer 404 or 410: each is stored as that answer, so the
    # data stage retires the page's text (its latest capture says it is gone).
    pages_gone: int = 0
    bytes_fetched: int = 0
    changed_urls: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    errors: list[tuple[str, str]] = field(default_factory=list)
    # Frontier entries (URL, depth) that failed for a transient reason: a rerun asks for them again.
    retry: list[tuple[str, int]] = field(default_factory=list)
    started_at: str = ""
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["errors"] = [list(e) for e in self.errors]
        out["retry"] = [list(e) for e in self.retry]
        return out


# ----------------------------------------------------------------------------- URLs


class CrawlScope:
    """Which URLs a crawl may visit: the seeds' origins plus what ``allowed_domains`` names."""

    def __init__(self, seed_urls: Iterable[str], allowed_domains: Iterable[str]) -> None:
        self.origins = {origin(u) for u in seed_urls}
        self.entries = [parse_domain_entry(e) for e in allowed_domains]

    def allows(self, url: str) -> bool:
        scheme, host, port = origin(url)
        if (scheme, host, port) in self.origins:
            return True
        on_default_port = port == DEFAULT_PORTS.get(scheme)
        if on_default_port and any(h == host and p == DEFAULT_PORTS[s] for s, h, p in self.origins):
            return True  # the same host on the other scheme's default port (http <-> https)
        for domain, entry_port in self.entries:
            if host == domain or host.endswith("." + domain):
                if port == entry_port or (entry_port is None and on_default_port):
                    return True
        return False

    def hosts(self) -> set[str]:
        """Every host named by a seed or an ``allowed_domains`` entry."""
        return {h for _, h, _ in self.origins} | {h for h, _ in self.entries}


def extract_links(body: bytes, page_url: str, charset: str | None = None) -> list[str]:
    """Normalised outlinks of an HTML page (``<a href>``, honouring ``<base href>``).

    Returns no links when the page says ``<meta name="robots" content="nofollow">``.
    Parsed with lxml: resiliparse's DOM selectors take seconds on a page with
    thousands of links (the documentation server's index), lxml's XPath milliseconds.
    """
    import lxml.etree
    import lxml.html

    try:
        parser = lxml.html.HTMLParser(encoding=charset) if charset else None
        doc = lxml.html.document_fromstring(body, parser=parser)
    except (lxml.etree.ParserError, ValueError, LookupError):
        return []
    robots = doc.xpath('//meta[translate(@name, "ROBTS", "robts")="robots"]/@content')
    if any("nofollow" in (content or "").lower() for content in robots):
        return []
    base = page_url
    base_hrefs = doc.xpath("//base/@href")
    if base_hrefs:
        base = normalize_url(base_hrefs[0] or "", page_url) or page_url
    links: list[str] = []
    seen: set[str] = set()
    for href in doc.xpath("//a/@href"):
        url = normalize_url(href or "", base)
        if url and url not in seen:
            seen.add(url)
            links.append(url)
    return links


def payload_digest(body: bytes) -> str:
    """SHA-1 in the WARC spelling ("sha1:" + base32), as in WARC-Payload-Digest."""
    return "sha1:" + base64.b32encode(hashlib.sha1(body).digest()).decode("ascii")


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or an HTTP date); None if unusable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


def _utc_now_iso() -> str:
    return datetime_to_iso_date(datetime.now(timezone.utc).replace(tzinfo=None))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json_atomically(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(data, indent=1, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ----------------------------------------------------------------------------- bodies


class BodyDecoder:
    """Undoes a Content-Encoding (gzip, deflate) chunk by chunk, never producing more than ``limit`` + 1 bytes.

    ``overflow`` turns true once the decoded size passes ``limit``; the caller
    stops reading there, so a small compressed body that would expand to
    gigabytes costs at most ``limit`` bytes of memory. ``finish`` raises
    ValueError for a compressed stream that ended early or is broken.
    """

    def __init__(self, content_encoding: str, limit: int) -> None:
        encoding = content_encoding.strip().lower()
        self.limit = limit
        self.size = 0
        self.overflow = False
        self._parts: list[bytes] = []
        self._fed = False
        self._head = b""  # deflate: the first bytes, until zlib-wrapped or raw is known
        if encoding in ("", "identity"):
            self._wbits: int | None = None
        elif encoding in ("gzip", "x-gzip"):
            self._wbits = 16 + zlib.MAX_WBITS
        elif encoding == "deflate":
            self._wbits = 0  # decided from the first two bytes
        else:
            raise ValueError(f"unsupported content-encoding {encoding!r}")
        self._inflater: Any = zlib.decompressobj(self._wbits) if self._wbits else None

    def _emit(self, data: bytes) -> None:
        room = self.limit + 1 - self.size
        if len(data) > room:
            data = data[:room]
        if data:
            self._parts.append(data)
            self.size += len(data)
        if self.size > self.limit:
            self.overflow = True

    def feed(self, data: bytes) -> None:
        if self.overflow or not data:
            return
        self._fed = True
        if self._wbits is None:
            self._emit(data)
            return
        if self._inflater is None:  # deflate: zlib-wrapped ("deflate" per RFC 9110) or raw, as some servers send
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            wrapped = (data[0] & 0x0F) == 8 and ((data[0] << 8) | data[1]) % 31 == 0
            self._inflater = zlib.decompressobj(zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS)
        try:
            while data and not self.overflow:
                if self._inflater.eof:
                    if self._wbits != 16 + zlib.MAX_WBITS or not data.strip(b"\0"):
                        return  # bytes after the end of the stream (padding) are ignored
                    self._inflater = zlib.decompressobj(self._wbits)  # the next gzip member
                self._emit(self._inflater.decompress(data, self.limit + 1 - self.size))
                data = self._inflater.unused_data if self._inflater.eof else self._inflater.unconsumed_tail
        except zlib.error as exc:
            raise ValueError(f"broken compressed body: {exc}") from exc

    def finish(self) -> None:
        """Checks that a compressed body ended where its encoding says it ends."""
        if self.overflow or self._wbits is None or not self._fed:
            return
        if self._inflater is None or not self._inflater.eof:
            raise ValueError("compressed body ended early")

    def output(self) -> bytes:
        """The decoded bytes (at most ``limit`` + 1 of them)."""
        return b"".join(self._parts)

    @property
    def identity(self) -> bool:
        return self._wbits is None


# ----------------------------------------------------------------------------- addresses


BLOCKED_MESSAGE = "address refused by the crawl's address policy"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class BlockedAddressError(OSError):
    """A connection the address policy refuses (a non-public address the crawl was not started on)."""

    def __init__(self, address: str = "") -> None:
        super().__init__(BLOCKED_MESSAGE)
        self.address = address


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address as an IP object, IPv4-mapped/NAT64/6to4 forms reduced to the IPv4 address they carry."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return ip


def is_public_address(address: str) -> bool:
    """True for a globally routable unicast address; False for loopback, private, link-local, CGNAT, reserved..."""
    ip = _ip(address)
    return ip is not None and ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class AddressPolicy:
    """Which peer addresses a crawl may connect to: every public one, plus ``also_allowed``."""

    also_allowed: frozenset[Any] = frozenset()

    def allows(self, address: str) -> bool:
        if is_public_address(address):
            return True
        ip = _ip(address)
        return ip is not None and ip in self.also_allowed

    @classmethod
    async def for_hosts(cls, hosts: Iterable[str]) -> "AddressPolicy":
        """Admits the non-public addresses the given hosts (seed and allowed_domains hosts) resolve to now."""
        loop = asyncio.get_running_loop()
        extra: set[Any] = set()
        for host in hosts:
            ip = _ip(host)
            if ip is not None:
                addresses = [host]
            else:
                try:
                    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                except (OSError, UnicodeError):
                    continue
                addresses = [str(info[4][0]) for info in infos]
            for address in addresses:
                resolved = _ip(address)
                if resolved is not None and not is_public_address(address):
                    extra.add(resolved)
        return cls(frozenset(extra))

    def socket_factory(self, addr_info: Any) -> socket.socket:
        """aiohttp's socket factory: refuses an address before a socket is connected to it."""
        family, type_, proto, _, sockaddr = addr_info
        if not self.allows(str(sockaddr[0])):
            raise BlockedAddressError(str(sockaddr[0]))
        return socket.socket(family=family, type=type_, proto=proto)

    def connector(self, **kwargs: Any) -> tuple[aiohttp.TCPConnector, "PolicyResolver"]:
        """A TCPConnector that resolves through the policy and checks every address it connects to.

        Returns the resolver too: the connector does not own it, the caller
        closes it after the connector.
        """
        resolver = PolicyResolver(self)
        return aiohttp.TCPConnector(resolver=resolver, socket_factory=self.socket_factory, **kwargs), resolver


class PolicyResolver(AbstractResolver):
    """Resolves with aiohttp's default resolver and keeps only the addresses the policy allows."""

    def __init__(self, policy: AddressPolicy, inner: AbstractResolver | None = None) -> None:
        self.policy = policy
        self._inner = inner

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> Any:
        if self._inner is None:
            self._inner = DefaultResolver()
        answers = await self._inner.resolve(host, port, family)
        allowed = [a for a in answers if self.policy.allows(str(a["host"]))]
        if not allowed:
            raise BlockedAddressError(host)
        return allowed

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()


def _is_blocked(exc: BaseException) -> bool:
    return isinstance(getattr(exc, "os_error", None), BlockedAddressError) or BLOCKED_MESSAGE in str(exc)


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
        """Write one record, or a request/response pair (request first), to the current file.

        Records are whole or absent: one cut short by an exception (a signal turned into
        one: SIGTERM, Ctrl-C) is cut back out, so the file can still be closed into place."""
        writer = self.writer
        start = self._file.tell()
        try:
            if len(records) == 2:
                writer.write_request_response_pair(*records)
            else:
                writer.write_record(records[0])
        except BaseException:
            self._file.flush()
            self._file.truncate(start)
            self._file.seek(start)
            raise
        if self._file is not None and self._file.tell() >= self.max_bytes:
            self.close()

    def close(self) -> None:
        """Finish the current file (fsync, rename into place); a no-op when none is open."""
        if self._file is None or self._final_path is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._final_path.with_name(self._final_path.name + ".tmp"), self._final_path)
        _fsync_dir(self.warc_dir)
        self.paths.append(str(self._final_path))
        self._file = self._writer = self._final_path = None


# ----------------------------------------------------------------------------- politeness


class HostGate:
    """Per-host limit on concurrent requests and on how soon the next one may start.

    A request may start no earlier than ``delay`` after the previous start and
    after the previous answer was finished, so one host never sees requests
    closer than ``delay`` apart, measured from either side. ``defer`` pushes the
    next start further out (a 429/503 answer's Retry-After).
    """

    def __init__(self, concurrency: int, delay_s: float) -> None:
        self.delay_s = delay_s
        self._slots = asyncio.Semaphore(concurrency)
        self._start_lock = asyncio.Lock()
        self._next_start = 0.0

    def defer(self, seconds: float) -> None:
        """No request to this host starts within ``seconds`` from now."""
        self._next_start = max(self._next_start, asyncio.get_running_loop().time() + seconds)

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


@dataclass
class RobotsRules:
    """One site's robots.txt verdicts: parsed rules, or allow-all (4xx), or disallow-all (unavailable)."""

    parser: Protego | None = None
    unavailable: bool = False

    def allows(self, url: str, agent: str) -> bool:
        if self.unavailable:
            return False
        return self.parser is None or bool(self.parser.can_fetch(url, agent))


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
    body: bytes = b""  # as sent (Content-Encoding kept), for the WARC record
    decoded: bytes | None = None  # the body without its Content-Encoding, when it had one
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


class Crawler:
    """One crawl: frontier, workers, robots cache, politeness gates, WARC and state."""

    session: aiohttp.ClientSession  # open for the duration of run()

    def __init__(self, cfg: CrawlConfig, out_dir: str | Path,
                 on_page: Callable[[CrawlResult], None] | None = None,
                 only: Iterable[tuple[str, int]] | None = None) -> None:
        self.on_page = on_page  # told after each stored page (progress display)
        # Frontier entries to fetch instead of the seeds (an earlier crawl's retry list, URLs as
        # recorded); the pages the state knows are not fetched again.
        self.only = None if only is None else [(str(u), int(d)) for u, d in only]
        self.retry: dict[str, int] = {}
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.result = CrawlResult(started_at=_utc_now_iso())
        self.skipped: Counter[str] = Counter()
        self.allowed_content_types = {t.lower() for t in cfg.allowed_content_types}
        self.robots_agent = cfg.user_agent.split("/", 1)[0].strip() or cfg.user_agent
        # Origin fetched -> origin recorded, and back (site_aliases).
        self.aliases = {parse_origin(k): parse_origin(v) for k, v in cfg.site_aliases.items()}
        self.unaliases = {recorded: fetched for fetched, recorded in self.aliases.items()}
        self.old_state: dict[str, dict[str, Any]] = {}
        self.state: dict[str, dict[str, Any]] = {}
        self.seen: set[str] = set()
        self.off_domain_urls: set[str] = set()  # counted once, however often linked
        self.too_deep_urls: set[str] = set()  # counted once; forgiven if found again closer to a seed
        self.queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self.gates: dict[str, HostGate] = {}
        self.robots: dict[str, asyncio.Task[RobotsRules]] = {}
        self.robots_unavailable: set[str] = set()
        self.pages_in_flight = 0  # fetches holding a max_pages slot
        self.pages_done = 0  # fetches that ended in a page (200 or 304)
        self.pages_since_checkpoint = 0
        self.interrupted: BaseException | None = None  # a signal's exception raised inside a worker
        self.page_budget = asyncio.Condition()
        self.warc = RotatingWarcWriter(self.out_dir / WARC_SUBDIR, cfg.warc_max_bytes, cfg.user_agent)
        self.seeds = [u for u in (normalize_url(s) for s in cfg.seed_urls) if u]
        self.scope = CrawlScope(self.seeds, cfg.allowed_domains)
        self.excluded = re.compile("|".join(f"(?:{p})" for p in cfg.exclude_url_patterns)) if cfg.exclude_url_patterns else None
        self.policy = AddressPolicy()  # replaced in run(), once the seed hosts are resolved

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

    def _discard_unfinished(self) -> None:
        """Remove what a killed crawl left half-written.

        A ``.tmp`` WARC file holds only pages written after the last saved state
        (the state is saved right after a file is closed), so the state does not
        know them and this crawl fetches them again.
        """
        warc_dir = self.out_dir / WARC_SUBDIR
        if warc_dir.is_dir():
            for leftover in warc_dir.glob("*.warc.gz.tmp"):
                leftover.unlink(missing_ok=True)
        for name in (STATE_FILE, REPORT_FILE):
            (self.out_dir / (name + ".tmp")).unlink(missing_ok=True)

    def _checkpoint(self) -> None:
        """Close the WARC file in progress, then save the state: every page the state knows is durable."""
        self.warc.close()
        _write_json_atomically(self.out_dir / STATE_FILE, self.state)
        self.pages_since_checkpoint = 0

    def _skip(self, url: str, reason: str, retry_depth: int | None = None) -> None:
        """Count ``url`` as not fetched; with ``retry_depth``, a transient ``reason`` puts
        the frontier entry on the retry list (``retry_depth`` is its depth)."""
        self.skipped[reason] += 1
        if reason not in POLICY_SKIPS and len(self.result.errors) < MAX_ERRORS_KEPT:
            self.result.errors.append((url, reason))
        if retry_depth is not None and transient(reason):
            self.retry[url] = retry_depth

    def _recorded(self, url: str) -> str:
        """The URL as WARC records and the state name it (``site_aliases`` applied)."""
        if self.aliases:
            origin = site_key(url)
            if origin in self.aliases:
                return self.aliases[origin] + url[len(origin):]
        return url

    def _fetchable(self, url: str) -> str:
        """The URL to fetch for one the state recorded."""
        if self.unaliases:
            origin = site_key(url)
            if origin in self.unaliases:
                return self.unaliases[origin] + url[len(origin):]
        return url

    def _enqueue(self, url: str, depth: int) -> None:
        if self.interrupted is not None or url in self.seen or url in self.off_domain_urls:
            return
        if not self.scope.allows(url):
            self.off_domain_urls.add(url)
            self._skip(url, "off_domain")
            return
        if self.excluded is not None and self.excluded.search(url):
            self.off_domain_urls.add(url)
            self._skip(url, "excluded")
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
        key = host_key(url)
        if key not in self.gates:
            self.gates[key] = HostGate(self.cfg.per_host_concurrency, self.cfg.per_host_delay_s)
        return self.gates[key]

    def _retry_wait(self, retry_after: str | None, retries: int) -> float:
        parsed = parse_retry_after(retry_after)
        return parsed if parsed is not None else self.cfg.retry_backoff_s * (2**retries)

    def _back_off(self, url: str, retry_after: str | None, retries: int) -> bool:
        """After a 429/503 answer: hold the host back; True when the request should be retried."""
        wait = self._retry_wait(retry_after, retries)
        self._gate(url).defer(min(wait, self.cfg.max_retry_wait_s))
        return retries < self.cfg.max_retries and wait <= self.cfg.max_retry_wait_s

    def _peer_allowed(self, resp: aiohttp.ClientResponse) -> bool:
        """The address the answer came from, checked once more against the address policy."""
        connection = resp.connection
        transport = connection.transport if connection is not None else None
        peer = transport.get_extra_info("peername") if transport is not None else None
        return not peer or self.policy.allows(str(peer[0]))

    # -- robots.txt ---------------------------------------------------------

    async def _robots_verdict(self, url: str) -> str | None:
        """None when robots.txt allows the URL, else the skip reason.

        "robots_unavailable" marks sites whose robots.txt answered 5xx or not at
        all: RFC 9309 says to treat them as fully disallowed, and the report
        should tell that apart from an explicit Disallow.
        """
        if not self.cfg.respect_robots:
            return None
        key = site_key(url)
        if key not in self.robots:
            self.robots[key] = asyncio.ensure_future(self._fetch_robots(key))
        rules = await self.robots[key]
        if rules.allows(url, self.robots_agent):
            return None
        return "robots_unavailable" if rules.unavailable else "robots"

    async def _fetch_robots(self, site: str) -> RobotsRules:
        """Rules for one site per RFC 9309: 4xx allows all; 5xx, no answer, or a redirect off the host disallows all.

        Redirects are followed (up to five) only on the same host and inside the
        crawl's scope; 429/503 answers are retried like pages.
        """
        url = site + "/robots.txt"
        hops = retries = 0
        while True:
            status, location, retry_after, body = await self._get_robots(url)
            if status in RETRY_STATUSES and self._back_off(url, retry_after, retries):
                retries += 1
                continue
            if status in REDIRECT_STATUSES and location:
                target = normalize_url(location, url)
                hops += 1
                if (
                    target is not None
                    and hops <= ROBOTS_MAX_REDIRECTS
                    and host_key(target) == host_key(url)
                    and self.scope.allows(target)
                ):
                    url = target
                    continue
                status = 0  # not followed: the rules are unknown
            break
        if 400 <= status < 500 and status != 429:
            return RobotsRules()
        if status != 200 or body is None:
            self.robots_unavailable.add(site)
            return RobotsRules(unavailable=True)
        try:
            parser = Protego.parse(body.decode("utf-8", errors="replace"))
            delay = parser.crawl_delay(self.robots_agent)
        except Exception:  # a robots.txt the parser cannot take: its rules are unknown
            self.robots_unavailable.add(site)
            return RobotsRules(unavailable=True)
        if delay:
            gate = self._gate(site)
            gate.delay_s = max(gate.delay_s, float(delay))
            gate.defer(float(delay))  # robots.txt's own request counts: the first page waits too
        return RobotsRules(parser=parser)

    async def _get_robots(self, url: str) -> tuple[int, str | None, str | None, bytes | None]:
        """(status, Location, Retry-After, decoded body) of one robots.txt request; status 0 when it failed.

        The body is decoded from its Content-Encoding and cut at ROBOTS_MAX_BYTES;
        a body that cannot be decoded comes back as None.
        """
        try:
            async with self._gate(url).slot():
                async with self.session.get(url, allow_redirects=False) as resp:
                    if not self._peer_allowed(resp):
                        return 0, None, None, None
                    status = resp.status
                    location, retry_after = resp.headers.get("Location"), resp.headers.get("Retry-After")
                    if status != 200:
                        return status, location, retry_after, None
                    decoder = BodyDecoder(resp.headers.get("Content-Encoding", ""), ROBOTS_MAX_BYTES)
                    raw = 0
                    async for chunk in resp.content.iter_chunked(READ_CHUNK):
                        raw += len(chunk)
                        decoder.feed(chunk)
                        if decoder.overflow or raw > 4 * ROBOTS_MAX_BYTES:
                            break  # what was read so far is enough
                    else:
                        decoder.finish()
                    return status, location, retry_after, decoder.output()[:ROBOTS_MAX_BYTES]
        except ValueError:  # unsupported or broken Content-Encoding
            return 200, None, None, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return 0, None, None, None

    # -- one HTTP exchange --------------------------------------------------

    def _conditional_headers(self, url: str) -> dict[str, str]:
        stored = self.old_state.get(self._recorded(url)) if self.cfg.incremental else None
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
                if self.result.bytes_fetched >= self.cfg.max_total_bytes:  # reached while this one waited
                    fetched.skip = "max_total_bytes"
                    return fetched
                async with self.session.get(
                    url, allow_redirects=False, headers=self._conditional_headers(url)
                ) as resp:
                    if not self._peer_allowed(resp):
                        fetched.skip = "blocked_address"
                        return fetched
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
        except (aiohttp.ClientError, OSError) as exc:
            fetched.skip = "blocked_address" if _is_blocked(exc) else "connection_error"
        return fetched

    async def _read_page_body(self, resp: aiohttp.ClientResponse, fetched: Fetched) -> None:
        """Streams the body in, stopping as soon as it, or what it decompresses to, passes max_page_bytes."""
        if fetched.content_type not in self.allowed_content_types:
            fetched.skip = "content_type"
            return
        limit = self.cfg.max_page_bytes
        if resp.content_length is not None and resp.content_length > limit:
            fetched.skip = "too_large"
            return
        try:
            decoder = BodyDecoder(fetched.header("Content-Encoding") or "", limit)
        except ValueError:  # an encoding we did not ask for: its size cannot be bounded
            fetched.skip = "content_encoding"
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in resp.content.iter_chunked(READ_CHUNK):
                chunks.append(chunk)
                size += len(chunk)
                decoder.feed(chunk)
                if size > limit or decoder.overflow:
                    fetched.skip = "too_large"
                    break
            else:
                decoder.finish()
        except ValueError:
            fetched.skip = "payload_error"
        self.result.bytes_fetched += size
        if fetched.skip is None:
            fetched.body = b"".join(chunks)
            fetched.decoded = None if decoder.identity else decoder.output()

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
            self._skip(url, verdict, depth)
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
        """Fetch a URL, following redirects hop by hop and retrying 429/503; True when it ended in a page.

        A redirect to a URL this crawl already has (fetched or queued) is not
        fetched again; it is counted as redirect_seen.
        """
        current = url
        hops = retries = 0
        while True:
            fetched = await self._request(current)
            if fetched.skip:
                self._skip(current, fetched.skip, depth)
                self._retry_from(url, current)
                return False
            if fetched.status in RETRY_STATUSES:
                if self._back_off(current, fetched.header("Retry-After"), retries):
                    retries += 1
                    continue
                self._skip(current, f"http_{fetched.status}", depth)
                self._retry_from(url, current)
                return False
            location = fetched.header("Location")
            if fetched.status in REDIRECT_STATUSES and location:
                target = normalize_url(location, current)
                if target is None:
                    self._skip(current, "bad_redirect")
                    return False
                hops += 1
                if hops > self.cfg.max_redirects:
                    self._skip(url, "redirect_limit")
                    return False
                if not self.scope.allows(target):
                    self._skip(target, "off_domain")
                    return False
                if self.excluded is not None and self.excluded.search(target):
                    self._skip(target, "excluded")
                    return False
                if target in self.seen:
                    self._skip(target, "redirect_seen")
                    return False
                self.seen.add(target)
                verdict = await self._robots_verdict(target)
                if verdict:
                    self._skip(target, verdict, depth)
                    self._retry_from(url, target)
                    return False
                current, retries = target, 0
                continue
            if fetched.status == 304 and self._recorded(current) in self.old_state:
                self._not_modified(fetched, depth)
                return True
            if fetched.status in GONE_STATUSES and self._recorded(current) in self.old_state:
                self._gone(fetched)
            if fetched.status != 200:
                self._skip(current, f"http_{fetched.status}", depth)
                self._retry_from(url, current)
                return False
            self._page(fetched, depth)
            return True

    def _retry_from(self, url: str, reached: str) -> None:
        """A redirect chain from ``url`` failed at ``reached``: the retry asks for ``url`` again
        (the chain's later hops are in ``seen`` and would otherwise count as redirect_seen)."""
        if reached != url and reached in self.retry:
            self.retry[url] = self.retry.pop(reached)

    def _not_modified(self, fetched: Fetched, depth: int) -> None:
        key = self._recorded(fetched.url)
        stored = dict(self.old_state[key])
        self.warc.write(self._revisit_record(fetched, stored))
        stored["fetched_at"] = _utc_now_iso()
        stored["etag"] = fetched.header("ETag") or stored.get("etag")
        stored["last_modified"] = fetched.header("Last-Modified") or stored.get("last_modified")
        self.state[key] = stored
        self.result.pages_not_modified += 1
        self._after_page([self._fetchable(link) for link in stored.get("outlinks", [])], depth)

    def _gone(self, fetched: Fetched) -> None:
        """A page an earlier crawl stored answers 404/410: that answer is stored as the page's
        latest capture (the data stage then retires its text) and the state forgets the page."""
        key = self._recorded(fetched.url)
        writer = self.warc.writer
        request = writer.create_warc_record(key, "request", http_headers=self._request_status_headers(fetched))
        response = writer.create_warc_record(
            key, "response", payload=io.BytesIO(b""), length=0,
            http_headers=StatusAndHeaders(
                f"{fetched.status} {fetched.reason}".strip(),
                # The body was not read: no header may describe one.
                [(k, v) for k, v in fetched.headers if k.lower() not in BODY_HEADERS],
                protocol=fetched.http_version,
            ),
        )
        self.warc.write(request, response)
        self.state.pop(key, None)
        self.result.pages_gone += 1
        self.result.changed_urls.append(key)

    def _page(self, fetched: Fetched, depth: int) -> None:
        key = self._recorded(fetched.url)
        digest = payload_digest(fetched.body)
        outlinks: list[str] = []
        if fetched.content_type in ("text/html", "application/xhtml+xml"):
            try:
                html = fetched.decoded if fetched.decoded is not None else fetched.body
                outlinks = extract_links(html, fetched.url, fetched.charset)
            except (ValueError, UnicodeError) as exc:
                self._skip(fetched.url, f"links_unreadable:{type(exc).__name__}")
        previous = self.old_state.get(key)
        if previous and previous.get("payload_sha1") == digest:
            self.warc.write(self._revisit_record(fetched, previous))
        else:
            writer = self.warc.writer
            request = writer.create_warc_record(key, "request", http_headers=self._request_status_headers(fetched))
            response = writer.create_warc_record(
                key,
                "response",
                payload=io.BytesIO(fetched.body),
                length=len(fetched.body),
                http_headers=StatusAndHeaders(
                    f"{fetched.status} {fetched.reason}".strip(), fetched.headers, protocol=fetched.http_version
                ),
            )
            self.warc.write(request, response)
            self.result.changed_urls.append(key)
        self.state[key] = {
            "etag": fetched.header("ETag"),
            "last_modified": fetched.header("Last-Modified"),
            "payload_sha1": digest,
            "fetched_at": _utc_now_iso(),
            "outlinks": [self._recorded(link) for link in outlinks],
        }
        self.result.pages_fetched += 1
        if self.on_page is not None:
            self.on_page(self.result)
        self._after_page(outlinks, depth)

    def _after_page(self, outlinks: list[str], depth: int) -> None:
        for link in outlinks:
            self._enqueue(link, depth + 1)
        self.pages_since_checkpoint += 1
        if self.pages_since_checkpoint >= self.cfg.checkpoint_pages:
            self._checkpoint()

    @staticmethod
    def _request_status_headers(fetched: Fetched) -> StatusAndHeaders:
        parts = urlsplit(fetched.url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return StatusAndHeaders(f"GET {target} HTTP/1.1", fetched.request_headers, is_http_request=True)

    def _revisit_record(self, fetched: Fetched, stored: dict[str, Any]) -> Any:
        """A revisit record pointing at the earlier capture with the same payload digest."""
        key = self._recorded(fetched.url)
        return self.warc.writer.create_revisit_record(
            key,
            digest=stored.get("payload_sha1") or payload_digest(fetched.body),
            refers_to_uri=key,
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
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                # A signal's exception (Prefect's TerminationSignal for SIGTERM) raised while this
                # task ran: asyncio would keep it on the task and the other workers would crawl on.
                # The crawl stops instead, and _run raises it once the queue is let go.
                self.interrupted = self.interrupted or exc
                self._let_go_of_queue()
            finally:
                self.queue.task_done()

    def _let_go_of_queue(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
            self.queue.task_done()

    async def _join_queue(self) -> None:
        await self.queue.join()
        if self.interrupted is not None:
            raise self.interrupted

    @contextlib.contextmanager
    def _exclusive(self) -> Any:
        """Holds ``out_dir/crawl.lock``: two crawls never write into one out_dir at once."""
        if fcntl is None:
            yield
            return
        with open(self.out_dir / LOCK_FILE, "a+") as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"another crawl is writing into {self.out_dir}") from None
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    async def run(self) -> CrawlResult:
        with self._exclusive():
            return await self._run()

    async def _run(self) -> CrawlResult:
        started = time.monotonic()
        self._discard_unfinished()
        self.old_state = self._load_state()
        self.state = dict(self.old_state)
        if self.only is not None:
            # Pages already stored are not asked for again; links found on the retried ones are followed.
            self.seen.update(self._fetchable(url) for url in self.old_state)
            for recorded, depth in self.only:
                url = self._fetchable(recorded)
                self.seen.discard(url)
                self._enqueue(url, depth)
        for seed in self.cfg.seed_urls if self.only is None else ():
            url = normalize_url(seed)
            if url is None:
                self._skip(seed, "bad_url")
            else:
                self._enqueue(url, 0)
        self.policy = await AddressPolicy.for_hosts(self.scope.hosts())
        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
        connector, resolver = self.policy.connector(
            limit=self.cfg.global_concurrency, limit_per_host=self.cfg.per_host_concurrency
        )
        headers = {"User-Agent": self.cfg.user_agent, "Accept-Encoding": "gzip, deflate"}
        try:
            # auto_decompress=False: the WARC keeps the body exactly as the server sent it.
            async with aiohttp.ClientSession(
                timeout=timeout, connector=connector, headers=headers, auto_decompress=False
            ) as self.session:
                workers = [asyncio.create_task(self._worker()) for _ in range(self.cfg.global_concurrency)]
                try:
                    await self._join_queue()
                    if self.only is None and self.cfg.incremental:
                        # Pages an earlier crawl stored that no link led to this time are asked for
                        # too: a page taken off the site answers 404, and its text is retired.
                        for recorded in self.old_state:
                            url = self._fetchable(recorded)
                            if url not in self.seen:
                                self._enqueue(url, self.cfg.max_depth)
                        await self._join_queue()
                finally:
                    for worker in workers:
                        worker.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
                    for task in self.robots.values():
                        task.cancel()
                    # Also when stopped (SIGTERM, Ctrl-C): the pages written so far and the state
                    # that knows them commit together, so a rerun neither fetches nor stores them twice.
                    self._checkpoint()
        finally:
            await resolver.close()
        self.result.retry = sorted((self._recorded(url), depth) for url, depth in self.retry.items())
        self.result.warc_paths = list(self.warc.paths)
        self.result.skipped = {reason: n for reason, n in sorted(self.skipped.items()) if n}
        self.result.elapsed_s = round(time.monotonic() - started, 3)
        _write_json_atomically(self.out_dir / REPORT_FILE, self.result.to_dict())
        return self.result


async def crawl_async(cfg: CrawlConfig, out_dir: str | Path,
                      on_page: Callable[[CrawlResult], None] | None = None,
                      only: Iterable[tuple[str, int]] | None = None) -> CrawlResult:
    """Crawl ``cfg.seed_urls`` into ``out_dir`` (WARC files, state, report); ``on_page``
    is told the running result after each stored page. ``only``: fetch these (URL,
    depth) entries instead of the seeds, an earlier crawl's ``retry`` list, and follow
    the links of what they give that the state does not know yet."""
    return await Crawler(cfg, out_dir, on_page, only).run()


def crawl(cfg: CrawlConfig, out_dir: str | Path, on_page: Callable[[CrawlResult], None] | None = None,
          only: Iterable[tuple[str, int]] | None = None) -> CrawlResult:
    """Blocking form of :func:`crawl_async`, for callers without an event loop."""
    return asyncio.run(crawl_async(cfg, out_dir, on_page, only))
