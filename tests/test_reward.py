"""Reward model: the pairwise loss by hand, and a real ``accelerate launch`` run that
learns a clear preference rule (held-out accuracy well above chance)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.reward import collate_pairs, load_reward_model, pair_rewards, pairwise_loss
from crawl2chat.tasks.train import launch_training
from crawl2chat.stages.training.trainer import read_metrics
from test_sft import BAD, GOOD, TOPICS, tiny_base, write_jsonl

HH = Path(__file__).resolve().parents[2] / "shared" / "data" / "preference" / "hh-rlhf" / "harmless-base_test.jsonl.gz"


def rule_pairs(n: int = 240, seed: int = 1) -> list[dict]:
    """Chosen answers are made of 'fair weather' words, rejected of 'foul weather' ones."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(2, 5)
        rows.append({"prompt": f"describe the {rng.choice(TOPICS)} {i}",
                     "chosen": " ".join(rng.choice(GOOD) for _ in range(k)),
                     "rejected": " ".join(rng.choice(BAD) for _ in range(k))})
    return rows


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("rm"))


def test_score_at_last_non_padding_token_and_loss(base):
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.chat_data import encode_pair

    tok = AutoTokenizer.from_pretrained(base)
    model = load_reward_model(base, tok.pad_token_id).eval()
    pairs = [{"prompt": [{"role": "user", "content": "describe the river"}], "chosen": "sun", "rejected":
              "rain dark cold grey night", "margin": 0.5},
             {"prompt": [{"role": "user", "content": "a"}], "chosen": "bright warm gold", "rejected": "mud",
              "margin": 0.0}]
    enc = [encode_pair(tok, p, 64) for p in pairs]
    batch = collate_pairs(enc, tok.pad_token_id)
    assert (batch["input_ids"] == tok.pad_token_id).any()  # rows of unequal length are padded
    with torch.no_grad():
        loss, n = pairwise_loss(model, batch)
        # Each row alone (no padding) gives the score the padded batch reads at its last real token.
        single = [model(input_ids=torch.tensor([r])).logits[0, 0] for r in
                  [e["chosen"] for e in enc] + [e["rejected"] for e in enc]]
    rc, rr = torch.stack(single[:2]), torch.stack(single[2:])
    expected = -F.logsigmoid(rc - rr - torch.tensor([0.5, 0.0])).mean()
    assert n == 2 and loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    # Answers end at the end-of-turn marker, as sampled answers do (generation stops there).
    assert all(tok.decode(e[side][-1:]) == "<|end|>" for e in enc for side in ("chosen", "rejected"))


@pytest.mark.skipif(not HH.exists(), reason="shared HH-RLHF sample not present")
def test_hh_pairs_tokenise_within_seq_len(base):
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.chat_data import load_preferences
    from crawl2chat.stages.training.reward import tokenise_pairs
    from crawl2chat.stages.training.settings import RewardConfig

    tok = AutoTokenizer.from_pretrained(base)
    pairs, _ = load_preferences(HH)
    train, val, skipped, rule = tokenise_pairs(tok, pairs[:100], RewardConfig(seq_len=96, val_fraction=0.2))
    assert len(train) + len(val) == 100 and not skipped and val and rule == "content_hash"
    for e in train + val:
        for side in ("chosen", "rejected"):
            ids, mask = e[side], e[side + "_mask"]
            assert len(ids) <= 96 and sum(mask) >= 1 and mask[-1] == 1  # a long prompt gives way, keeping its end
            assert mask == sorted(mask)  # prompt tokens, then answer tokens
            assert ids[-1] == tok.convert_tokens_to_ids("<|end|>") or len(ids) == 96  # ends, or the answer was cut


def test_reward_model_learns_rule_under_accelerate(base, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", rule_pairs())
    out = tmp_path / "rm"
    launch_training("reward", {"base": str(base), "data": str(data)}, str(out), max_steps=40,
           overrides=["seq_len=64", "micro_batch_size=8", "lr=3e-3", "min_lr=3e-4", "warmup_steps=3",
                      "eval_every=20", "checkpoint_every=0", "val_fraction=0.2", "eval_batches=8"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 40 and m["held_out"] >= 30 and m["base"] == str(base.resolve())
    assert m["eval_accuracy"] >= 0.85, m
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval"]
    assert len(evals) == 2 and all("eval_accuracy" in e for e in evals)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(out / "model", num_labels=1)
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert model.config.pad_token_id == tok.pad_token_id is not None

    def score(answer):
        msgs = [{"role": "user", "content": "describe the bridge 99999"}, {"role": "assistant", "content": answer}]
        ids = tok.apply_chat_template(msgs, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            return model(**ids).logits[0, 0].item()

    assert score("sun warm light") > score("rain fog night")


def ranked_rows(n: int = 80, seed: int = 2) -> list[dict]:
    """Answers ranked by how many 'fair weather' words they hold (best first)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(4, 6)
        answers = [" ".join([rng.choice(GOOD) for _ in range(k - j)] + [rng.choice(BAD) for _ in range(j + 1)])
                   for j in range(k)]  # answer j: k - j good words, j + 1 bad ones
        rows.append({"prompt": f"describe the {rng.choice(TOPICS)} {i}", "ranked": answers})
    return rows


def test_a_ranked_row_gives_every_pair_and_counts_once(base, tmp_path):
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.chat_data import encode_pair, load_preferences

    rows = [{"prompt": "rank these", "ranked": ["a b c", "d e", "f", "g h"]},
            {"prompt": "plain", "chosen": "sun", "rejected": "rain"},
            {"prompt": "one answer", "ranked": ["only"]},
            {"prompt": "twice", "ranked": ["same", "same"]}]
    pairs, skipped = load_preferences(write_jsonl(tmp_path / "ranked.jsonl", rows))
    assert skipped == {"bad_ranking": 1, "identical_pair": 1}
    ranked = [p for p in pairs if p.get("group")]
    assert [(p["chosen"], p["rejected"]) for p in ranked] == [
        ("a b c", "d e"), ("a b c", "f"), ("a b c", "g h"), ("d e", "f"), ("d e", "g h"), ("f", "g h")]
    tok = AutoTokenizer.from_pretrained(base)
    enc = []
    for p in pairs:
        e = encode_pair(tok, p, 64)
        e["group"] = p.get("group")
        enc.append(e)
    batch = collate_pairs(enc, tok.pad_token_id)
    assert batch["weight"].tolist() == pytest.approx([1 / 6] * 6 + [1.0])
    model = load_reward_model(base, tok.pad_token_id).eval()
    with torch.no_grad():
        loss, n = pairwise_loss(model, batch)
        rc, rr = pair_rewards(model, batch)
    per_pair = -F.logsigmoid(rc - rr)
    # The ranked prompt's six pairs count as much as the one plain pair.
    assert n == 7 and loss.item() == pytest.approx(((per_pair[:6].mean() + per_pair[6]) / 2).item(), rel=1e-5)


def test_reward_model_learns_rankings_under_accelerate(base, tmp_path):
    data = write_jsonl(tmp_path / "ranked.jsonl", ranked_rows())
    out = tmp_path / "rm"
    launch_training("reward", {"base": str(base), "data": str(data)}, str(out), max_steps=30,
                    overrides=["seq_len=64", "micro_batch_size=2", "lr=3e-3", "min_lr=3e-4", "warmup_steps=3",
                               "eval_every=0", "checkpoint_every=0", "val_fraction=0.2", "eval_batches=8"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["prompts"] < m["pairs"] and m["held_out"] >= 20
    assert m["eval_accuracy"] >= 0.8, m  # chance is 0.5 on the held-out prompts' pairs
