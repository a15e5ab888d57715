"""A real web site every machine has: the Python standard library docs served by pydoc.

The crawl stage's embedded default target, used by tests and offline demos:
``python -m pydoc -p 0`` serves HTML pages for every installed module, with
links between them, on 127.0.0.1 only. Its robots.txt is pydoc's ordinary
"not found" page (status 200, no rules), which allows everything.

Building a module's page imports that module inside the pydoc process. The
environment variable ``BROWSER`` is set to ``true`` there so a module that opens
a web browser on import (``antigravity``) does nothing instead of reaching out
to the internet.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType

_READY_LINE = re.compile(r"Server ready at (http://\S+/)")
# The readiness probe goes straight to 127.0.0.1, whatever proxy the environment names.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PydocSite:
    """Context manager running ``pydoc`` as an HTTP server; ``.url`` is its root ("http://127.0.0.1:PORT/")."""

    def __init__(self, start_timeout_s: float = 30.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> "PydocSite":
        env = dict(os.environ, PYTHONUNBUFFERED="1", BROWSER="true")
        self._process = subprocess.Popen(
            # -S: document the standard library only, the same on every machine, without
            # importing (and serving pages for) whatever else the environment has installed.
            [sys.executable, "-S", "-m", "pydoc", "-n", "127.0.0.1", "-p", "0"],
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
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def _read_url(self) -> str:
        """The URL from pydoc's "Server ready at ..." line, read by a thread so a silent pydoc cannot hang us."""
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
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
