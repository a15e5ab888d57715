"""DPO: the loss by hand, and a real ``accelerate launch`` run whose implicit-reward
accuracy rises from chance on the rule-based preference set."""

from __future__ import annotations

import json
import math

import pytest
import torch

from crawl2chat.stages.training.dpo import dpo_loss_terms
from crawl2chat.tasks.train import launch_training
from crawl2chat.stages.training.trainer import read_metrics
from test_reward import rule_pairs
from test_sft import tiny_base, write_jsonl


def test_dpo_loss_matches_hand_computation():
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -5.0]), torch.tensor([-3.0, -2.5])
    loss, c, r = dpo_loss_terms(pc, pr, rc, rr, beta=0.5)
    # pair 0: 0.5 * ((0.5) - (-1.0)) = 0.75; pair 1: 0.5 * (0 - 0.5) = -0.25
    expected = [math.log1p(math.exp(-0.75)), math.log1p(math.exp(0.25))]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert c.tolist() == pytest.approx([0.25, 0.0]) and r.tolist() == pytest.approx([-0.5, 0.25])
    smooth, _, _ = dpo_loss_terms(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    assert smooth[0].item() == pytest.approx(0.9 * expected[0] + 0.1 * math.log1p(math.exp(0.75)), rel=1e-6)


def test_response_logprobs_sum_the_answer_tokens_of_each_row():
    """Projected only where an answer token is predicted, the sums equal those read off every
    position's logits; rows of different lengths and a padded row included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from crawl2chat.stages.training.chat_data import response_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    ids = torch.randint(0, 300, (3, 20))
    attention = torch.ones_like(ids)
    attention[2, 14:] = 0
    answer = torch.zeros_like(ids)
    answer[0, 8:], answer[1, 5:18], answer[2, 9:14] = 1, 1, 1
    every = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, :-1], -1)
    expected = (every.gather(-1, ids[:, 1:, None])[..., 0] * answer[:, 1:]).sum(-1)
    got = response_logprobs(model, ids, attention, answer)
    assert torch.allclose(got, expected, atol=1e-4) and got.requires_grad


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("dpo"))


def test_dpo_under_accelerate_raises_implicit_reward_accuracy(base, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", rule_pairs())
    out = tmp_path / "dpo"
    launch_training("dpo", {"policy": str(base), "data": str(data)}, str(out), max_steps=30,
           overrides=["seq_len=64", "micro_batch_size=8", "lr=2e-3", "min_lr=2e-4", "warmup_steps=3", "beta=0.5",
                      "eval_every=10", "checkpoint_every=0", "val_fraction=0.2", "eval_batches=8",
                      "grad_checkpointing=true"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 30 and m["policy"] == str(base.resolve()) and m["held_out"] >= 30
    start = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start"]
    assert start and start[0]["grad_checkpointing"] is True  # the setting took effect on the policy
    assert m["eval_reward_accuracy_start"] == 0.5  # policy == reference: every implicit reward is 0
    assert m["eval_reward_accuracy"] >= 0.85, m
    assert m["eval_reward_margin"] > 0
    evals = [r["eval_reward_accuracy"] for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval"]
    assert len(evals) == 3 and evals[-1] > 0.5
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "model").config.vocab_size > 0
