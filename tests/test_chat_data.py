"""Post-training data readers: every accepted shape, bad rows counted and skipped,
Anthropic HH transcripts, Parquet input and the demo sets derived from a corpus."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crawl2chat.stages.training.chat_data import (NoUsableRows, derive_demo_sets, load_preferences, load_prompts, load_sft,
                                         parse_hh)

HH = Path(__file__).resolve().parents[2] / "shared" / "data" / "preference" / "hh-rlhf" / "harmless-base_test.jsonl.gz"


def test_parse_hh_transcript():
    t = "\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine, thanks"
    assert parse_hh(t) == [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "how are you?"},
                           {"role": "assistant", "content": "fine, thanks"}]
    assert parse_hh("no turns here") is None


def test_preference_shapes_and_bad_rows(tmp_path):
    rows = [
        {"prompt": "q1", "chosen": "good", "rejected": "bad"},
        {"prompt": [{"role": "user", "content": "q2"}], "chosen": "a", "rejected": "b", "margin": 1.5},
        {"chosen": "\n\nHuman: q3\n\nAssistant: yes", "rejected": "\n\nHuman: q3\n\nAssistant: no"},
        {"chosen": "\n\nHuman: q4\n\nAssistant: x", "rejected": "\n\nHuman: other\n\nAssistant: y"},
        {"chosen": "\n\nHuman: q5\n\nAssistant: same", "rejected": "\n\nHuman: q5\n\nAssistant: same"},
        {"prompt": "q6", "chosen": "", "rejected": "b"},
        {"prompt": "q7", "chosen": "a", "rejected": "b", "margin": "big"},
        {"text": "no pair"},
    ]
    p = tmp_path / "prefs.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n[1, 2]\n{broken\n")
    pairs, skipped = load_preferences(p)
    assert [x["chosen"] for x in pairs] == ["good", "a", "yes"]
    assert pairs[1]["margin"] == 1.5 and pairs[0]["margin"] is None  # None: the reward model's setting applies
    assert pairs[2]["prompt"] == [{"role": "user", "content": "q3"}] and pairs[2]["rejected"] == "no"
    assert skipped == {"transcripts_diverge": 1, "identical_pair": 1, "empty_field": 1, "bad_margin": 1,
                       "unknown_format": 1, "bad_json": 2}


def test_parquet_input_and_nothing_usable(tmp_path):
    p = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"instruction": ["add", "sub", ""], "input": ["1 2", None, "x"],
                             "output": ["3", "-1", "y"]}), p)
    convs, skipped = load_sft(p)
    assert convs[1] == [{"role": "user", "content": "sub"}, {"role": "assistant", "content": "-1"}]
    assert len(convs) == 2 and skipped == {"empty_field": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\nnot json\n')
    with pytest.raises(NoUsableRows, match="unknown_format"):
        load_sft(bad)


@pytest.mark.skipif(not HH.exists(), reason="shared HH-RLHF sample not present")
def test_anthropic_hh_sample():
    pairs, skipped = load_preferences(HH)
    with gzip.open(HH, "rt") as f:
        total = sum(1 for line in f if line.strip())
    assert len(pairs) + sum(skipped.values()) == total and len(pairs) > 0.9 * total
    for p in pairs[:200]:
        assert p["prompt"][0]["role"] == "user" and p["prompt"][-1]["role"] == "user"
        assert p["chosen"] != p["rejected"] and "\n\nHuman:" not in p["chosen"]
        roles = [m["role"] for m in p["prompt"]]
        assert all(a != b for a, b in zip(roles, roles[1:]))  # turns alternate
    prompts, _ = load_prompts(HH)  # the same file serves as PPO prompts
    assert len(prompts) >= len(pairs)


def test_demo_sets_from_corpus_are_deterministic(tmp_path):
    shards = tmp_path / "corpus" / "shards"
    shards.mkdir(parents=True)
    texts = [f"Page {i} talks about rivers. The river {i} flows north past the old mill. "
             f"Fish swim in it every spring. Children play on its banks." for i in range(40)]
    texts.append("short")
    pq.write_table(pa.table({"text": texts, "title": [f"River {i}" for i in range(41)],
                             "drop_reason": [None] * 40 + ["too_short"]}), shards / "part-0.parquet")
    a = derive_demo_sets(tmp_path / "corpus", tmp_path / "a", n=15)
    b = derive_demo_sets(tmp_path / "corpus", tmp_path / "b", n=15)
    for k in ("sft", "preference", "prompts"):
        assert Path(a[k]).read_text() == Path(b[k]).read_text() and Path(a[k]).read_text()
    convs, skipped = load_sft(a["sft"])
    assert len(convs) == 15 and not skipped
    prompts = [c[0]["content"] for c in convs]
    assert any(p.startswith("Continue: Page") for p in prompts) and any(p.startswith("Summarise the page") for p in prompts)
    pairs, skipped = load_preferences(a["preference"])
    assert pairs and not skipped and all(p["chosen"] != p["rejected"] for p in pairs)
    assert all(sorted(p["chosen"].split()) == sorted(p["rejected"].split()) or len(p["rejected"]) != len(p["chosen"])
               for p in pairs)
    ppo_prompts, _ = load_prompts(a["prompts"])
    assert len(ppo_prompts) == 15 and {m[0]["content"] for m in ppo_prompts}.isdisjoint(prompts)
