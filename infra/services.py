"""The services a command's settings name: a Ray cluster, an MLflow server, a Prefect server.

A service that does not answer is found before any work starts, with a TCP connect
bounded by a few seconds, and said in one sentence (:class:`ServiceUnreachable`):
the client libraries would otherwise retry for minutes (MLflow's HTTP retries: ~4
minutes per call), wait forever (``ray.init`` with nothing listening) or end in a
traceback of hundreds of lines. Written here because each library checks its own
service its own way and none bounds the first contact. A service that goes away
mid-run is watched the same way (:func:`watch`) where its library would not say so.
"""

from __future__ import annotations

import _thread
import os
import socket
import threading
import time
from typing import Callable
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


LOST_AFTER_S = 15.0  # a service that refuses connections this long mid-run is taken for gone
UNWIND_S = 20.0  # then the time the main thread has to end the command in its own words


class _Lost:
    sentence: str | None = None
    watched: set[str] = set()
    last_words: list[Callable[[str], None]] = []


def service_lost() -> str | None:
    """The sentence of the service :func:`watch` found gone, or None."""
    return _Lost.sentence


def on_lost(last_words: Callable[[str], None]) -> None:
    """What the command does with the sentence when its main thread cannot: called from the
    watch thread just before it ends the process with status 1."""
    _Lost.last_words.append(last_words)


def watch(what: str, address: str, setting: str, shown: str | None = None,
          active: Callable[[], bool] = lambda: True, lost_after_s: float = LOST_AFTER_S) -> None:
    """Watch ``address`` from a daemon thread while the command runs: once it has refused
    connections for ``lost_after_s`` while ``active()``, the main thread is interrupted (as
    by Ctrl-C) and :func:`service_lost` says why in one sentence, which the command prints
    with exit status 1, its runs closed as killed. A main thread held inside the library's
    own wait, where no Python signal handler runs, is given ``UNWIND_S``; then the
    :func:`on_lost` hooks run and the process ends with status 1.

    For a client library that neither raises nor gives up soon when its service dies
    mid-run: Ray's core waits a minute for a Ray head that is gone (in a GCS call from
    Ray Data's scheduling), then ends the process from C++ with its own message, the
    command's runs left open."""
    if address in _Lost.watched:
        return
    _Lost.watched.add(address)

    def run() -> None:
        down_since = None
        while True:
            if _Lost.sentence is not None:  # another watch thread found its service gone first
                return
            why = unreachable(address) if active() else None
            if why is None:
                down_since = None
            elif down_since is None:
                down_since = time.monotonic()
            elif time.monotonic() - down_since >= lost_after_s:
                _Lost.sentence = (f"The {what} at {shown or address} ({setting}) stopped answering mid-run "
                                  f"({why} for {lost_after_s:g} s); rerunning the same command once it is "
                                  f"back resumes where it stopped.")
                _thread.interrupt_main()
                break
            time.sleep(1.0)
        time.sleep(UNWIND_S)  # a command that ended in its own words ends this thread with it
        for last_words in _Lost.last_words:
            try:
                last_words(_Lost.sentence)
            except Exception:  # noqa: BLE001 - the process ends regardless
                pass
        os._exit(1)

    threading.Thread(target=run, name=f"watch {what}", daemon=True).start()
