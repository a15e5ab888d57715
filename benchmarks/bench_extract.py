"""resiliparse vs trafilatura on real HTML: speed and a boilerplate proxy.

Pages: every HTML response in the shared WARC samples (../shared/data/warc) plus,
with --pydoc N, N module pages served by the Python docs server on 127.0.0.1.

Figures printed per extractor:
  docs/s, MB/s            HTML bytes in, wall time of extraction alone
  empty                   pages that came back without text
  kept/full               output chars over all visible text (resiliparse, main_content=False)
  repeated lines          share of output lines that also occur on another page of the same
                          host: navigation, menus and footers repeat, prose does not
and, between the two, the mean word-set Jaccard agreement per page.

    python benchmarks/bench_extract.py [--pydoc 40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from resiliparse.extract.html2text import extract_plain_text
from warcio.archiveiterator import ArchiveIterator

from crawl2chat.stages.data.extract import decode_body, html_to_text, parse_content_type
from crawl2chat.stages.data.warc_input import list_input_files

WARC_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "warc"
EXTRACTORS = ("resiliparse", "trafilatura")


def warc_pages() -> list[tuple[str, str]]:
    """(host, html) of every 2xx HTML response in the shared samples."""
    pages = []
    for path in list_input_files([str(WARC_DATA)]):
        try:
            with open(path, "rb") as handle:
                for record in ArchiveIterator(handle, arc2warc=True):
                    http = record.http_headers
                    if record.rec_type != "response" or http is None or not (http.get_statuscode() or "").startswith("2"):
                        continue
                    mime, charset = parse_content_type(http.get_header("Content-Type"))
                    if mime != "text/html":
                        continue
                    body = record.content_stream().read()
                    url = record.rec_headers.get_header("WARC-Target-URI") or ""
                    pages.append((url.split("/")[2] if "//" in url else url, decode_body(body, charset)))
        except Exception:  # noqa: BLE001 - the deliberately broken samples; what was read is kept
            continue
    return pages


def pydoc_pages(count: int) -> list[tuple[str, str]]:
    """Module pages from ``python -m pydoc`` served on 127.0.0.1."""
    server = subprocess.Popen(
        [sys.executable, "-m", "pydoc", "-n", "127.0.0.1", "-p", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        line = server.stdout.readline()
        base = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        index = urllib.request.urlopen(base, timeout=30).read().decode()
        modules = sorted(set(re.findall(r'href="([a-z_]+\.html)"', index)))[:count]
        return [("pydoc", urllib.request.urlopen(base + m, timeout=60).read().decode()) for m in modules]
    finally:
        server.stdin.write("q\n")
        server.stdin.flush()
        server.wait(timeout=10)


def repeated_line_share(host_of: list[str], texts: list[str]) -> float:
    lines_by_host: dict[str, Counter] = defaultdict(Counter)
    for host, text in zip(host_of, texts):
        for line in {line.strip() for line in text.splitlines() if line.strip()}:
            lines_by_host[host][line] += 1
    total = repeated = 0
    for host, text in zip(host_of, texts):
        for line in (line.strip() for line in text.splitlines() if line.strip()):
            total += 1
            repeated += lines_by_host[host][line] > 1
    return repeated / max(total, 1)


def jaccard(a: str, b: str) -> float:
    wa, wb = set(a.split()), set(b.split())
    return len(wa & wb) / len(wa | wb) if wa | wb else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pydoc", type=int, default=40, help="module pages from the local pydoc server (0: none)")
    parser.add_argument("--repeat", type=int, default=3, help="timing passes; the fastest is reported")
    args = parser.parse_args()

    pages = warc_pages() if WARC_DATA.is_dir() else []
    if args.pydoc:
        pages += pydoc_pages(args.pydoc)
    pages = list(dict((html, (host, html)) for host, html in pages).values())  # same page in .warc and .warc.gz
    if not pages:
        sys.exit("no pages: shared WARC samples absent and --pydoc 0")
    hosts = [host for host, _ in pages]
    htmls = [html for _, html in pages]
    megabytes = sum(len(h.encode()) for h in htmls) / 1e6
    full = sum(len(extract_plain_text(h, preserve_formatting=True, main_content=False)) for h in htmls)
    print(f"{len(htmls)} pages, {megabytes:.2f} MB of HTML, {len(set(hosts))} hosts")

    outputs, seconds = {}, {}
    for name in EXTRACTORS:
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            texts = [html_to_text(h, name) for h in htmls]
            best = min(best, time.perf_counter() - start)
        outputs[name], seconds[name] = texts, best
        print(
            f"{name:12s} {len(htmls) / best:8.1f} docs/s {megabytes / best:7.2f} MB/s"
            f"  empty {sum(not t.strip() for t in texts):3d}"
            f"  kept/full {sum(map(len, texts)) / full:5.2f}"
            f"  repeated lines {repeated_line_share(hosts, texts):5.1%}"
        )
    a, b = EXTRACTORS
    agreement = sum(jaccard(x, y) for x, y in zip(outputs[a], outputs[b])) / len(htmls)
    print(f"speed ratio {a}/{b}: {seconds[b] / seconds[a]:.1f}x   mean word-set agreement {agreement:.2f}")


if __name__ == "__main__":
    main()
