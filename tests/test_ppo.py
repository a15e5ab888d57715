"""PPO: loss pieces against hand-computed values on a fixed small batch (GAE, masked
whitening, clipped ratio, clipped value loss, rewards), rollout bookkeeping, and a
real ``accelerate launch`` run in which the reward-model score rises with bounded KL."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from crawl2chat.tasks.train import launch_training
from crawl2chat.stages.training.ppo import (KLController, PPORunner, answer_logprobs, compute_gae, masked_whiten, ppo_losses,
                                           token_rewards)
from crawl2chat.stages.training.settings import PPOConfig
from crawl2chat.stages.training.trainer import read_metrics
from test_reward import rule_pairs
from test_sft import BAD, GOOD, TOPICS, tiny_base, write_jsonl


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # Row 0: deltas 0.9*0.2-0.5, 0.9*0.1-0.2, 1-0.1; A_t = delta_t + 0.72 A_{t+1}.
    a2 = 0.9
    a1 = -0.11 + 0.72 * a2
    a0 = -0.32 + 0.72 * a1
    # Row 1: the third token is padding; its reward and value are ignored (value after the end is 0).
    b1 = 2.0 - 0.4
    b0 = (0.9 * 0.4 - 0.3) + 0.72 * b1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2], [b0, b1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.2, a2 + 0.1], [b0 + 0.3, b1 + 0.4, 0.0]]))


def test_whitening_uses_valid_tokens_only():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -50.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w = masked_whiten(x, mask)
    std = math.sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3)  # unbiased variance of 1, 2, 3, 4
    torch.testing.assert_close(w, torch.tensor([[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]]))
    # Global statistics: a 'reduce' that sums across two identical processes gives the same answer
    # except for the unbiased correction (n = 8 instead of 4).
    w2 = masked_whiten(x, mask, reduce=lambda t: 2 * t)
    std2 = math.sqrt(2 * 5.0 / 7)
    assert w2[0, 0].item() == pytest.approx(-1.5 / std2, rel=1e-5)


def test_ppo_losses_by_hand():
    ratio = torch.tensor([[1.5, 0.5, 0.7, 100.0]])
    new_lp = torch.log(ratio)
    old_lp = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -2.0, 7.0]])
    old_v = torch.zeros(1, 4)
    values = torch.tensor([[0.5, -0.1, 0.3, 50.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    entropy = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the last token is padding: ignored everywhere
    out = ppo_losses(new_lp, values, entropy, old_lp, old_v, adv, returns, mask, cliprange=0.2,
                     cliprange_value=0.2, vf_coef=0.5, ent_coef=0.01)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5; token 2: max(1.4, 1.6) = 1.6 (clipped)
    assert out["policy_loss"].item() == pytest.approx((-1.2 - 0.5 + 1.6) / 3, rel=1e-5)
    assert out["clip_fraction"].item() == pytest.approx(2 / 3)
    # values: clipped to +-0.2 around the old ones; the larger error of the two counts.
    vl = 0.5 * (max(0.25, 0.64) + 1.21 + max(1.69, 1.44)) / 3
    assert out["value_loss"].item() == pytest.approx(vl, rel=1e-5)
    assert out["value_clip_fraction"].item() == pytest.approx(1 / 3)
    assert out["entropy"].item() == pytest.approx(2.0)
    assert out["loss"].item() == pytest.approx((-0.1 / 3) + 0.5 * vl - 0.01 * 2.0, rel=1e-5)
    assert out["approx_kl"].item() == pytest.approx(
        0.5 * sum(math.log(r) ** 2 for r in (1.5, 0.5, 0.7)) / 3, rel=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_answer_logprobs_and_entropies_match_their_definitions(temperature):
    """The answer tokens' log-probabilities and the entropies, values and gradients,
    against autograd through the plain formulas (float64, any mix of the two gradients)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    answer = torch.randint(0, 17, (3, 5))
    g_lp, g_ent = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)

    logp_all = torch.log_softmax(logits / temperature, -1)
    lp_ref = logp_all.gather(-1, answer.unsqueeze(-1)).squeeze(-1)
    ent_ref = -(logp_all.exp() * logp_all).sum(-1)
    (grad_ref,) = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), logits)

    lp, ent = answer_logprobs(logits, answer, temperature)
    (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), logits)
    assert torch.allclose(lp, lp_ref) and torch.allclose(ent, ent_ref)
    assert torch.allclose(grad, grad_ref)
    assert torch.autograd.gradcheck(lambda z: answer_logprobs(z, answer, temperature), (logits,))


