"""Screenshots of web pages with headless Chromium, driven through its DevTools protocol.

    python scripts/ui_screenshot.py FILE URL [--before JS] [FILE URL [--before JS] ...]

Each page is loaded in a fresh tab of one headless Chromium (a temporary profile),
given ``--wait`` seconds to render (single-page UIs fetch their data after
loading), then ``--before`` runs in the page (e.g. to close a side panel) and the
visible viewport is saved as a PNG. Used by ``scripts/ui_snapshots.sh``; needs
the ``chromium`` command and the ``websockets`` package (a Prefect dependency).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import subprocess
import tempfile
import time
import urllib.request

from websockets.sync.client import connect

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--remote-debugging-port=0", "--remote-allow-origins=*"]


class Tab:
    def __init__(self, ws_url: str) -> None:
        self.ws = connect(ws_url, max_size=64 * 2**20)
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def close(self) -> None:
        self.ws.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chromium", default="chromium")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--wait", type=float, default=10.0, help="seconds a page gets to render")
    parser.add_argument("shots", nargs="+", help="FILE URL [--before JS], repeated")
    args, rest = parser.parse_known_args()
    tokens = args.shots + rest
    shots = []
    while tokens:
        path, url, *tokens = tokens
        before = None
        if tokens[:1] == ["--before"]:
            before, tokens = tokens[1], tokens[2:]
        shots.append((path, url, before))

    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen([args.chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                    f"--window-size={args.width},{args.height}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            port = None
            for line in browser.stderr:
                found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
                if found:
                    port = int(found.group(1))
                    break
            if port is None:
                raise SystemExit("chromium did not open its DevTools port")
            for path, url, before in shots:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
                target = json.loads(urllib.request.urlopen(request, timeout=30).read())
                tab = Tab(target["webSocketDebuggerUrl"])
                try:
                    tab.call("Emulation.setDeviceMetricsOverride", width=args.width, height=args.height,
                             deviceScaleFactor=1, mobile=False)
                    tab.call("Page.enable")
                    tab.call("Page.navigate", url=url)
                    time.sleep(args.wait)
                    if before:
                        result = tab.call("Runtime.evaluate", expression=before, awaitPromise=True,
                                          returnByValue=True)["result"]
                        if result.get("value") is not None:
                            print(f"{path}: {result['value']}", flush=True)
                        time.sleep(2)
                    data = tab.call("Page.captureScreenshot", format="png")["data"]
                finally:
                    tab.close()
                with open(path, "wb") as f:
                    f.write(base64.b64decode(data))
                print(f"{path} <- {url}", flush=True)
        finally:
            browser.terminate()
            try:
                browser.wait(timeout=20)
            except subprocess.TimeoutExpired:
                browser.kill()


if __name__ == "__main__":
    main()
