"""The quality step's per-document work, in one process, without Ray.

Pages: every record of the given WARC files (default: the real samples
``../shared/data/warc/dolma/*.warc.gz`` and ``resiliparse/{warcfile,clueweb-quirk}.warc.gz``),
extracted with the project's reader and kept by language ID, once. With ``--scale k``
the list holds k copies of each page (the filters judge each page on its own, so
copies cost what the page costs).

The blocks of ``build_quality_blocks`` (default settings) then run over fresh copies
of those pages, chained as in the quality step (each page passes every filter before
the next one starts), ``--repeat`` times. Figures printed: pages, best and median wall
time, pages/s, the time per filter (a separate pass per filter, so the per-page caches
shared between filters do not help there), and the drop reasons. ``--profile N`` adds
cProfile's top N functions by own time of one chained pass.

    python benchmarks/bench_quality.py [--scale 10] [--repeat 5] [--profile 20]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path

from crawl2chat.stages.data.langid import LanguageId
from crawl2chat.stages.data.quality import build_quality_blocks
from crawl2chat.stages.data.settings import QualityConfig
from crawl2chat.stages.data.warc_input import WarcReader

WARC_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "warc"
DEFAULT_FILES = ("dolma/sample-0000.warc.gz", "dolma/sample-0001.warc.gz",
                 "resiliparse/warcfile.warc.gz", "resiliparse/clueweb-quirk.warc.gz")


def load_pages(files: list[str]) -> list[dict]:
    """Documents of ``files`` that extraction and language ID keep."""
    docs = [doc for path in files for doc in WarcReader().run(path)]
    return [doc for doc in LanguageId().run(docs) if not doc.get("drop_reason")]


def chained(blocks, pages: list[dict]) -> list[dict]:
    docs = iter(copy.deepcopy(pages))
    for block in blocks:
        docs = block.run(docs)
    return list(docs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="append", help="WARC/WET file (repeatable); default the shared samples")
    parser.add_argument("--scale", type=int, default=1, help="copies of each page")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    args = parser.parse_args()

    files = args.input or [str(WARC_DATA / name) for name in DEFAULT_FILES]
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise SystemExit(f"input files not found: {', '.join(missing)}")
    pages = load_pages(files) * args.scale
    blocks = build_quality_blocks(QualityConfig())

    times, judged = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        judged = chained(blocks, pages)
        times.append(time.perf_counter() - start)
    best, median = min(times), statistics.median(times)
    print(f"pages {len(pages)}  best {best:.3f}s  median {median:.3f}s  {len(pages) / best:,.0f} pages/s")

    per_block: dict[str, float] = {}
    docs = copy.deepcopy(pages)
    for block in blocks:
        start = time.perf_counter()
        docs = list(block.run(docs))
        per_block[block.name] = time.perf_counter() - start
    print("per filter: " + "  ".join(f"{name} {seconds:.3f}s" for name, seconds in per_block.items()))
    print("drop reasons: " + ", ".join(f"{r} {n}" for r, n in
                                       sorted(Counter(d["drop_reason"] or "kept" for d in judged).items())))

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        chained(blocks, pages)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