def test_token_rewards_and_kl_controller():
    lp = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -1.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, kl = token_rewards(lp, ref, mask, scores=torch.tensor([2.0, 3.0]), ended=torch.tensor([True, False]),
                                kl_coef=0.1, missing_eos_penalty=-1.0)
    # Score on the last valid token; the answer that never ended is penalised.
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1 + 2.0, 0.0], [0.0, -0.1, 3.0 - 1.0]]))
    torch.testing.assert_close(kl.sum(1), torch.tensor([-0.5, 1.0]))
    fixed = KLController(0.1, adaptive=False, target=1.0, horizon=100)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    ada = KLController(0.1, adaptive=True, target=1.0, horizon=100)
    ada.update(5.0, 10)  # error clipped to +0.2: x (1 + 0.2 * 10 / 100)
    assert ada.value == pytest.approx(0.1 * 1.02)
    ada.update(0.0, 10)
    assert ada.value == pytest.approx(0.1 * 1.02 * 0.98)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """In-process, from a tiny random base: a reward model trained to prefer 'fair weather'
    words, and an SFT policy that answers with four words drawn evenly from fair and foul
    weather, then ends its turn: a middling reward that is easy to raise."""
    import random

    from crawl2chat.stages.training import reward, sft

    root = tmp_path_factory.mktemp("ppo")
    base = tiny_base(root)
    data = write_jsonl(root / "prefs.jsonl", rule_pairs())
    sets = ["seq_len=64", "lr=3e-3", "min_lr=3e-4", "warmup_steps=3", "eval_every=0", "checkpoint_every=0",
            "val_fraction=0.2", "eval_batches=8"]
    reward.main(["--base", str(base), "--data", str(data), "--out", str(root / "rm"), "--max-steps", "40",
                 *[x for s in sets for x in ("--set", s)]])
    assert json.loads((root / "rm" / "metrics.json").read_text())["eval_accuracy"] >= 0.85
    rng = random.Random(5)
    mixed = write_jsonl(root / "mixed.jsonl", [
        {"prompt": f"describe the {rng.choice(TOPICS)}", "response": " ".join(rng.choice(GOOD + BAD) for _ in range(4))}
        for _ in range(300)])
    sets = ["seq_len=128", "lr=3e-3", "min_lr=3e-4", "warmup_steps=3", "eval_every=0", "checkpoint_every=0",
            "val_fraction=0"]
    sft.main(["--base", str(base), "--data", str(mixed), "--out", str(root / "sft"), "--max-steps", "60",
              *[x for s in sets for x in ("--set", s)]])
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": f"describe the {t}"} for t in TOPICS]
                          + [{"messages": [{"role": "user", "content": "hi"}]}, {"bogus": 1}])
    return {"root": root, "base": base, "sft": root / "sft" / "model", "rm": root / "rm" / "model", "prompts": prompts}


def test_draw_follows_the_probabilities_and_never_draws_an_impossible_token():
    from crawl2chat.stages.inference.generation import draw

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]).repeat(40_000, 1) * 0.999  # rows need not sum to one
    tokens = draw(probs, torch.Generator().manual_seed(0))
    share = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert share[1] == 0 and share[4] == 0
    assert torch.allclose(share, torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]), atol=0.01)


