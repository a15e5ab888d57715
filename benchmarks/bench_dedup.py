"""Near-duplicate removal quality and cost: MinHash LSH vs SimHash on Ray Data.

The corpus is synthetic with known edit rates: each *family* is a base
document plus copies with 1%, 2%, 3%, 5%, 10%, 20% and 40% of their words replaced at
random positions, and unrelated documents are mixed in. Ground truth is the
exact Jaccard similarity of word 5-gram shingle sets (the shingles dedup
hashes): a copy *should* be removed when its Jaccard to the family's base is at
least the threshold implied by the banding, (1/b)^(1/r) = (1/14)^(1/8) ~ 0.72
for the default 14 bands x 8 rows. The base has the smallest id of its family,
so it is the copy every cluster keeps.

Reported per method and corpus size: document-level precision and recall of
``dedup:near`` drops, the share of copies removed per edit rate, wall time of
``dedup`` (including materialising its output) and peak memory: the driver's
peak RSS and the peak rise of the machine's used memory (Ray workers included).

    python benchmarks/bench_dedup.py              # 1x, 4x, 16x
    python benchmarks/bench_dedup.py --scales 1   # quick look
"""

from __future__ import annotations

import argparse
import itertools
import random
import resource
import tempfile
import threading
import time

import psutil
import ray
from ray.data.context import ShuffleStrategy

from crawl2chat.stages.data.dedup import dedup, word_shingles
from crawl2chat.stages.data.settings import DedupConfig

EDIT_RATES = (0.01, 0.02, 0.03, 0.05, 0.10, 0.20, 0.40)
VOCAB = ["".join(letters) for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=3)]


def make_corpus(families: int, unrelated: int, words: int, seed: int = 0) -> tuple[list[dict], dict[str, tuple]]:
    """Documents plus, for every copy, (base id, edit rate, Jaccard to base)."""
    rng = random.Random(seed)
    docs, truth = [], {}
    for f in range(families):
        base = [rng.choice(VOCAB) for _ in range(words)]
        base_id = f"f{f:06d}-0base"
        docs.append({"id": base_id, "text": " ".join(base), "drop_reason": None})
        base_shingles = word_shingles(" ".join(base), 5)
        for rate in EDIT_RATES:
            copy = list(base)
            for i in rng.sample(range(words), int(rate * words)):
                copy[i] = rng.choice(VOCAB)
            copy_id = f"f{f:06d}-copy{int(rate * 100):02d}"
            text = " ".join(copy)
            shingles = word_shingles(text, 5)
            jaccard = len(shingles & base_shingles) / len(shingles | base_shingles)
            docs.append({"id": copy_id, "text": text, "drop_reason": None})
            truth[copy_id] = (base_id, rate, jaccard)
    for u in range(unrelated):
        docs.append({"id": f"u{u:06d}", "text": " ".join(rng.choice(VOCAB) for _ in range(words)), "drop_reason": None})
    rng.shuffle(docs)
    return docs, truth


class MemoryPeak:
    """Samples the machine's used memory in a thread; ``rise`` is peak - start."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.start = psutil.virtual_memory().used
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, psutil.virtual_memory().used)
            time.sleep(self.interval_s)

    def __enter__(self) -> "MemoryPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def rise_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def evaluate(rows: list[dict], truth: dict[str, tuple], threshold: float) -> dict:
    removed = {r["id"] for r in rows if r["drop_reason"] == "dedup:near"}
    should = {doc_id for doc_id, (_, _, jaccard) in truth.items() if jaccard >= threshold}
    hits = len(removed & should)
    per_rate = {}
    for rate in EDIT_RATES:
        copies = [doc_id for doc_id, (_, r, _) in truth.items() if r == rate]
        per_rate[rate] = sum(doc_id in removed for doc_id in copies) / len(copies)
    return {
        "precision": hits / len(removed) if removed else 1.0,
        "recall": hits / len(should) if should else 1.0,
        "per_rate": per_rate,
        "wrongly_removed_unrelated": sum(doc_id.startswith("u") for doc_id in removed),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--families", type=int, default=100, help="families at scale 1")
    parser.add_argument("--unrelated", type=int, default=200, help="unrelated documents at scale 1")
    parser.add_argument("--words", type=int, default=300)
    parser.add_argument("--shuffle", choices=["sort", "hash"], default="sort")
    parser.add_argument("--num-shards", type=int, default=8)
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.shuffle_strategy = (
        ShuffleStrategy.SORT_SHUFFLE_PULL_BASED if args.shuffle == "sort" else ShuffleStrategy.SHUFFLE_V2
    )
    threshold = (1 / 14) ** (1 / 8)
    print(f"true near-duplicate: Jaccard(5-gram shingles) >= {threshold:.3f} = (1/14)^(1/8)")

    # Warm the cluster (worker processes, imports) so the first timing is fair.
    warm_docs, _ = make_corpus(2, 2, 50, seed=99)
    dedup(ray.data.from_items(warm_docs), DedupConfig(num_shards=args.num_shards), tempfile.mkdtemp())[0].count()

    results = []
    for scale in args.scales:
        docs, truth = make_corpus(args.families * scale, args.unrelated * scale, args.words, seed=scale)
        mean_j = {rate: sum(j for _, r, j in truth.values() if r == rate) / args.families / scale for rate in EDIT_RATES}
        print(f"scale {scale}x: {len(docs)} docs; mean Jaccard to base by edit rate: "
              + ", ".join(f"{int(r * 100)}%={j:.2f}" for r, j in mean_j.items()))
        for method in ("minhash", "simhash"):
            cfg = DedupConfig(method=method, num_shards=args.num_shards)
            ds = ray.data.from_items(docs, override_num_blocks=max(2, len(docs) // 500)).materialize()
            with MemoryPeak() as memory:
                start = time.perf_counter()
                out, stats = dedup(ds, cfg, tempfile.mkdtemp())
                rows = out.select_columns(["id", "drop_reason"]).take_all()
                seconds = time.perf_counter() - start
            quality = evaluate(rows, truth, threshold)
            results.append((scale, len(docs), method, seconds, memory.rise_mib, stats, quality))

    driver_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    header = (f"{'scale':>5} {'docs':>6} {'method':>8} {'time_s':>7} {'docs/s':>7} {'mem_rise_MiB':>12} "
              f"{'prec':>5} {'recall':>6} " + " ".join(f"rm@{int(r * 100)}%".rjust(6) for r in EDIT_RATES)
              + f" {'cand_links':>10} {'rounds':>6} {'fp_unrel':>8}")
    print(header)
    for scale, n, method, seconds, rise, stats, q in results:
        print(f"{scale:>4}x {n:>6} {method:>8} {seconds:>7.1f} {n / seconds:>7.0f} {rise:>12.0f} "
              f"{q['precision']:>5.2f} {q['recall']:>6.2f} "
              + " ".join(f"{q['per_rate'][r]:>6.2f}" for r in EDIT_RATES)
              + f" {stats['candidate_links']:>10} {stats['cc_rounds']:>6} {q['wrongly_removed_unrelated']:>8}")
    print(f"driver peak RSS: {driver_rss:.0f} MiB (shuffle strategy: {args.shuffle})")


if __name__ == "__main__":
    main()
