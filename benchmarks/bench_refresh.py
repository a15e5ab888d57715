"""Incremental refresh of a dataset against a full rebuild, side by side.

The data stage commits dataset versions (stages/data/versions.py). A refresh
(``data.refresh=true``, ``data_flow(cfg, refresh=True)``) reads only the input
files no earlier version read, deduplicates them against the persisted dedup
indexes of every earlier version, and commits a version that lists the earlier
shards untouched plus its own. This script measures what that saves.

Corpus (synthetic, written here with warcio, gzipped WARC, no network): ``--files``
WARC files of ``--pages`` HTML pages each (``Content-Type: text/html;
charset=utf-8``, URLs on hosts under example.com) of English prose generated from a
small grammar over a few hundred common words: 5-8 paragraphs of 4-6 full sentences,
so every page passes the Gopher, C4 and FineWeb rules and fastText language ID.
``--dup-rate`` (5%) of the pages of each file are copies of earlier pages under other
URLs, half exact, half near (``--near-edits`` words replaced). Then ``--new-files``
more files of new pages, ``--new-dup-rate`` (10%) of them copies (exact and near) of
pages of the first files: what a re-crawl adds.

    peer (A):      full build of the first N files -> v0001, then add the K new files
                   and REFRESH -> v0002 (timed)
    baseline (B):  full build from scratch of all N+K files into a fresh folder (timed)

Both run in this process through ``crawl2chat.flows.data.data_flow`` (a temporary
Prefect API from ``prefect_test_harness``, MLflow in a temporary home) on the data
engine ``--engine`` picks (``auto``: in this process for an input this small; with
``ray``, one local Ray of ``--workers`` CPUs started first and shared by every run,
so the first build pays Ray's start-up, not the timed ones). Reported side by side: wall time of the
flow call and of each step (from the manifest's ``steps``), documents read by each
step (``rows_in``), WARC bytes read, documents kept, duplicates dropped, and for the
refresh how many of its dedup drops point at a document of v0001 (``dup_cluster`` of
the dropped rows in the version's dedup step folder). Every page's origin is known,
so both sides' final shards are checked against the ground truth: distinct pages
kept, pages kept twice (a missed duplicate), pages lost. The refresh keeps the
earlier version's copy of a duplicate, the rebuild the one with the smallest id, and
MinHash is probabilistic, so any difference in the final counts is reported, not
asserted.

    .venv/bin/python benchmarks/bench_refresh.py            # 16 files x 40 pages, +2 files
    .venv/bin/python benchmarks/bench_refresh.py --quick    # 4 files x 20 pages, +1 file
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

# Before prefect (and mlflow, ray) are imported: a slow machine needs the longer
# start-up timeout, and nothing here reports usage or talks to a configured server.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
    os.environ.pop(_var, None)

STEPS = ("extract", "langid", "quality", "dedup", "balance")

# --------------------------------------------------------------------------- prose

DETERMINERS = ["the", "a", "every", "this", "that", "each", "our", "their", "one", "no", "some", "her", "his"]
ADJECTIVES = (
    "old new small large quiet busy bright dark warm cold early late narrow wide long short green blue red "
    "heavy light simple careful strange famous local distant gentle strong young ancient empty crowded open "
    "hidden wooden golden silver rough smooth tall low deep calm wild patient clever honest proud tired "
    "happy serious common rare final main whole public private modern rural northern southern"
).split()
NOUNS = (
    "river town market bridge morning water boat fish bread wine farm valley garden weather price harvest "
    "letter city season traveller story mountain forest road winter family teacher student school book "
    "library window door house street village church field horse dog cat bird tree flower island harbour "
    "ship sailor captain doctor nurse hospital kitchen table chair lamp clock painting music song poem "
    "newspaper office worker manager company factory machine engine train station ticket journey map "
    "country government law court judge council meeting plan report question answer problem idea lesson "
    "history science language word voice friend neighbour child mother father brother sister king queen "
    "soldier army castle wall tower gate hill lake sea shore beach rain snow wind storm sun moon star night "
    "evening afternoon week month year century museum gallery theatre film camera photograph letterbox "
    "baker butcher farmer miller carpenter merchant shop basket coat hat shoe glove bottle cup plate"
).split()
VERBS = (
    "found carried watched opened closed built crossed followed reached visited painted wrote read sold "
    "bought cleaned repaired described remembered noticed explained discovered measured collected shared "
    "planted moved lifted pulled pushed studied finished started changed protected welcomed guided "
    "answered signed printed counted covered filled joined left kept showed taught helped called"
).split()
PREPOSITIONS = ["in", "near", "across", "behind", "under", "over", "beside", "through", "along", "without",
                "after", "before", "from", "with", "into", "toward", "around", "beyond", "during", "for"]
ADVERBS = ("slowly quickly carefully quietly early again often rarely together finally suddenly gently "
           "happily clearly easily nearly").split()
CONNECTIVES = [", and", ", but", ", while", ", so", " because", " when", " until", ", although"]
SUBJECT_PRONOUNS = ["she", "he", "they", "we", "i", "you", "everyone", "nobody", "someone"]


def _noun_phrase(rng: random.Random) -> list[str]:
    det = rng.choice(DETERMINERS)
    words = [rng.choice(ADJECTIVES)] if rng.random() < 0.55 else []
    words.append(rng.choice(NOUNS))
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    plural = det in ("the", "some", "our", "their", "her", "his", "no") and rng.random() < 0.3
    if plural:
        noun = words[-1]
        if noun.endswith("y") and noun[-2] not in "aeiou":
            words[-1] = noun[:-1] + "ies"
        else:
            words[-1] = noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")
    return [det] + words


def _clause(rng: random.Random) -> list[str]:
    subject = _noun_phrase(rng) if rng.random() < 0.8 else [rng.choice(SUBJECT_PRONOUNS)]
    words = subject + [rng.choice(VERBS)] + _noun_phrase(rng)
    if rng.random() < 0.75:
        words += [rng.choice(PREPOSITIONS)] + _noun_phrase(rng)
    if rng.random() < 0.3:
        words.append(rng.choice(ADVERBS))
    return words


def sentence(rng: random.Random) -> list[str]:
    """One sentence as a list of words; the first is capitalised, the last ends with a period."""
    words = _clause(rng)
    if rng.random() < 0.4:
        conn = rng.choice(CONNECTIVES)
        if conn.startswith(","):
            words[-1] += ","
            words.append(conn[2:])
        else:
            words.append(conn.strip())
        words += _clause(rng)
    words[0] = words[0].capitalize()
    words[-1] += "."
    return words


@dataclass
class Page:
    url: str
    title: str
    paragraphs: list[list[list[str]]]  # paragraph -> sentence -> word
    origin: str  # key of the original page this one is (or copies)
    kind: str  # "original", "exact" or "near"


def original_page(key: str, url: str, rng: random.Random) -> Page:
    paragraphs = [[sentence(rng) for _ in range(rng.randint(4, 6))] for _ in range(rng.randint(5, 8))]
    title = " ".join(w.strip(".,") for w in paragraphs[0][0][:6]).capitalize()
    return Page(url, title, paragraphs, key, "original")


def copy_page(src: Page, url: str, rng: random.Random, near_edits: int) -> Page:
    """An exact copy (``near_edits`` 0) or one with that many words replaced by other nouns."""
    paragraphs = [[list(s) for s in p] for p in src.paragraphs]
    if near_edits:
        spots = [(p, s, w) for p, para in enumerate(paragraphs) for s, sent in enumerate(para)
                 for w in range(1, len(sent) - 1) if sent[w].isalpha()]
        for p, s, w in rng.sample(spots, near_edits):
            paragraphs[p][s][w] = rng.choice([n for n in NOUNS if n != paragraphs[p][s][w]])
    return Page(url, src.title, paragraphs, src.origin, "near" if near_edits else "exact")


def page_html(page: Page) -> bytes:
    body = "\n".join("<p>" + " ".join(" ".join(s) for s in para) + "</p>" for para in page.paragraphs)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{page.title}</title></head>\n<body><article>\n{body}\n</article></body></html>\n"
    ).encode("utf-8")


def page_words(page: Page) -> int:
    return sum(len(s) for para in page.paragraphs for s in para)


# --------------------------------------------------------------------------- corpus


def plan_corpus(files: int, pages: int, new_files: int, dup_rate: float, new_dup_rate: float,
                near_edits: int, seed: int) -> list[list[Page]]:
    """Pages per file: the first ``files`` files, then the ``new_files`` files of the re-crawl.

    Copies in the first files copy earlier originals of those files; copies in the new
    files copy originals of the first files only, so every duplicate the refresh drops
    is a duplicate of a document of the first version.
    """
    rng = random.Random(seed)
    out: list[list[Page]] = []
    first_originals: list[Page] = []
    n_copied = 0  # copies alternate exact, near, exact, ... over the whole corpus
    for f in range(files + new_files):
        is_new = f >= files
        rate = new_dup_rate if is_new else dup_rate
        n_copies = min(pages - 1, max(1, round(pages * rate))) if rate > 0 else 0
        copy_slots = set(rng.sample(range(1, pages), n_copies)) if n_copies else set()
        host = f"site{f % 5}.example.com"
        file_pages: list[Page] = []
        for i in range(pages):
            url = f"https://{host}/{'recrawl' if is_new else 'crawl'}/f{f:03d}/page-{i:04d}.html"
            pool = first_originals + ([] if is_new else [p for p in file_pages if p.kind == "original"])
            if i in copy_slots and pool:
                src = rng.choice(pool)
                edits = near_edits if n_copied % 2 else 0
                n_copied += 1
                mirror = f"https://mirror{rng.randint(1, 3)}.example.com/{'recrawl' if is_new else 'crawl'}"
                page = copy_page(src, f"{mirror}/f{f:03d}/copy-{i:04d}.html", rng, edits)
            else:
                page = original_page(f"f{f:03d}p{i:04d}", url, rng)
            file_pages.append(page)
        if not is_new:
            first_originals += [p for p in file_pages if p.kind == "original"]
        out.append(file_pages)
    return out


def write_warc(path: Path, pages: list[Page], file_index: int) -> None:
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=True)
        for i, page in enumerate(pages):
            body = page_html(page)
            http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                                               ("Content-Length", str(len(body)))], protocol="HTTP/1.1")
            record_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{page.url}#{file_index}/{i}")
            date = f"2024-{1 + file_index % 12:02d}-{1 + i % 28:02d}T12:00:00Z"
            record = writer.create_warc_record(
                page.url, "response", payload=io.BytesIO(body), length=len(body), http_headers=http,
                warc_headers_dict={"WARC-Record-ID": f"<urn:uuid:{record_id}>", "WARC-Date": date},
            )
            writer.write_record(record)


def build_corpus(root: Path, args: argparse.Namespace) -> tuple[list[str], list[str], dict[str, Page]]:
    plan = plan_corpus(args.files, args.pages, args.new_files, args.dup_rate, args.new_dup_rate,
                       args.near_edits, args.seed)
    corpus = root / "warc"
    corpus.mkdir(parents=True, exist_ok=True)
    paths = []
    for f, pages in enumerate(plan):
        path = corpus / f"crawl-{f:03d}.warc.gz"
        write_warc(path, pages, f)
        paths.append(str(path))
    by_url = {p.url: p for pages in plan for p in pages}
    return paths[: args.files], paths[args.files:], by_url


def describe_corpus(by_url: dict[str, Page], old: list[str], new: list[str]) -> None:
    pages = list(by_url.values())
    kinds = {k: sum(p.kind == k for p in pages) for k in ("original", "exact", "near")}
    new_pages = [p for p in pages if "/recrawl/" in p.url]
    words = [page_words(p) for p in pages]
    size = sum(os.path.getsize(p) for p in old + new)
    print(f"corpus: {len(old)} + {len(new)} new WARC files, {len(pages)} pages ({size / 2**20:.2f} MiB gzipped), "
          f"{min(words)}-{max(words)} words per page")
    print(f"  originals {kinds['original']}, exact copies {kinds['exact']}, near copies {kinds['near']}; "
          f"new files: {len(new_pages)} pages, of them {sum(p.kind != 'original' for p in new_pages)} copies of "
          f"pages of the first {len(old)} files")


# --------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    label: str
    seconds: float
    manifest: dict
    out: Path


def run_flow(label: str, home: Path, out: Path, inputs: list[str], refresh: bool, engine: str) -> RunResult:
    from crawl2chat.flows.data import data_flow
    from crawl2chat.stages.settings import load_config

    cfg = load_config(overrides={"home": str(home), "data.out": str(out), "data.inputs": list(inputs),
                                 "data.engine": engine})
    print(f"--- {label}: {'refresh' if refresh else 'full build'} of {len(inputs)} input files -> {out.name}",
          flush=True)
    start = time.perf_counter()
    manifest = data_flow(cfg, refresh=refresh)
    seconds = time.perf_counter() - start
    print(f"--- {label}: {manifest['version']} in {seconds:.1f}s", flush=True)
    return RunResult(label, seconds, manifest, out)


def step(manifest: dict, name: str) -> dict:
    return next((s for s in manifest["steps"] if s["name"] == name), {})


def dedup_drops(manifest: dict) -> int:
    reasons = manifest.get("drop_reasons", {})
    return reasons.get("dedup:exact", 0) + reasons.get("dedup:near", 0)


def shard_ids_urls(out: Path, manifest: dict, version: str | None = None) -> list[tuple[str, str]]:
    import pyarrow.parquet as pq

    rows: list[tuple[str, str]] = []
    for shard in manifest["shards"]:
        if version is None or shard.get("version") == version:
            t = pq.read_table(out / shard["path"], columns=["id", "url"])
            rows += list(zip(t["id"].to_pylist(), t["url"].to_pylist()))
    return rows


def drops_against_earlier(out: Path, manifest: dict, base_version: str) -> tuple[int, int, int]:
    """(dedup drops of this version, of them pointing at a document of ``base_version``,
    of them pointing at a document of this version) from the version's dedup step folder."""
    import pyarrow.parquet as pq

    dedup_dir = Path(step(manifest, "dedup").get("out_dir", ""))
    files = sorted(dedup_dir.glob("*.parquet"))
    if not files:
        return 0, 0, 0
    old_ids = {i for i, _ in shard_ids_urls(out, manifest, base_version)}
    t = pq.read_table(files, columns=["id", "drop_reason", "dup_cluster"]).to_pylist()
    drops = [r for r in t if r["drop_reason"] in ("dedup:exact", "dedup:near")]
    against_old = sum(r["dup_cluster"] in old_ids for r in drops)
    own_ids = {r["id"] for r in t}
    against_own = sum(r["dup_cluster"] in own_ids for r in drops)
    return len(drops), against_old, against_own