def test_batched_sampling_of_left_padded_prompts_matches_greedy_generate(models):
    """At a temperature near zero the sampler is greedy: each left-padded row continues as
    ``generate`` continues it (positions, mask and KV cache line up), and a row that ends
    continues with padding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from crawl2chat.stages.inference.generation import NonFiniteLogits, sample_batch
    from crawl2chat.stages.training.chat_data import encode_prompt, load_prompts, pad

    tok = AutoTokenizer.from_pretrained(models["sft"])
    model = AutoModelForCausalLM.from_pretrained(models["sft"]).eval()
    msgs, _ = load_prompts(models["prompts"])
    prompts = [encode_prompt(tok, m) for m in msgs[:3] + msgs[-1:]]  # the last, "hi", is shorter
    ids = pad(prompts, tok.pad_token_id, left=True)
    mask = pad([[1] * len(p) for p in prompts], 0, ids.shape[1], left=True)
    assert len({len(p) for p in prompts}) > 1  # some rows are padded
    greedy = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                            pad_token_id=tok.pad_token_id, eos_token_id=None)
    got = sample_batch(model, ids, mask, 8, 1e-4, eos_id=-1, pad_id=tok.pad_token_id)
    assert torch.equal(got, greedy)
    # An end-of-answer token: that row continues with padding, the others go on.
    eos = int(greedy[0, ids.shape[1] + 2])
    got = sample_batch(model, ids, mask, 8, 1e-4, eos_id=eos, pad_id=tok.pad_token_id)
    for row, ref in zip(got[:, ids.shape[1]:], greedy[:, ids.shape[1]:]):
        ends = (ref == eos).nonzero()
        n = int(ends[0]) + 1 if len(ends) else len(ref)
        assert torch.equal(row[:n], ref[:n]) and (row[n:] == tok.pad_token_id).all()
    # Every row ends at its first token: alone, the batch stops there; while another process
    # is still sampling (everyone_done says no), it steps on, drawing padding.
    P = ids.shape[1]
    first = {int(t) for t in greedy[:, P]}
    assert len(first) == 1, first
    alone = sample_batch(model, ids, mask, 8, 1e-4, eos_id=first.pop(), pad_id=tok.pad_token_id)
    assert alone.shape[1] == P + 1
    synced = sample_batch(model, ids, mask, 8, 1e-4, eos_id=int(alone[0, P]), pad_id=tok.pad_token_id,
                          everyone_done=lambda ended: False)
    assert synced.shape[1] == P + 8 and (synced[:, P + 1:] == tok.pad_token_id).all()
    # Non-finite scores are reported, not sampled from.
    broken = AutoModelForCausalLM.from_pretrained(models["sft"]).eval()
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLogits):
        sample_batch(broken, ids, mask, 4, 1.0, eos_id=-1, pad_id=tok.pad_token_id)


def test_rollout_bookkeeping(models, tmp_path):
    from crawl2chat.stages.training.chat_data import encode_prompt, load_prompts
    from crawl2chat.stages.training.trainer import make_accelerator
    from transformers import AutoTokenizer

    cfg = PPOConfig(rollout_batch_size=6, micro_batch_size=3, max_new_tokens=6, max_steps=1, seed=3)
    tok = AutoTokenizer.from_pretrained(models["base"])
    msgs, skipped = load_prompts(models["prompts"])
    assert len(msgs) == 9 and skipped == {"unknown_format": 1}
    prompts = [encode_prompt(tok, m) for m in msgs]
    runner = PPORunner(cfg, make_accelerator(cfg), str(models["base"]), str(models["rm"]), prompts, tmp_path)
    ro = runner.rollout(1)
    P, mask = ro["P"], ro["mask"]
    assert ro["seq"].shape == (6, P + 6)
    # The answer mask is a prefix ending at the first end-of-turn marker (or the token limit).
    resp = ro["seq"][:, P:]
    for row, m, ended in zip(resp, mask, ro["ended"]):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        assert bool(ended) == (runner.eot_id in row[:n].tolist()) and (not ended or row[n - 1] == runner.eot_id)
        assert (row[n:] == runner.pad_id).all()
    # Whitened advantages: mean 0 and unit variance over valid tokens, 0 elsewhere.
    valid = ro["adv"][mask.bool()]
    assert abs(valid.mean().item()) < 1e-5 and valid.std().item() == pytest.approx(1.0, rel=1e-3)
    assert (ro["adv"][~mask.bool()] == 0).all()
    # Before any update the recomputed log-probabilities equal the rollout's: ratio 1, nothing clipped.
    with torch.no_grad():
        from crawl2chat.stages.training.ppo import answer_logprobs

        logits, values = runner.model(ro["seq"], ro["attn"], ro["pos"], answer_from=P)
        assert logits.shape[1] == ro["seq"].shape[1] - P  # no vocabulary projection over the prompt
        lp, ent = answer_logprobs(logits, ro["seq"][:, P:], cfg.temperature)
        every, _ = runner.model(ro["seq"], ro["attn"], ro["pos"])  # every position's logits: the same answer
        assert torch.allclose(answer_logprobs(every[:, P - 1:-1], ro["seq"][:, P:], cfg.temperature)[0], lp,
                              atol=1e-5)
        # The rollout's log-probabilities are the sampling pass's: those of a whole forward
        # pass within float noise on the answer, 0 past its end.
        assert torch.allclose(lp[mask.bool()], ro["logprobs"][mask.bool()], atol=1e-4)
        assert (ro["logprobs"][~mask.bool()] == 0).all()
        out = ppo_losses(lp, values[:, P - 1:-1], ent, ro["logprobs"], ro["values"], ro["adv"], ro["returns"],
                         mask, 0.2, 0.2, 0.5, 0.0)
    assert out["approx_kl"].item() < 1e-10 and out["clip_fraction"].item() == 0.0
    # The policy is the reference at the start: the per-answer KL is zero.
    assert ro["kl"].abs().max().item() < 1e-4
    # The score is the reward model's, read at the last valid token.
    with torch.no_grad():
        i = 0
        n = int(mask[i].sum())
        ids = ro["seq"][i, :P + n][ro["attn"][i, :P + n].bool()][None]
        assert runner.rm(input_ids=ids).logits[0, 0].item() == pytest.approx(ro["scores"][i].item(), abs=1e-4)


def test_side_by_side_update_gives_the_joint_gradients(models, tmp_path):
    """On a CPU the actor's and the critic's halves of a PPO step run on two threads;
    the gradients must be the joint loss's, and the step's statistics the same."""
    from crawl2chat.stages.training.chat_data import encode_prompt, load_prompts
    from crawl2chat.stages.training.ppo import HeadWeightGrad, SideBySide
    from crawl2chat.stages.training.trainer import make_accelerator
    from transformers import AutoTokenizer

    cfg = PPOConfig(rollout_batch_size=4, micro_batch_size=2, max_new_tokens=6, max_steps=1, seed=5)
    tok = AutoTokenizer.from_pretrained(models["base"])
    prompts = [encode_prompt(tok, m) for m in load_prompts(models["prompts"])[0]]
    runner = PPORunner(cfg, make_accelerator(cfg), str(models["base"]), str(models["rm"]), prompts, tmp_path)
    if torch.get_num_threads() >= 2:  # a CPU, one process, fp32, two or more threads: side by side
        assert runner.side_by_side.threads == torch.get_num_threads() // 2
    else:
        from concurrent.futures import ThreadPoolExecutor

        assert runner.side_by_side is None
        runner.side_by_side = SideBySide(ThreadPoolExecutor(1), 1)
    # The actor's head weight gradient is computed on the critic's thread (HeadWeightGrad).
    assert HeadWeightGrad.applies_to(runner.acc.unwrap_model(runner.model).actor)
    ro = runner.rollout(1)
    ro["adv"] = ro["adv"] + 0.3  # a rollout's own advantages can be near zero for a fresh policy
    idx = torch.tensor([0, 3])
    runner.model.train()

    def grads(side_by_side):
        runner.side_by_side = side_by_side
        runner.optimizer.zero_grad(set_to_none=True)
        out = runner.forward_backward_step(ro, idx, 0.5)
        return out, {n: p.grad.clone() for n, p in runner.model.named_parameters() if p.grad is not None}

    pool = runner.side_by_side
    joint, g_joint = grads(None)
    split, g_split = grads(pool)
    pool.pool.shutdown()
    assert set(g_joint) == set(g_split) and any(n.startswith("actor.") for n in g_joint) \
        and any(n.startswith("critic.") for n in g_joint)
    for n in g_joint:
        assert torch.allclose(g_joint[n], g_split[n], rtol=1e-5, atol=1e-7), n
    assert set(joint) == set(split)
    for k in joint:
        assert joint[k].item() == pytest.approx(split[k].item(), rel=1e-5, abs=1e-7), k
    assert any(g.abs().sum() > 0 for n, g in g_split.items() if n.startswith("critic."))


def test_head_weight_gradient_left_to_another_thread_is_autograds(models):
    """The actor's output-head weight gradient, computed outside the actor's backward (on
    the critic's thread side by side), is the same bits as autograd's, tied to the
    embedding or not; the logits and every other gradient are untouched."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from crawl2chat.stages.training.ppo import ActorCritic, HeadWeightGrad

    seq = torch.randint(3, 60, (3, 14), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(seq)
    attn[0, :4] = 0  # a left-padded row
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    P = 9
    for tie in (True, False):
        actor = AutoModelForCausalLM.from_pretrained(models["base"], tie_word_embeddings=tie)
        if not tie:
            actor.lm_head.weight.data += 0.01 * torch.randn_like(actor.lm_head.weight)
        assert HeadWeightGrad.applies_to(actor)
        ac = ActorCritic(actor, None)
        weights = torch.rand(seq.shape[0], seq.shape[1] - P, actor.config.vocab_size,
                             generator=torch.Generator().manual_seed(1))

        def grads(head):
            actor.zero_grad(set_to_none=True)
            logits = ac.logits(seq, attn, pos, answer_from=P, head_grad=head)
            (logits * weights).sum().backward()
            if head is not None:
                with ThreadPoolExecutor(1) as other:  # as side by side: computed on another thread
                    head.add_to(actor.lm_head.weight, other.submit(head.compute_if_ready).result())
            return logits.detach(), {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}

        plain_logits, plain = grads(None)
        split_logits, split = grads(HeadWeightGrad())
        assert torch.equal(plain_logits, split_logits)
        assert set(plain) == set(split) and ("lm_head.weight" in plain) != tie
        for n in plain:
            assert torch.equal(plain[n], split[n]), n


@pytest.mark.slow
def test_ppo_under_accelerate_raises_reward(models, tmp_path):
    out = tmp_path / "ppo"
    launch_training("ppo", {"policy": str(models["sft"]), "reward": str(models["rm"]), "prompts": str(models["prompts"])}, str(out), max_steps=16,
           overrides=["rollout_batch_size=16", "micro_batch_size=8", "ppo_epochs=4", "max_new_tokens=8",
                      "lr=1e-3", "kl_coef=0.05", "adaptive_kl=true", "kl_target=2.0", "grad_checkpointing=true"])
    m = json.loads((out / "metrics.json").read_text())
    log = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"]
    assert len(log) == 16 and m["steps"] == 16
    start = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start"]
    assert start[0]["grad_checkpointing"] is True  # actor and critic recompute activations
    for key in ("reward_mean", "kl", "clip_fraction", "entropy", "value_loss", "response_length", "lr", "grad_norm",
                "tokens_per_second"):
        assert all(math.isfinite(r[key]) for r in log), key
    rewards = [r["reward_mean"] for r in log]
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 1.5, rewards  # ~-0.5 -> ~3 in trial runs
    assert log[-1]["eos_rate"] >= 0.5  # answers still end: the missing-EOS penalty holds
    assert m["reward_mean_last"] == rewards[-1] and m["reward_mean_first"] == rewards[0]
    q = m["quarter"]
    assert q == max(1, len(rewards) // 4)
    assert m["reward_mean_first_quarter"] == pytest.approx(np.mean(rewards[:q]))
    assert m["reward_mean_last_quarter"] == pytest.approx(np.mean(rewards[-q:]))
    assert 0 <= m["kl_last"] < 10.0 and m["kl_last"] == log[-1]["kl"]
    assert m["policy"] == str(models["sft"].resolve()) and m["reward"] == str(models["rm"].resolve())
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert AutoModelForCausalLM.from_pretrained(out / "model").config.vocab_size > 0
    assert AutoModelForSequenceClassification.from_pretrained(out / "value_model", num_labels=1).config.num_labels == 1


def test_interrupted_run_resumes_from_its_checkpoint_exactly(models, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from crawl2chat.stages.training import ppo

    def run(out, **kw):
        cfg = PPOConfig(rollout_batch_size=4, micro_batch_size=2, max_new_tokens=4, max_steps=4, ppo_epochs=1,
                        checkpoint_every=2, seed=11, lr=1e-3, adaptive_kl=True, kl_target=1.0, kl_horizon=100)
        return ppo.run(cfg, str(models["sft"]), str(models["rm"]), str(models["prompts"]), out)

    whole = run(tmp_path / "whole")

    # A crash in rollout 3, after the checkpoint of rollout 2 was written.
    real_optimise = PPORunner.optimise

    def crash_at_3(self, ro, step):
        if step == 3:
            raise RuntimeError("simulated crash")
        return real_optimise(self, ro, step)

    monkeypatch.setattr(PPORunner, "optimise", crash_at_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "resumed")
    assert (tmp_path / "resumed" / "checkpoints" / "step_00000002").is_dir()
    monkeypatch.setattr(PPORunner, "optimise", real_optimise)
    resumed = run(tmp_path / "resumed")

    events = [r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if r["type"] == "event"]
    assert any(e["event"] == "resume" and e["step"] == 2 for e in events)
    for key in ("reward_mean_first", "reward_mean_last", "kl_last", "kl_coef_last", "optimizer_steps"):
        assert resumed[key] == whole[key], key
    a = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_weights_roll_back_past_the_batch_and_survive_a_restart(models, tmp_path):
    """An update that leaves NaN weights (injected after prompt batch 3) sends the run back
    to the rollout-2 checkpoint at half the learning rate, past batch 3; the outcome is on
    disk at once, so a run killed right after resumes with it; the finished model is finite.
    A run that keeps failing ends as diverged after max_rollbacks in a row."""
    from safetensors.torch import load_file

    from crawl2chat.stages.training import ppo
    from crawl2chat.stages.training.trainer import TrainingDiverged

    def cfg(**kw):
        return PPOConfig(rollout_batch_size=4, micro_batch_size=2, max_new_tokens=4, max_steps=5, ppo_epochs=1,
                         checkpoint_every=2, seed=11, lr=1e-3, **kw)

    out = tmp_path / "nan"
    summary = ppo.run(cfg(inject_nan_at_batches=[3]), str(models["sft"]), str(models["rm"]), str(models["prompts"]),
                      out)
    events = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "event"]
    rollback = [e for e in events if e["event"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["reason"] == "non-finite weights after the update"
    assert rollback[0]["checkpoint"] == "step_00000002" and rollback[0]["lr_scale"] == 0.5
    record = json.loads((out / "checkpoints" / "rollback.json").read_text())
    assert record["batch_index"] == 4 and record["step"] == 2 and record["rollbacks"] == 1
    steps = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert steps[2]["lr"] == pytest.approx(0.5e-3) and steps[1]["lr"] == pytest.approx(1e-3)
    assert summary["rollbacks"] == 1 and summary["steps"] == 5
    weights = load_file(out / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())

    # Killed right after that rollback (before any new checkpoint): the rerun applies the record.
    crashed = tmp_path / "crashed"
    real = PPORunner.rollback

    def rollback_then_die(self, reason, batch):
        real(self, reason, batch)
        raise KeyboardInterrupt

    PPORunner.rollback = rollback_then_die
    try:
        with pytest.raises(KeyboardInterrupt):
            ppo.run(cfg(inject_nan_at_batches=[3]), str(models["sft"]), str(models["rm"]), str(models["prompts"]),
                    crashed)
    finally:
        PPORunner.rollback = real
    again = ppo.run(cfg(inject_nan_at_batches=[3]), str(models["sft"]), str(models["rm"]), str(models["prompts"]),
                    crashed)
    resume = [r for r in read_metrics(crashed / "metrics.jsonl") if r.get("event") == "resume"]
    assert resume[-1]["lr_scale"] == 0.5 and resume[-1]["batch_index"] == 4
    assert again["rollbacks"] == 1
    b = load_file(crashed / "model" / "model.safetensors")
    assert weights.keys() == b.keys() and all(torch.equal(weights[k], b[k]) for k in weights)

    # Failing on every batch: diverged after max_rollbacks failures in a row.
    with pytest.raises(TrainingDiverged, match="after 1 rollbacks in a row"):
        ppo.run(cfg(inject_nan_at_batches=[1, 2, 3, 4, 5, 6], rollback={"max_rollbacks": 1}), str(models["sft"]),
                str(models["rm"]), str(models["prompts"]), tmp_path / "diverged")


def test_one_plain_process_unwraps_without_loading_deepspeed():
    """In one fp32 process the prepared model is the model: unwrapping it (every PPO
    rollout does) does not import DeepSpeed; its AdamW is the fused kernel."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from crawl2chat.stages.training.settings import PPOConfig\n"
            "from crawl2chat.stages.training.trainer import JsonStateAccelerator, build_optimizer, can_fuse\n"
            "acc = JsonStateAccelerator(cpu=True)\n"
            "model = torch.nn.Linear(2, 2)\n"
            "opt = build_optimizer(model, PPOConfig(), fused=can_fuse(acc, model))\n"
            "assert all(g['fused'] for g in opt.param_groups)\n"
            "model, opt = acc.prepare(model, opt)\n"
            "assert acc.unwrap_model(model) is model\n"
            "print('deepspeed' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
