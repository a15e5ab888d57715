"""The services a command's settings name: a Ray cluster, an MLflow server, a Prefect server.

A service that does not answer is found before any work starts, with a TCP connect
bounded by a few seconds, and said in one sentence (:class:`ServiceUnreachable`):
the client libraries would otherwise retry for minutes (MLflow's HTTP retries: ~4
minutes per call), wait forever (``ray.init`` with nothing listening) or end in a
traceback of hundreds of lines. Written here because each library checks its own
service its own way and none bounds the first contact.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 5.0


class ServiceUnreachable(RuntimeError):
    """A service the settings name does not answer; the message is one sentence."""


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a URL (``http://h:p/...``, ``ray://h:p``) or a ``host:port``; None
    when the address names no network endpoint (``auto``, a file store, a database URI)."""
    if "://" in address:
        parts = urlsplit(address)
        if parts.scheme not in ("http", "https", "ray"):
            return None
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        return (parts.hostname, port) if parts.hostname and port else None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def unreachable(address: str) -> str | None:
    """Why ``address`` does not take a TCP connection (``connection refused``, ``timed out``,
    ``no such host``), or None when it does or names no network endpoint."""
    endpoint = host_port(address)
    if endpoint is None:
        return None
    try:
        with socket.create_connection(endpoint, timeout=CONNECT_TIMEOUT_S):
            return None
    except socket.gaierror:
        return "no such host"
    except TimeoutError:
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    except OSError as e:
        return (e.strerror or type(e).__name__).lower()


def require(what: str, address: str, setting: str) -> None:
    """Raise :class:`ServiceUnreachable` when ``address`` (named by ``setting``) does not answer."""
    why = unreachable(address)
    if why:
        raise ServiceUnreachable(f"The {what} at {address} ({setting}) does not answer: {why}; start it, "
                                 f"or unset {setting} to use the embedded default.")