def truth_check(out: Path, manifest: dict, by_url: dict[str, Page], origins: set[str]) -> dict:
    """Kept documents against the ground truth of page origins."""
    kept = shard_ids_urls(out, manifest)
    per_origin: dict[str, int] = {}
    unknown = 0
    for _, url in kept:
        page = by_url.get(url)
        if page is None:
            unknown += 1
            continue
        per_origin[page.origin] = per_origin.get(page.origin, 0) + 1
    return {
        "kept": len(kept),
        "distinct": len(per_origin),
        "twice": sum(n - 1 for n in per_origin.values() if n > 1),
        "lost": len(origins - set(per_origin)),
        "unknown_url": unknown,
        "urls": {url for _, url in kept},
    }


def shard_digests(out: Path, manifest: dict, version: str) -> dict[str, str]:
    return {s["path"]: hashlib.sha256((out / s["path"]).read_bytes()).hexdigest()
            for s in manifest["shards"] if s.get("version") == version}


# --------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> str:
    return f"x{a / b:.2f}" if b else "-"


def report(args, v1: RunResult, refresh: RunResult, full: RunResult, by_url: dict[str, Page],
           old: list[str], new: list[str], v1_untouched: bool, ray_start_s: float, total_s: float) -> dict:
    r, b = refresh.manifest, full.manifest
    origins_all = {p.origin for p in by_url.values()}
    t_ref = truth_check(refresh.out, r, by_url, origins_all)
    t_full = truth_check(full.out, b, by_url, origins_all)
    n_drops, against_old, against_own = drops_against_earlier(refresh.out, r, v1.manifest["version"])
    bytes_new = sum(os.path.getsize(p) for p in new)
    bytes_all = sum(os.path.getsize(p) for p in old + new)

    w = 34
    print("\n=== refresh (A: v0001 + refresh -> v0002) vs full rebuild (B: all files -> v0001) ===")
    print(f"{'':<{w}}{'refresh':>12}{'full rebuild':>14}{'refresh/full':>14}")
    print("-" * (w + 40))

    def seconds_row(label: str, a: float, c: float) -> None:
        print(f"{label:<{w}}{a:>12.1f}{c:>14.1f}{_ratio(a, c):>14}")

    seconds_row("wall time of the flow call, s", refresh.seconds, full.seconds)
    steps_ref = sum(step(r, s).get("seconds", 0) for s in STEPS)
    steps_full = sum(step(b, s).get("seconds", 0) for s in STEPS)
    seconds_row("  sum of step times, s", steps_ref, steps_full)
    for s in STEPS:
        seconds_row(f"    {s}, s", step(r, s).get("seconds", 0.0), step(b, s).get("seconds", 0.0))
    seconds_row("  rest (plan, write, review, MLflow)", refresh.seconds - steps_ref, full.seconds - steps_full)
    print(f"{'input WARC files read':<{w}}{len(r['files']):>12}{len(b['files']):>14}"
          f"{_ratio(len(r['files']), len(b['files'])):>14}")
    print(f"{'WARC MiB read':<{w}}{bytes_new / 2**20:>12.2f}{bytes_all / 2**20:>14.2f}{_ratio(bytes_new, bytes_all):>14}")
    for s in STEPS[:4]:
        a, c = step(r, s).get("rows_in", 0), step(b, s).get("rows_in", 0)
        print(f"{'documents read by ' + s:<{w}}{a:>12}{c:>14}{_ratio(a, c):>14}")
    print(f"{'documents kept by this build':<{w}}{r['version_documents_kept']:>12}{b['version_documents_kept']:>14}")
    print(f"{'documents in the dataset (final)':<{w}}{r['documents_kept']:>12}{b['documents_kept']:>14}"
          f"{_ratio(r['documents_kept'], b['documents_kept']):>14}")
    for reason in ("dedup:exact", "dedup:near"):
        a, c = r["drop_reasons"].get(reason, 0), b["drop_reasons"].get(reason, 0)
        print(f"{'dropped ' + reason:<{w}}{a:>12}{c:>14}")
    other_a = {k: v for k, v in r["drop_reasons"].items() if not k.startswith("dedup:")}
    other_b = {k: v for k, v in b["drop_reasons"].items() if not k.startswith("dedup:")}
    print(f"{'dropped by other steps':<{w}}{sum(other_a.values()):>12}{sum(other_b.values()):>14}"
          f"   {other_a or ''} {other_b or ''}".rstrip())
    print(f"{'distinct pages kept (truth)':<{w}}{t_ref['distinct']:>12}{t_full['distinct']:>14}")
    print(f"{'pages kept twice (missed dups)':<{w}}{t_ref['twice']:>12}{t_full['twice']:>14}")
    print(f"{'pages lost (no copy kept)':<{w}}{t_ref['lost']:>12}{t_full['lost']:>14}")

    expected_dups_new = sum(p.kind != "original" for p in by_url.values() if "/recrawl/" in p.url)
    print(f"\nrefresh dedup: {n_drops} documents dropped, {against_old} of them duplicates of a "
          f"{v1.manifest['version']} document (dup_cluster in its shards), {against_own} of one of this "
          f"version's; the new files hold {expected_dups_new} copies of earlier pages")
    dstats = step(r, "dedup").get("extra", {}).get("dedup", {})
    if dstats:
        print(f"refresh dedup stats: docs checked {dstats.get('docs_checked')}, clusters {dstats.get('clusters')} "
              f"{dstats.get('cluster_size_histogram')}, earlier dedup indexes read "
              f"{len(r.get('dedup_indexes', [])) - 1}")
    print(f"v0001 shards untouched by the refresh: {'yes' if v1_untouched else 'NO'}; refresh manifest lists "
          f"{len(r['shards'])} shards ({sum(s.get('version') == v1.manifest['version'] for s in r['shards'])} "
          f"from v0001), versions {r.get('versions')}")
    diff = r["documents_kept"] - b["documents_kept"]
    differ = len(t_ref["urls"] ^ t_full["urls"])
    same = "yes" if not differ else f"no, {differ} differ (which copy of a duplicate each keeps)"
    print(f"final document count: refresh {r['documents_kept']}, full rebuild {b['documents_kept']} "
          f"(difference {diff:+d}); expected unique pages {len(origins_all)}; same kept URLs: {same}")
    print(f"context: v0001 full build of {len(old)} files {v1.seconds:.1f}s (first flow run); "
          f"Ray start {ray_start_s:.1f}s; whole script {total_s:.0f}s")
    return {
        "refresh_s": refresh.seconds, "full_s": full.seconds, "v0001_s": v1.seconds,
        "refresh_steps": {s: step(r, s).get("seconds") for s in STEPS},
        "full_steps": {s: step(b, s).get("seconds") for s in STEPS},
        "refresh_rows_in": {s: step(r, s).get("rows_in") for s in STEPS},
        "full_rows_in": {s: step(b, s).get("rows_in") for s in STEPS},
        "refresh_documents_kept": r["documents_kept"], "full_documents_kept": b["documents_kept"],
        "refresh_drop_reasons": r["drop_reasons"], "full_drop_reasons": b["drop_reasons"],
        "refresh_drops_against_v0001": against_old, "expected_unique_pages": len(origins_all),
        "truth": {"refresh": {k: v for k, v in t_ref.items() if k != "urls"},
                  "full": {k: v for k, v in t_full.items() if k != "urls"}},
        "v0001_untouched": v1_untouched,
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16, help="WARC files of the first version")
    ap.add_argument("--pages", type=int, default=40, help="pages per WARC file")
    ap.add_argument("--new-files", type=int, default=2, help="WARC files the re-crawl adds")
    ap.add_argument("--quick", action="store_true", help="4 files x 20 pages, 1 new file")
    ap.add_argument("--dup-rate", type=float, default=0.05, help="share of copies in the first files")
    ap.add_argument("--new-dup-rate", type=float, default=0.10, help="share of copies of old pages in new files")
    ap.add_argument("--near-edits", type=int, default=3, help="words replaced in a near copy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="CPUs of the local Ray")
    ap.add_argument("--engine", choices=["auto", "local", "ray"], default="auto",
                    help="data.engine of every build (auto: in process for an input this small)")
    ap.add_argument("--work-dir", default=None, help="scratch folder (default: a temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.quick:
        args.files, args.pages, args.new_files = 4, 20, 1

    t0 = time.perf_counter()
    created = args.work_dir is None
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-refresh-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"scratch: {root}; {args.files} files x {args.pages} pages, +{args.new_files} new files; "
          f"workers {args.workers}", flush=True)
    try:
        old, new, by_url = build_corpus(root, args)
        describe_corpus(by_url, old, new)

        import ray
        from prefect.testing.utilities import prefect_test_harness

        from crawl2chat.infra.ray_runtime import ensure_ray
        from crawl2chat.stages.data.engine import RAY, choose
        from crawl2chat.stages.settings import load_config

        engine = choose(args.engine, old + new, load_config().data.local_max_mb)
        print(f"data engine: {engine}", flush=True)
        t_ray = time.perf_counter()
        if engine == RAY:
            ensure_ray(num_cpus=args.workers)
        ray_start_s = time.perf_counter() - t_ray
        home = root / "home"
        try:
            with prefect_test_harness(server_startup_timeout=180):
                v1 = run_flow("A v0001", home, root / "out-refresh", old, refresh=False, engine=engine)
                before = shard_digests(v1.out, v1.manifest, v1.manifest["version"])
                refresh = run_flow("A refresh", home, root / "out-refresh", old + new, refresh=True,
                                   engine=engine)
                after = shard_digests(refresh.out, refresh.manifest, v1.manifest["version"])
                full = run_flow("B full rebuild", home, root / "out-full", old + new, refresh=False,
                                engine=engine)
        finally:
            ray.shutdown()
        if not refresh.manifest.get("refresh") or refresh.manifest.get("base_version") != v1.manifest["version"]:
            print(f"WARNING: the refresh did not build on {v1.manifest['version']}: "
                  f"refresh={refresh.manifest.get('refresh')}, base={refresh.manifest.get('base_version')}")
        figures = report(args, v1, refresh, full, by_url, old, new, before == after and bool(before),
                         ray_start_s, time.perf_counter() - t0)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), **figures}, indent=2, default=str))
    finally:
        if created and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif args.keep or not created:
            print(f"kept {root}")


if __name__ == "__main__":
    sys.exit(main())
