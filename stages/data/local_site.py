"""A real web site every machine has: the Python standard library docs served by pydoc.

The crawl stage's embedded default target, used by tests and offline demos:
``python -m pydoc -p PORT`` serves HTML pages for every installed module, with
links between them, on 127.0.0.1 only. Its robots.txt is pydoc's ordinary
"not found" page (status 200, no rules), which allows everything.

The site keeps one identity between runs when given an ``identity_file``: the
first run records its root URL there, later runs start on that port again when
it is free, and otherwise on a free port with ``aliases`` mapping the new origin
to the recorded one (the crawler's ``site_aliases``), so the pages keep their
URLs and a re-crawl into the same folder finds them unchanged. pydoc sends no
ETag or Last-Modified, so unchanged pages are recognised by their payload digest;
pydoc renders some default values with their memory addresses (``<object object
at 0x7f...>``, a library ``handle``), which differ on every start, so the served
pages have those numbers replaced by ``0x…`` (:data:`_STABLE_PYDOC`) and stay
byte for byte the same between runs.

Building a module's page imports that module inside the pydoc process. The
environment variable ``BROWSER`` is set to ``true`` there so a module that opens
a web browser on import (``antigravity``) does nothing instead of reaching out
to the internet.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from crawl2chat.stages.data.urls import site_key
from crawl2chat.stages.lifetime import stop_process

_READY_LINE = re.compile(r"Server ready at (http://\S+/)")
# ``python -S -c`` (no site-packages, so not this package): pydoc's command line with its
# page builder wrapped to replace memory addresses, which change on every start.
_STABLE_PYDOC = """\
import re, sys, pydoc
_pages, _address = pydoc._url_handler, re.compile(r"\\b0x[0-9a-f]{6,}\\b|(?<=handle )[0-9a-f]{6,}\\b")
def _stable(url, content_type="text/html"):
    page = _pages(url, content_type)
    return _address.sub("0x\N{HORIZONTAL ELLIPSIS}", page) if isinstance(page, str) else page
pydoc._url_handler = _stable
sys.argv[0] = "pydoc"
pydoc.cli()
"""
# The readiness probe goes straight to 127.0.0.1, whatever proxy the environment names.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PydocSite:
    """Context manager running ``pydoc`` as an HTTP server; ``.url`` is its root ("http://127.0.0.1:PORT/").

    ``port``: the port to try first (0: any free port). ``identity_file``: where
    the site's stable root URL is kept between runs (see the module docstring);
    ``.site_url`` is that root and ``.aliases`` maps ``.url``'s origin to it
    when the two differ.
    """

    # Pages of the embedded crawl that are slow to build and poor training text: the
    # standard library's test suites (``test``, ``ctypes.test``, ``distutils.tests``, ...),
    # turtle demos, lib2to3's fixers,
    # one page per codec, pydoc's data tables and source listings.
    LOW_VALUE_PAGES = (r"[/.]tests?(\.|/|$)", r"/turtledemo", r"/lib2to3", r"/encodings\.",
                       r"/pydoc_data", r"/ensurepip", r"getfile\?")

    IDENTITY_FILE = "local_site.json"

    def __init__(self, start_timeout_s: float = 30.0, port: int = 0, identity_file: str | Path | None = None) -> None:
        self.start_timeout_s = start_timeout_s
        self.port = port
        self.identity_file = Path(identity_file) if identity_file else None
        self.url = ""
        self.site_url = ""
        self._process: subprocess.Popen[str] | None = None

    @property
    def aliases(self) -> dict[str, str]:
        """{origin served now: recorded origin} when the recorded port was taken, else {}."""
        if not self.site_url or site_key(self.site_url) == site_key(self.url):
            return {}
        return {site_key(self.url): site_key(self.site_url)}

    def _recorded_url(self) -> str | None:
        if self.identity_file is None:
            return None
        try:
            url = json.loads(self.identity_file.read_text(encoding="utf-8"))["url"]
            parts = urlsplit(url)
            if parts.scheme == "http" and parts.hostname == "127.0.0.1" and parts.port and parts.path == "/":
                return url
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None  # none yet, or unreadable: this run's address becomes the identity

    def __enter__(self) -> "PydocSite":
        recorded = self._recorded_url()
        wanted = (urlsplit(recorded).port or 0) if recorded else self.port
        try:
            self._start(wanted)
        except RuntimeError:
            if not wanted:
                raise
            self._start(0)  # the port is taken (by something else): any free one, under the recorded identity
        self.site_url = recorded or self.url
        if self.identity_file is not None and recorded is None:
            self.identity_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.identity_file.with_name(self.identity_file.name + ".tmp")
            tmp.write_text(json.dumps({"url": self.url}), encoding="utf-8")
            os.replace(tmp, self.identity_file)
        return self

    def _start(self, port: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", BROWSER="true")
        self._process = subprocess.Popen(
            # -S: document the standard library only, the same on every machine, without
            # importing (and serving pages for) whatever else the environment has installed.
            [sys.executable, "-S", "-c", _STABLE_PYDOC, "-n", "127.0.0.1", "-p", str(port)],
            # pydoc stops serving at end of input, so stdin stays an open pipe.
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            self.url = self._read_url()
            self._wait_until_answering()
        except BaseException:
            self._stop()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def _read_url(self) -> str:
        """The URL from pydoc's "Server ready at ..." line, read by a thread so a silent pydoc cannot hang us.

        pydoc prints an error instead and exits when it cannot listen (a port in use).
        """
        assert self._process is not None and self._process.stdout is not None
        stdout = self._process.stdout
        found: list[str] = []
        ready = threading.Event()

        def read_stdout() -> None:
            # Keeps draining after the ready line: modules printing on import
            # would otherwise fill the pipe and block the server.
            for line in stdout:
                match = _READY_LINE.search(line)
                if match and not found:
                    found.append(match.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read_stdout, name="pydoc-stdout", daemon=True).start()
        if not ready.wait(self.start_timeout_s) or not found:
            raise RuntimeError("pydoc server did not report its address")
        return found[0]

    def _wait_until_answering(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                with _NO_PROXY.open(self.url, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pydoc server at {self.url} does not answer") from None
            time.sleep(0.05)

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        stop_process(process)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
