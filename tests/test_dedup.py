"""Exact and near-duplicate removal on a real local Ray cluster.

Corpora are a handful of generated documents; word lists are letters only,
because exact hashing ignores digits.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from ray.data.context import ShuffleStrategy

from crawl2chat.stages.data.dedup import connected_components, dedup, word_shingles
from crawl2chat.stages.data.settings import DedupConfig

VOCAB = ["".join(letters) for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=3)]
HANZI = [chr(c) for c in range(0x4E00, 0x4E00 + 800)]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster(ray_local):
    # The session's local Ray uses sort-based shuffles (see infra.ray_runtime).
    assert ray.data.DataContext.get_current().shuffle_strategy == ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    yield


def random_words(rng: random.Random, n: int, vocab=VOCAB) -> list[str]:
    return [rng.choice(vocab) for _ in range(n)]


def edited(rng: random.Random, words: list[str], rate: float, vocab=VOCAB) -> list[str]:
    out = list(words)
    for i in rng.sample(range(len(out)), max(1, int(rate * len(out)))):
        out[i] = rng.choice(vocab)
    return out


def make_doc(doc_id: str, text: str, drop_reason: str | None = None, **extra) -> dict:
    return {"id": doc_id, "url": f"https://example.com/{doc_id}", "text": text, "drop_reason": drop_reason, **extra}


def run(docs: list[dict], tmp_path, blocks: int = 2, previous_index=(), **cfg) -> tuple[dict[str, dict], dict]:
    cfg = DedupConfig(num_shards=4, **cfg)
    ds = ray.data.from_items(docs, override_num_blocks=blocks)
    out, stats = dedup(ds, cfg, str(tmp_path), previous_index=previous_index)
    rows = {row["id"]: row for row in out.take_all()}
    assert len(rows) == len(docs)  # every row comes back, dropped or not
    return rows, stats


def kept(rows: dict[str, dict]) -> set[str]:
    return {doc_id for doc_id, row in rows.items() if row["drop_reason"] is None}


def test_minhash_exact_near_and_pass_through(tmp_path):
    rng = random.Random(7)
    base = random_words(rng, 1000)
    sentence = "The Quick brown fox jumps over the lazy dog near the river bank today"
    docs = [
        make_doc("e1", sentence + "."),
        make_doc("e0", "  the quick BROWN fox, jumps over the lazy dog -- near the river bank today!!"),
        make_doc("e2", "The quick brown fox jumps over the lazy dog near the river bank today 2024"),
        make_doc("n0", " ".join(base)),
        make_doc("n1", " ".join(edited(rng, base, 0.02))),
        # 5% of the words rewritten in one passage (a changed paragraph). The same
        # share scattered over the page keeps Jaccard ~0.63 < 0.72: not a near dup.
        make_doc("n2", " ".join(base[:400] + random_words(rng, 50) + base[450:])),
        make_doc("u0", " ".join(random_words(rng, 1000))),
        make_doc("u1", " ".join(random_words(rng, 800))),
        make_doc("u2", " ".join(random_words(rng, 30))),
        # Already dropped by an earlier block: untouched although it repeats n0.
        make_doc("p0", " ".join(base), drop_reason="gopher_quality:too_few_words"),
    ]
    rows, stats = run(docs, tmp_path)

    assert kept(rows) == {"e0", "n0", "u0", "u1", "u2"}
    assert rows["e1"]["drop_reason"] == rows["e2"]["drop_reason"] == "dedup:exact"
    assert rows["e1"]["dup_cluster"] == rows["e2"]["dup_cluster"] == rows["e0"]["dup_cluster"] == "e0"
    assert rows["n1"]["drop_reason"] == rows["n2"]["drop_reason"] == "dedup:near"
    assert {rows[i]["dup_cluster"] for i in ("n0", "n1", "n2")} == {"n0"}
    assert rows["u0"]["dup_cluster"] is None
    assert rows["p0"]["drop_reason"] == "gopher_quality:too_few_words"
    assert rows["p0"]["dup_cluster"] is None
    assert rows["n0"]["text"] == " ".join(base) and rows["n0"]["url"].endswith("/n0")

    assert stats["docs_in"] == 10 and stats["docs_checked"] == 9
    assert stats["exact_dups"] == 2 and stats["near_dups"] == 2
    assert stats["clusters"] == 2 and stats["cluster_size_histogram"] == {3: 2}
    assert stats["candidate_links"] >= 4 and stats["cc_rounds"] >= 2

    index = pq.read_table(tmp_path / "index" / "bands")
    assert set(index.column("id").to_pylist()) == {"e0", "n0", "u0", "u1", "u2"}
    assert index.num_rows == 5 * 15  # exact row + 14 bands per kept document


def test_connected_components_follow_long_chains():
    # A path a-b-c-d-e-f-g (each link in both directions) and a separate pair:
    # the smallest label needs several rounds to reach the far end.
    path = list("abcdefg")
    links = list(zip(path, path[1:])) + [("x", "y")]
    edges = [{"node": u, "nbr": v} for a, b in links for u, v in ((a, b), (b, a))]
    state, rounds = connected_components(ray.data.from_items(edges, override_num_blocks=3), 4, 64)
    labels = {row["node"]: row["label"] for row in state.take_all()}
    assert labels == {**{n: "a" for n in path}, "x": "x", "y": "x"}
    assert rounds >= 4


def test_transitive_chain_and_cjk_near_duplicates(tmp_path):
    rng = random.Random(11)
    # Sliding windows over one long text: neighbours overlap ~82%, the ends ~67%.
    stream = random_words(rng, 1200)
    hanzi = "".join(random_words(rng, 600, HANZI))
    hanzi_copy = "".join(edited(rng, list(hanzi), 0.02, HANZI))
    docs = [
        make_doc("c0", " ".join(stream[0:1000])),
        make_doc("c1", " ".join(stream[100:1100])),
        make_doc("c2", " ".join(stream[200:1200])),
        make_doc("z0", hanzi, lang="zh"),
        make_doc("z1", hanzi_copy, lang="zh"),
        make_doc("z2", "".join(random_words(rng, 600, HANZI)), lang="zh"),
    ]
    shingles = [word_shingles(d["text"], 5) for d in docs[:3]]
    jaccard = lambda a, b: len(a & b) / len(a | b)  # noqa: E731
    assert jaccard(shingles[0], shingles[2]) < 0.7 < jaccard(shingles[0], shingles[1])

    rows, stats = run(docs, tmp_path)
    assert kept(rows) == {"c0", "z0", "z2"}
    assert {rows[i]["dup_cluster"] for i in ("c0", "c1", "c2")} == {"c0"}
    assert rows["z1"]["drop_reason"] == "dedup:near" and rows["z1"]["dup_cluster"] == "z0"
    assert rows["z0"]["lang"] == "zh"
    assert stats["cluster_size_histogram"] == {2: 1, 3: 1}


def test_same_kept_ids_whatever_the_blocking(tmp_path):
    rng = random.Random(3)
    bases = [random_words(rng, 300) for _ in range(4)]
    docs = []
    for b, words in enumerate(bases):
        for c in range(3):
            docs.append(make_doc(f"{rng.getrandbits(32):08x}-{b}{c}", " ".join(edited(rng, words, 0.01))))
    rng.shuffle(docs)
    first, _ = run(docs, tmp_path / "a", blocks=1)
    second, _ = run(list(reversed(docs)), tmp_path / "b", blocks=5)
    assert kept(first) == kept(second)
    assert len(kept(first)) == 4
    assert {k: r["dup_cluster"] for k, r in first.items()} == {k: r["dup_cluster"] for k, r in second.items()}
    # The kept document of each cluster is its smallest id.
    for doc_id in kept(first):
        members = [k for k, r in first.items() if r["dup_cluster"] == doc_id]
        assert min(members) == doc_id


def test_quality_rule_keeps_the_best_scored_copy(tmp_path):
    rng = random.Random(5)
    words = random_words(rng, 400)
    docs = [
        make_doc("a", " ".join(words), quality_score=0.2),
        make_doc("b", " ".join(edited(rng, words, 0.02)), quality_score=0.9),
        make_doc("c", " ".join(edited(rng, words, 0.02)), quality_score=None),
    ]
    rows, _ = run(docs, tmp_path, keep="quality")
    assert kept(rows) == {"b"}
    assert {r["dup_cluster"] for r in rows.values()} == {"b"}


def test_previous_index_drops_new_copies_of_old_documents(tmp_path):
    rng = random.Random(13)
    old_words = [random_words(rng, 500) for _ in range(3)]
    old = [make_doc(f"old{i}", " ".join(w)) for i, w in enumerate(old_words)]
    old_rows, _ = run(old, tmp_path / "v1")
    assert kept(old_rows) == {"old0", "old1", "old2"}

    fresh = random_words(rng, 500)
    new = [
        make_doc("a-exact", " ".join(old_words[0]).upper()),
        make_doc("a-near", " ".join(edited(rng, old_words[1], 0.01))),
        make_doc("a-fresh", " ".join(fresh)),
        make_doc("a-fresh-copy", " ".join(edited(rng, fresh, 0.02))),
    ]
    rows, stats = run(new, tmp_path / "v2", previous_index=[str(tmp_path / "v1" / "index")])
    assert kept(rows) == {"a-fresh"}
    assert rows["a-exact"]["drop_reason"] == "dedup:exact" and rows["a-exact"]["dup_cluster"] == "old0"
    assert rows["a-near"]["drop_reason"] == "dedup:near" and rows["a-near"]["dup_cluster"] == "old1"
    assert rows["a-fresh-copy"]["drop_reason"] == "dedup:near"
    assert stats["exact_dups"] == 1 and stats["near_dups"] == 2
    # This run's index holds only what this run kept.
    index = pq.read_table(tmp_path / "v2" / "index" / "bands")
    assert set(index.column("id").to_pylist()) == {"a-fresh"}
    assert os.path.exists(tmp_path / "v2" / "index" / "meta.json")

    with pytest.raises(ValueError, match="was built with"):
        run(new, tmp_path / "v3", previous_index=[str(tmp_path / "v1" / "index")], method="simhash")


def test_simhash_finds_obvious_near_duplicates(tmp_path):
    rng = random.Random(17)
    base = random_words(rng, 1000)
    docs = [
        make_doc("s0", " ".join(base)),
        make_doc("s1", " ".join(base[:500] + ["inserted"] + base[500:])),
        make_doc("s2", " ".join(base + ["read", "more"])),
        make_doc("s3", " ".join(base).title() + "!"),
        make_doc("u0", " ".join(random_words(rng, 1000))),
        make_doc("u1", " ".join(random_words(rng, 1000))),
    ]
    rows, stats = run(docs, tmp_path, method="simhash")
    assert kept(rows) == {"s0", "u0", "u1"}
    assert rows["s1"]["drop_reason"] == rows["s2"]["drop_reason"] == "dedup:near"
    assert rows["s3"]["drop_reason"] == "dedup:exact"
    assert stats["clusters"] == 1


def run_rows(docs: list[dict], tmp_path, blocks: int, previous_ids=()) -> tuple[list[dict], dict]:
    ds = ray.data.from_items(docs, override_num_blocks=blocks)
    out, stats = dedup(ds, DedupConfig(num_shards=4), str(tmp_path), previous_ids=previous_ids)
    rows = out.take_all()
    assert len(rows) == len(docs)
    return rows, stats


def test_repeated_records_keep_one_copy_whatever_the_order(tmp_path):
    rng = random.Random(19)
    full = " ".join(random_words(rng, 400))
    old_text = " ".join(random_words(rng, 300))
    r2_text = " ".join(random_words(rng, 200))
    docs = [
        # One record read from three files: the cut copy has the smaller source name but less text.
        make_doc("r1", full, source="b.warc.gz"),
        make_doc("r1", full, source="a.warc.gz"),
        make_doc("r1", full[: len(full) // 2], source="0-cut.warc.gz"),
        # The same file read twice: identical rows.
        make_doc("r2", r2_text, source="c.warc.gz"),
        make_doc("r2", r2_text, source="c.warc.gz"),
        # Nothing to compare (digits only) is no reason to keep both copies.
        make_doc("r3", "2024 12 31", source="c.warc.gz"),
        make_doc("r3", "2024 12 31", source="c.warc.gz"),
        # An exact copy of r1 under another id: the cluster keeps "e1" (smaller id).
        make_doc("e1", full.upper(), source="d.warc.gz"),
        # An id an earlier version already holds: every copy goes.
        make_doc("old", old_text, source="a.warc.gz"),
        make_doc("old", old_text, source="b.warc.gz"),
        make_doc("u", " ".join(random_words(rng, 300)), source="a.warc.gz"),
        # Dropped before: passes through, never counted as a copy.
        make_doc("u", "", drop_reason="extract:empty_body", source="z.warc.gz"),
    ]
    pq.write_table(pa.table({"id": ["old", "gone"]}), tmp_path / "v0001-shard-00000.parquet")
    previous = [str(tmp_path / "v0001-shard-00000.parquet")]

    first, stats = run_rows(docs, tmp_path / "a", blocks=1, previous_ids=previous)
    shuffled = list(reversed(docs))
    second, _ = run_rows(shuffled, tmp_path / "b", blocks=5, previous_ids=previous)

    def summary(rows):
        return sorted((r["id"], r["source"], r["text"], r["drop_reason"] or "", r["dup_cluster"] or "") for r in rows)

    assert summary(first) == summary(second)
    kept_rows = [r for r in first if r["drop_reason"] is None]
    assert sorted(r["id"] for r in kept_rows) == ["e1", "r2", "r3", "u"]
    reasons = Counter(r["drop_reason"] for r in first if r["drop_reason"])
    assert reasons == {"dedup:repeated_record": 6, "dedup:exact": 1, "extract:empty_body": 1}
    assert stats["repeated_records"] == 6 and stats["exact_dups"] == 1
    # r1's whole-text copy from the smaller source name stays in play (then loses to e1 as an exact copy).
    [r1] = [r for r in first if r["id"] == "r1" and r["drop_reason"] != "dedup:repeated_record"]
    assert r1["source"] == "a.warc.gz" and r1["text"] == full
    assert r1["drop_reason"] == "dedup:exact" and r1["dup_cluster"] == "e1"
    assert {r["dup_cluster"] for r in first if r["drop_reason"] == "dedup:repeated_record"} == {"r1", "r2", "r3", "old"}
    # Only the copy kept in play is indexed: the half copy of r1 left no key behind.
    index = pq.read_table(tmp_path / "a" / "index" / "bands")
    assert set(index.column("id").to_pylist()) == {"e1", "r2", "u"}


def test_hash_normalisation_blanks_exactly_the_noise_categories():
    """normalize_for_hash's translation table gives what a character-by-character reading
    of the Unicode categories gives, in every script, for characters seen for the first
    time and again: band and exact hashes stay comparable with earlier dedup indexes."""
    import sys
    import unicodedata

    from crawl2chat.stages.data.text import normalize_for_hash

    def by_category(text: str) -> str:
        text = unicodedata.normalize("NFKC", text).casefold()
        return " ".join("".join(" " if unicodedata.category(c)[0] in "PSNZC" else c for c in text).split())

    samples = ["Ünïcödé — “quotes” (1,234.5 €) x\x00y\u200b\u00ad", "日本語のテキスト、句読点。", "हिन्दी पाठ १२३।",
               "עברית ٣٤٥ العربية؟", "ﬁ Ⅻ ② ＡＢＣ", "e\u0301 \U0001F600 \U000E0001 \uFFFF"]
    # Every code point once, in chunks (surrogates cannot be encoded and are left out).
    everything = "".join(chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    samples += [everything[i:i + 50_000] for i in range(0, len(everything), 50_000)]
    for text in samples + samples:
        assert normalize_for_hash(text) == by_category(text)
    assert normalize_for_hash("Hello, World! 42") == "hello world"
