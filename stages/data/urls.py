"""URLs as the crawler sees them: one spelling per page, origins, and the host
entries a user may widen a crawl with. Standard library only, so settings can
validate URL fields without loading the crawler."""

from __future__ import annotations

import ipaddress
from urllib.parse import urldefrag, urljoin, urlsplit, urlunsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


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
    netloc = host if port is None or port == DEFAULT_PORTS[scheme] else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a normalised URL, the port filled in when it is the default."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or DEFAULT_PORTS.get(scheme, 0)


def site_key(url: str) -> str:
    """scheme://host[:port] -- the unit robots.txt applies to."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def host_key(url: str) -> str:
    """The host alone -- the unit politeness applies to (http and https, every port)."""
    return (urlsplit(url).hostname or "").lower()


def parse_domain_entry(entry: str) -> tuple[str, int | None]:
    """An ``allowed_domains`` entry -> (host, port or None).

    ``"example.org"`` -> ("example.org", None), ``"example.org:8080"`` ->
    ("example.org", 8080), ``"[::1]:8080"`` -> ("::1", 8080), ``"::1"`` -> ("::1", None).
    Raises ValueError for anything else (a scheme, a path, a bad port).
    """
    text = entry.strip().lower()
    if not text or "://" in text or any(c in text for c in "/?#@") or any(c.isspace() for c in text):
        raise ValueError(f"{entry!r} is not a host or host:port")
    port: int | None = None
    port_text: str | None = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{entry!r} is not a host or host:port")
        port_text = rest[1:] if rest else None
        host = str(ipaddress.IPv6Address(host))
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        host = str(ipaddress.IPv6Address(text))
    else:
        host = text
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{entry!r} has no valid port")
        port = int(port_text)
    host = host.strip(".")
    if not host:
        raise ValueError(f"{entry!r} names no host")
    return host, port


def domain_entry_text(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def parse_origin(text: str) -> str:
    """``"http://127.0.0.1:8000/"`` -> ``"http://127.0.0.1:8000"``; ValueError unless an http(s) origin."""
    url = normalize_url(text)
    if url is None or urlsplit(url).path != "/" or urlsplit(url).query:
        raise ValueError(f"{text!r} is not an origin (scheme://host[:port])")
    return site_key(url)
