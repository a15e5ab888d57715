"""PPO from a reward model: an SFT policy optimised against a learned reward.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.ppo --policy SFT_MODEL --reward RM_MODEL --prompts FILE --out OUT \\
        [--config ppo.yaml] [--max-steps ROLLOUTS] [--set kl_coef=0.05 ...]

Models: the actor starts from the SFT model; the critic is the reward model
(``AutoModelForSequenceClassification``) with its scalar head applied at
every position; the reference (the SFT model) and the reward model are
frozen.

One PPO step (``max_steps`` of them) is:

1. rollout: ``rollout_batch_size`` prompts per process, answers sampled with
   the KV cache (``generation.sample_batch``: plain sampling at ``temperature``, no
   top-k/top-p, so the sampling distribution is the policy's), stopped at the
   chat template's end-of-turn marker or after ``max_new_tokens``;
2. scoring: log-probabilities under the reference (the actor's are those the
   answers were drawn with), critic values, the reward model's score of prompt + answer;
3. rewards per answer token: ``-kl_coef * (log pi - log ref)``, plus the score
   on the last token (the end-of-turn marker), plus ``missing_eos_penalty``
   when the answer never ended; ``kl_coef`` fixed or adapted towards
   ``kl_target`` (Ziegler et al., 2019);
4. GAE advantages (``gamma``, ``lam``) and returns, advantages whitened over
   the valid answer tokens of the whole rollout (all processes);
5. ``ppo_epochs`` passes of shuffled minibatches: clipped policy ratio,
   clipped value loss, entropy bonus (``ent_coef``, 0.01); one optimizer (the shared AdamW/Lion
   and schedule builders) over actor and critic, gradients clipped. On a CPU in one
   process the actor's and the critic's halves of each step run side by side
   (:class:`SideBySide`).

Logged per step to ``OUT/metrics.jsonl``: ``reward_mean`` (reward-model score),
``kl`` (per-answer sum of ``log pi - log ref``), ``kl_coef``, ``clip_fraction``,
``entropy``, ``value_loss``, ``policy_loss``, ``response_length``, ``eos_rate``,
``lr``, ``grad_norm``, ``tokens_per_second`` (rollout tokens, all processes, per second
of the step) and the time spent generating, scoring and training.

Checkpoints: at the start and every ``checkpoint_every`` rollouts the actor-critic,
optimizer, schedule, KL coefficient, data position and RNG states are saved under
``OUT/checkpoints``; re-running an unfinished ``OUT`` resumes from the newest (a
finished one is a no-op).

Rollback: a rollout whose sampling probabilities, scores or values are not finite,
an update that leaves non-finite weights, or one whose every minibatch had a
non-finite gradient (a single such minibatch is skipped and counted) sends the
run back to the last good checkpoint with the learning rate times
``rollback.lr_factor``, past the offending prompt batch, as the shared trainer
does: the outcome is written to ``OUT/checkpoints/rollback.json`` at once, the
n-th failure in a row goes n-1 checkpoints further back, and more than
``rollback.max_rollbacks`` in a row ends the run as diverged.

Outputs: ``OUT/model`` (the actor, Hugging Face causal LM + tokenizer),
``OUT/value_model`` (the critic, sequence-classification format),
``OUT/metrics.json`` (``reward_mean_first``, ``reward_mean_last``, and the
means over the first and the last quarter of the rollouts, which one noisy
batch moves less: ``reward_mean_first_quarter``, ``reward_mean_last_quarter``;
``kl_last``, throughput, ``policy``/``reward``/``prompts`` lineage).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType

from crawl2chat.stages.inference.generation import NonFiniteLogits, positions, sample_batch
from crawl2chat.stages.training.chat_data import encode_prompt, end_of_turn_id, load_prompts, pad
from crawl2chat.stages.training.models import enable_grad_checkpointing, is_checkpointing
from crawl2chat.stages.training.stage import finished_summary, prepare_out, resolve, run_script, save_model, stage_parser
from crawl2chat.stages.training.trainer import (MetricsWriter, TrainingDiverged, all_finite, apply_lr_scale,
                                               build_optimizer, build_scheduler, can_fuse, clip_by_global_norm,
                                               discard_checkpoints, good_checkpoints, make_accelerator,
                                               peak_memory_mb, read_rollback_record, rollback_plan,
                                               save_checkpoint, write_rollback_record)
from crawl2chat.stages.training.settings import PPOConfig

# ---------------------------------------------------------------- loss pieces


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Callable | None = None) -> torch.Tensor:
    s, n = (x * mask).sum(), mask.sum()
    if reduce is not None:
        s, n = reduce(s), reduce(n)
    return s / n.clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, reduce: Callable | None = None,
                  shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / std`` with mean and (unbiased) variance over ``mask`` only;
    ``reduce`` (a sum across processes) makes the statistics global."""
    mask = mask.to(x.dtype)
    s, n = (x * mask).sum(), mask.sum()
    if reduce is not None:
        s, n = reduce(s), reduce(n)
    mean = s / n.clamp(min=1)
    sq = ((x - mean) ** 2 * mask).sum()
    if reduce is not None:
        sq = reduce(sq)
    var = sq / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over answer tokens (``mask`` is a prefix
    of ones per row); the value after the last valid token is 0. Returns
    (advantages, returns = advantages + values), both zero outside ``mask``."""
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    T = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_v = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    adv = adv * mask
    return adv, (adv + values) * mask


def token_rewards(logprobs, ref_logprobs, mask, scores, ended, kl_coef: float, missing_eos_penalty: float):
    """Per-token rewards: KL penalty everywhere, the (penalised) score on the last valid token."""
    mask = mask.to(logprobs.dtype)
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    final = scores + torch.where(ended, 0.0, missing_eos_penalty).to(scores.dtype)
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(last)), last] += final
    return rewards * mask, kl


def policy_losses(new_logprobs, entropy, old_logprobs, advantages, mask, cliprange: float,
                  ent_coef: float) -> dict[str, torch.Tensor]:
    """The actor's share of the PPO loss: clipped-ratio policy loss minus the entropy
    bonus, averaged over valid tokens (``loss``), with its statistics."""
    mask = mask.to(new_logprobs.dtype)
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    policy_loss = masked_mean(torch.maximum(pg1, pg2), mask)
    ent = masked_mean(entropy, mask)
    return {"loss": policy_loss - ent_coef * ent, "policy_loss": policy_loss, "entropy": ent,
            "clip_fraction": masked_mean((pg2 > pg1).to(mask.dtype), mask),
            "approx_kl": 0.5 * masked_mean(log_ratio ** 2, mask)}


def value_losses(values, old_values, returns, mask, cliprange_value: float, vf_coef: float) -> dict[str, torch.Tensor]:
    """The critic's share of the PPO loss: ``vf_coef`` times the clipped value loss (``loss``)."""
    mask = mask.to(values.dtype)
    v_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf1, vf2 = (values - returns) ** 2, (v_clipped - returns) ** 2
    value_loss = 0.5 * masked_mean(torch.maximum(vf1, vf2), mask)
    return {"loss": vf_coef * value_loss, "value_loss": value_loss,
            "value_clip_fraction": masked_mean((vf2 > vf1).to(mask.dtype), mask)}


def ppo_losses(new_logprobs, values, entropy, old_logprobs, old_values, advantages, returns, mask,
               cliprange: float, cliprange_value: float, vf_coef: float, ent_coef: float) -> dict[str, torch.Tensor]:
    """Clipped-ratio policy loss, clipped value loss and entropy bonus, averaged over valid
    tokens: the sum of :func:`policy_losses` and :func:`value_losses` (``loss``) and their statistics."""
    actor = policy_losses(new_logprobs, entropy, old_logprobs, advantages, mask, cliprange, ent_coef)
    critic = value_losses(values, old_values, returns, mask, cliprange_value, vf_coef)
    return {**actor, **critic, "loss": actor["loss"] + critic["loss"]}


class KLController:
    """Fixed coefficient, or the adaptive proportional controller of Ziegler et al. (2019)."""

    def __init__(self, init: float, adaptive: bool, target: float, horizon: int):
        self.value, self.adaptive, self.target, self.horizon = init, adaptive, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.adaptive and self.target > 0:
            err = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
            self.value *= 1.0 + err * n_steps / self.horizon


# ---------------------------------------------------------------- models


class ActorCritic(torch.nn.Module):
    """The two trained models behind one module, so one optimizer and one
    ``accelerator.prepare`` cover both. The critic is a sequence-classification
    model whose scalar head is applied at every position."""

    def __init__(self, actor, critic):
        super().__init__()
        self.actor, self.critic = actor, critic

    def values(self, input_ids, attention_mask, position_ids):
        backbone = getattr(self.critic, self.critic.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.critic.score(hidden).squeeze(-1).float()

    def forward(self, input_ids, attention_mask, position_ids, answer_from: int | None = None):
        """The actor's logits and the critic's values at every position; with ``answer_from``,
        the logits only of the positions that predict the answer (``answer_from - 1`` to the
        last but one): the vocabulary projection (a third to a half of a small model's
        forward, at 128 wide and 4-6k tokens) is skipped over the prompt."""
        return (self.logits(input_ids, attention_mask, position_ids, answer_from),
                self.values(input_ids, attention_mask, position_ids))

    def logits(self, input_ids, attention_mask, position_ids, answer_from: int | None = None,
               head_grad: "HeadWeightGrad | None" = None):
        """The actor's logits (see :meth:`forward`); with ``head_grad``, the output head's
        weight gradient is left to it (:class:`HeadWeightGrad`)."""
        keep = 0 if answer_from is None else answer_positions(input_ids.shape[1], answer_from, input_ids.device)
        if head_grad is None:
            return self.actor(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, logits_to_keep=keep).logits
        hidden = self.actor.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False).last_hidden_state
        return _LogitsLeavingWeightGrad.apply(hidden if answer_from is None else hidden[:, keep],
                                              self.actor.lm_head.weight, head_grad)


def answer_positions(seq_len: int, prompt_len: int, device=None) -> torch.Tensor:
    """The positions whose logits predict the answer ``seq[:, prompt_len:]``, as a model's
    ``logits_to_keep``: exactly those, so no slice of the vocabulary-wide logits is taken
    (its backward would write a zero-filled copy of them)."""
    return torch.arange(prompt_len - 1, seq_len - 1, device=device)


class HeadWeightGrad:
    """The actor's output-head weight gradient, computed on the critic's thread.

    Side by side (:class:`SideBySide`), the actor's half of an update step is the longer:
    beside the same decoder as the critic it has the vocabulary projection, whose weight
    gradient (answer positions x vocabulary x width) is one of its largest matmuls. The
    actor's backward hands that product's two factors here and goes on; the critic's
    thread computes it once its own half is done (:meth:`compute_if_ready`), and the
    step adds it to the weight's gradient after both halves (:meth:`add_to`). Only for a
    Llama causal LM, whose logits are exactly ``lm_head(hidden)``. With one micro-batch a
    step the gradients are the same bits as autograd's (tested; with several, the same sums
    in another order). Measured at the 1.6M-parameter bench shape, the two halves on one
    core each (medians of 150 steps, alternated): the actor's half ended 7 ms sooner (38
    against 46 ms) and the critic's thread 6 ms later, the whole update step 3-5% shorter;
    ``bench_ppo.py``, four alternated pairs: 15.55 against 15.17 episodes/s on average."""

    def __init__(self):
        self._factors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ready = threading.Event()

    @staticmethod
    def applies_to(actor) -> bool:
        return getattr(actor.config, "model_type", None) == "llama" and actor.lm_head.bias is None

    def put(self, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
        self._factors.append((grad_logits.reshape(-1, grad_logits.shape[-1]), hidden.reshape(-1, hidden.shape[-1])))
        self._ready.set()

    def compute(self) -> torch.Tensor | None:
        grad = None
        for g, h in self._factors:
            grad = g.T @ h if grad is None else grad.addmm_(g.T, h)
        return grad

    def compute_if_ready(self) -> torch.Tensor | None:
        """The gradient, if the actor's backward has reached the head (else None: :meth:`add_to`
        computes it)."""
        return self.compute() if self._ready.is_set() else None

    def add_to(self, weight: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Add the gradient (``grad``, or computed now) to ``weight.grad``."""
        grad = self.compute() if grad is None else grad
        if grad is not None:
            weight.grad = grad if weight.grad is None else weight.grad.add_(grad)


class _LogitsLeavingWeightGrad(torch.autograd.Function):
    """``hidden @ weight.T`` whose backward returns the gradient of ``hidden`` only and hands
    the factors of the weight's gradient to a :class:`HeadWeightGrad`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, later: HeadWeightGrad):
        ctx.save_for_backward(hidden, weight)
        ctx.later = later
        return F.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor):
        hidden, weight = ctx.saved_tensors
        ctx.later.put(grad_logits, hidden)
        return grad_logits @ weight, None, None


class _TokenLogprobEntropy(torch.autograd.Function):
    """Log-probability of each chosen token and entropy of each position's distribution,
    from one log-softmax, with their gradient written out.

    The update's actor half spends much of its time on the vocabulary-wide tensors
    (answer positions x vocabulary); autograd's chain for ``log_softmax``, ``gather``
    and ``-(exp(logp) * logp).sum()`` makes about ten passes over them in the backward
    (zero-filled gather and slice gradients, the product rule's two products, the
    accumulation of two paths), this one four:
    ``d/dz_k = g_lp * ([k == token] - p_k) - g_ent * p_k * (logp_k + H)``.
    Measured on one core at the 1.6M-parameter bench shape (4 answers of 24 tokens,
    6,018 words), an actor forward and backward took 21-23 ms against 24 ms."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor):
        logp = torch.log_softmax(logits, -1)
        p = logp.exp()
        entropy = -torch.linalg.vecdot(p, logp)
        lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(p, logp, entropy, tokens)
        return lp, entropy

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor):
        p, logp, entropy, tokens = ctx.saved_tensors
        g_lp, g_ent = g_lp.unsqueeze(-1), g_ent.unsqueeze(-1)
        grad = (logp + entropy.unsqueeze(-1)).mul_(-g_ent).sub_(g_lp).mul_(p)
        grad.scatter_add_(-1, tokens.unsqueeze(-1), g_lp)
        return grad, None


def answer_logprobs(logits: torch.Tensor, answer: torch.Tensor, temperature: float):
    """Log-probabilities and entropies of the ``answer`` tokens (batch x answer length),
    from ``logits`` aligned on them: position ``i`` predicts ``answer[:, i]``."""
    lg = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 logits: in fp32
    if temperature != 1.0:
        lg = lg / temperature
    return _TokenLogprobEntropy.apply(lg, answer)


# ---------------------------------------------------------------- the run


@dataclass
class SideBySide:
    """An update step's actor and critic halves on two threads, each with ``threads`` of the cores.

    On a CPU, one process, fp32: a PPO update of a small model is mostly small
    operations that gain little from a second intra-op thread (at the 1.6M-parameter
    bench shape one actor + critic step took ~45 ms on two threads, ~50 ms on one), so
    the actor's forward and backward run on this thread and the critic's on a second,
    each on half the cores. Measured in one process, alternating with the joint step, an
    update of 8 steps took 4-11% less (medians of 12 to 30 updates: 377 vs 422 ms, 449 vs
    478, 381 vs 398). Scoring a rollout the same way (actor and critic beside reference
    and reward model) gained nothing (51 vs 49 ms) and is not done. The two halves share
    no parameter and no graph; their gradients are exactly the joint loss's. Not used with
    several processes (DDP syncs gradients through the wrapped module's forward), mixed
    precision (autocast wraps that forward too) or a single core. Between the halves, the
    gradient clipping and the optimizer step run on every core again: an update of 8 steps
    took 332 ms against 365 ms with them on half the cores (406 against 433 ms in a second
    measurement, medians of alternated updates)."""

    pool: ThreadPoolExecutor
    threads: int

    @classmethod
    def when_it_helps(cls, acc) -> "SideBySide | None":
        threads = torch.get_num_threads()
        if acc.device.type != "cpu" or acc.num_processes > 1 or acc.mixed_precision != "no" or threads < 2:
            return None
        return cls(ThreadPoolExecutor(1, thread_name_prefix="ppo-side"), threads // 2)

    def run(self, here: Callable[[], Any], there: Callable[[], Any]) -> tuple[Any, Any]:
        """``here()`` on this thread and ``there()`` on the second one, at the same time."""

        def on_second():
            torch.set_num_threads(self.threads)
            return there()

        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        pending = self.pool.submit(on_second)
        try:
            result = here()
        finally:
            other = pending.result()  # joined even when here() failed
            torch.set_num_threads(threads)
        return result, other


@dataclass
class PPOState:
    """What a PPO checkpoint carries beside the models, optimizer, schedule and RNG states."""

    step: int = 0
    kl_coef: float = 0.0
    first: dict[str, Any] | None = None
    totals: dict[str, float] = field(default_factory=lambda: {
        "time_generate": 0.0, "time_score": 0.0, "time_train": 0.0, "optimizer_steps": 0})
    batch_index: int = 1  # the next prompt batch to draw: the data position (a rollback moves it on)
    lr_scale: float = 1.0  # product of rollback lr factors so far
    rollbacks: int = 0
    consecutive_rollbacks: int = 0
    failed_step: int = 0
    rewards: list[float] = field(default_factory=list)  # each rollout's mean reward, in order

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {"batch_index": int(state.get("step", 0)) + 1, **state}  # checkpoints written before it existed
        for k, v in state.items():
            setattr(self, k, v)


class PPORunner:
    def __init__(self, cfg: PPOConfig, acc, policy: str, reward: str, prompts: list[list[int]], out: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from crawl2chat.stages.training.reward import load_reward_model

        self.cfg, self.acc, self.out = cfg, acc, out
        self.tok = AutoTokenizer.from_pretrained(policy)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.eot_id = end_of_turn_id(self.tok)
        self.prompts = prompts
        actor = AutoModelForCausalLM.from_pretrained(policy)
        critic = load_reward_model(reward, self.pad_id)
        if cfg.grad_checkpointing:
            # Active in training mode only: the optimisation phase, not the rollout.
            enable_grad_checkpointing(actor)
            enable_grad_checkpointing(critic)
        self.ref = AutoModelForCausalLM.from_pretrained(policy).to(acc.device).eval().requires_grad_(False)
        self.rm = load_reward_model(reward, self.pad_id).to(acc.device).eval().requires_grad_(False)
        ac = ActorCritic(actor, critic)
        per_rollout = cfg.ppo_epochs * max(1, -(-cfg.rollout_batch_size // (cfg.micro_batch_size * cfg.grad_accum)))
        optimizer = build_optimizer(ac, cfg, fused=can_fuse(acc, ac))
        self.model, self.optimizer = acc.prepare(ac, optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.model_copy(update={"max_steps": cfg.max_steps * per_rollout}))
        self.kl = KLController(cfg.kl_coef, cfg.adaptive_kl, cfg.kl_target, cfg.kl_horizon)
        self.state = PPOState(kl_coef=self.kl.value)
        acc.register_for_checkpointing(self.scheduler, self.state)
        self.ckpt_root = out / "checkpoints"
        self.metrics = MetricsWriter(out / "metrics.jsonl", enabled=acc.is_main_process)
        self.reduce = lambda t: acc.reduce(t, "sum")
        self.side_by_side = SideBySide.when_it_helps(acc)

    # ------------------------------------------------------------ rollout

    def prompt_batch(self, batch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.cfg.seed, batch, self.acc.process_index])
        return [self.prompts[i] for i in rng.integers(0, len(self.prompts), self.cfg.rollout_batch_size)]

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every process calls it)."""
        return float(self.acc.reduce(torch.tensor(float(flag), device=self.acc.device), "sum")) > 0

    @torch.no_grad()
    def rollout(self, batch: int) -> dict[str, Any]:
        """Sample and score answers to prompt batch ``batch``; ``{"unstable": reason}``
        instead when a number on the way is not finite (on any process)."""
        c, dev = self.cfg, self.acc.device
        t0 = time.perf_counter()
        prompts = self.prompt_batch(batch)
        p_ids = pad(prompts, self.pad_id, left=True).to(dev)
        p_mask = pad([[1] * len(p) for p in prompts], 0, p_ids.shape[1], left=True).to(dev)
        P = p_ids.shape[1]
        actor = self.acc.unwrap_model(self.model).actor
        actor.eval()
        try:
            gen, drawn_logprobs = sample_batch(actor, p_ids, p_mask, c.max_new_tokens, c.temperature, self.eot_id,
                                               self.pad_id, everyone_done=lambda ended: not self.any_process(not ended),
                                               with_logprobs=True)
            failed = False
        except NonFiniteLogits:
            failed = True
        if self.any_process(failed):
            return {"unstable": "non-finite sampling probabilities"}
        resp = gen[:, P:]
        if resp.shape[1] < c.max_new_tokens:
            resp = F.pad(resp, (0, c.max_new_tokens - resp.shape[1]), value=self.pad_id)
        is_eot = resp == self.eot_id
        ended = is_eot.any(1)
        first_eot = torch.where(ended, is_eot.float().argmax(1), torch.full_like(ended, c.max_new_tokens - 1,
                                                                                     dtype=torch.long))
        r_mask = (torch.arange(resp.shape[1], device=dev)[None] <= first_eot[:, None]).long()
        resp = torch.where(r_mask.bool(), resp, self.pad_id)
        seq, attn = torch.cat([p_ids, resp], 1), torch.cat([p_mask, r_mask], 1)
        pos = positions(attn)
        t1 = time.perf_counter()

        self.model.eval()
        # The policy's log-probabilities are those the answers were drawn with (a forward
        # pass over the whole sequence gives the same to ~1e-6); past an answer's end, 0, so
        # that a padding position's ratio stays finite where the mask drops it.
        logprobs = F.pad(drawn_logprobs, (0, c.max_new_tokens - drawn_logprobs.shape[1]))
        logprobs = torch.where(r_mask.bool(), logprobs, 0.0)
        values = self.acc.unwrap_model(self.model).values(seq, attn, pos)[:, P - 1:-1]
        ref_logits = self.ref(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=False,
                              logits_to_keep=answer_positions(seq.shape[1], P, seq.device)).logits
        ref_logprobs, _ = answer_logprobs(ref_logits, seq[:, P:], c.temperature)
        scores = self.rm(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, 0].float()
        mask = r_mask.float()
        rewards, kl = token_rewards(logprobs, ref_logprobs, mask, scores, ended, self.kl.value, c.missing_eos_penalty)
        finite = all(bool(torch.isfinite(x).all()) for x in (scores, logprobs, ref_logprobs, values))
        if self.any_process(not finite):
            return {"unstable": "non-finite scores, log-probabilities or values in the rollout"}
        adv, returns = compute_gae(rewards, values, mask, c.gamma, c.lam)
        adv = masked_whiten(adv, mask, self.reduce)
        t2 = time.perf_counter()
        return {"seq": seq, "attn": attn, "pos": pos, "P": P, "logprobs": logprobs, "values": values,
                "adv": adv, "returns": returns, "mask": mask, "scores": scores, "kl": kl.sum(1), "ended": ended,
                "time_generate": t1 - t0, "time_score": t2 - t1}

    # ------------------------------------------------------------ optimisation

    def forward_backward_step(self, ro: dict[str, Any], idx: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        """The PPO losses of the rollout's rows ``idx``, their gradients (times ``scale``)
        added to the parameters'. Side by side (:attr:`side_by_side`), the critic's half
        runs on a second thread while this one runs the actor's."""
        c, P = self.cfg, ro["P"]
        seq, attn, pos, mask = ro["seq"][idx], ro["attn"][idx], ro["pos"][idx], ro["mask"][idx]

        def actor_half(logits):
            lp, ent = answer_logprobs(logits, seq[:, P:], c.temperature)
            return policy_losses(lp, ent, ro["logprobs"][idx], ro["adv"][idx], mask, c.cliprange, c.ent_coef)

        def critic_half(values):
            return value_losses(values[:, P - 1:-1], ro["values"][idx], ro["returns"][idx], mask,
                                c.cliprange_value, c.vf_coef)

        if self.side_by_side is None:
            logits, values = self.model(seq, attn, pos, answer_from=P)
            actor, critic = actor_half(logits), critic_half(values)
            self.acc.backward((actor["loss"] + critic["loss"]) * scale)
        else:
            ac = self.acc.unwrap_model(self.model)
            head = HeadWeightGrad() if HeadWeightGrad.applies_to(ac.actor) else None

            def actor_step():
                out = actor_half(ac.logits(seq, attn, pos, answer_from=P, head_grad=head))
                (out["loss"] * scale).backward()
                return out

            def critic_step():
                out = critic_half(ac.values(seq, attn, pos))
                (out["loss"] * scale).backward()
                return out, head.compute_if_ready() if head is not None else None

            actor, (critic, head_weight_grad) = self.side_by_side.run(actor_step, critic_step)
            if head is not None:
                head.add_to(ac.actor.lm_head.weight, head_weight_grad)
        return {**actor, **critic, "loss": actor["loss"] + critic["loss"]}

    def optimise(self, ro: dict[str, Any], step: int) -> dict[str, float]:
        self.model.train()
        c = self.cfg
        B = ro["seq"].shape[0]
        mb = c.micro_batch_size * c.grad_accum
        rng = np.random.default_rng([c.seed, step, 1 + self.acc.process_index])
        stats: dict[str, list[float]] = {}
        n_opt = 0
        for _ in range(c.ppo_epochs):
            order = torch.from_numpy(rng.permutation(B))
            for start in range(0, B, mb):
                chunk = order[start:start + mb]
                micros = [chunk[i:i + c.micro_batch_size] for i in range(0, len(chunk), c.micro_batch_size)]
                for k, idx in enumerate(micros):
                    idx = idx.to(ro["seq"].device)
                    with (self.acc.no_sync(self.model) if k < len(micros) - 1 else _null()):
                        out = self.forward_backward_step(ro, idx, 1.0 / len(micros))
                    for key, v in out.items():
                        stats.setdefault(key, []).append(v.item())
                max_norm = c.clip_norm if c.clip_norm > 0 else float("inf")
                grad_norm = float(clip_by_global_norm(self.acc, self.model.parameters(), max_norm))
                if not np.isfinite(grad_norm):
                    # A non-finite gradient never reaches the weights; the minibatch is skipped and counted.
                    self.optimizer.zero_grad(set_to_none=True)
                    stats.setdefault("skipped_minibatches", []).append(1.0)
                    continue
                stats.setdefault("grad_norm", []).append(grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                n_opt += 1
        res = {k: float(np.mean(v)) for k, v in stats.items()}
        res["skipped_minibatches"] = len(stats.get("skipped_minibatches", []))
        # Every minibatch skipped: no gradient norm to report (left out, never NaN).
        res["optimizer_steps"] = n_opt
        return res

    def mean(self, x: torch.Tensor) -> float:
        return float(self.acc.reduce(x.float().mean().detach(), "mean"))

    def resume(self) -> bool:
        """Continue from the newest intact checkpoint under ``OUT/checkpoints``, if any;
        a rollback recorded after it (``rollback.json``) is applied again."""
        main = self.acc.is_main_process
        record = read_rollback_record(self.ckpt_root, self.acc.print)
        discarded = set(record.get("discard", [])) if record else set()
        if discarded and main:  # a rollback killed between its record and the discarding
            discard_checkpoints(self.ckpt_root, discarded)
            write_rollback_record(self.ckpt_root, {**record, "discard": []})
        candidates = good_checkpoints(self.ckpt_root, exclude=discarded, main=main, report=self.acc.print)
        self.acc.wait_for_everyone()
        if not candidates:
            return False
        path = candidates[0]
        self.acc.load_state(str(path))
        self.kl.value = self.state.kl_coef
        event = {"type": "event", "event": "resume", "step": self.state.step, "checkpoint": path.name}
        if record and self.state.step <= record["step"]:
            self._apply_rollback_record(record)
            event.update(rollbacks=self.state.rollbacks, lr_scale=self.state.lr_scale,
                         batch_index=self.state.batch_index)
        self.metrics.write(event)
        self.acc.print(f"resumed from {path} at rollout {self.state.step}")
        return True

    def _apply_rollback_record(self, record: dict[str, Any]) -> None:
        s = self.state
        s.rollbacks, s.lr_scale = record["rollbacks"], record["lr_scale"]
        s.consecutive_rollbacks, s.failed_step = record["consecutive_rollbacks"], record["failed_step"]
        s.batch_index = record["batch_index"]
        apply_lr_scale(self.scheduler, self.optimizer, self.cfg.lr * s.lr_scale)

    def weights_finite(self) -> bool:
        return all_finite(list(self.model.parameters()))

    def rollback(self, reason: str, batch: int) -> None:
        """Back to a good checkpoint with a lower learning rate, past prompt batch ``batch``
        (see the module docstring; the trainer's rollback, for PPO's loop)."""
        self.optimizer.zero_grad(set_to_none=True)
        s, rb = self.state, self.cfg.rollback
        failed_step = s.step + 1
        consecutive, furthest = rollback_plan(s.step, s.consecutive_rollbacks, s.failed_step)
        rollbacks, lr_scale = s.rollbacks + 1, s.lr_scale * rb.lr_factor
        event = {"type": "event", "event": "rollback", "step": failed_step, "batch_index": batch, "reason": reason,
                 "rollbacks": rollbacks, "consecutive_rollbacks": consecutive}
        if consecutive > rb.max_rollbacks:
            self.metrics.write({**event, "event": "diverged"})
            raise TrainingDiverged(
                f"PPO diverged at rollout {failed_step} ({reason}) after {consecutive - 1} rollbacks in a row "
                f"(rollback.max_rollbacks={rb.max_rollbacks}); lower lr or kl_coef")
        candidates = good_checkpoints(self.ckpt_root, main=self.acc.is_main_process, report=self.acc.print)
        if not candidates:
            raise RuntimeError(f"no intact checkpoint under {self.ckpt_root} to roll back to")
        back = min(consecutive - 1, len(candidates) - 1)
        path, passed = candidates[back], [p.name for p in candidates[:back]]
        self.acc.load_state(str(path))
        self.kl.value = self.state.kl_coef
        record = {"checkpoint": path.name, "step": self.state.step, "batch_index": batch + 1, "lr_scale": lr_scale,
                  "rollbacks": rollbacks, "consecutive_rollbacks": consecutive, "failed_step": furthest,
                  "discard": passed, "reason": reason}
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            write_rollback_record(self.ckpt_root, record)
            if passed:
                discard_checkpoints(self.ckpt_root, passed)
                write_rollback_record(self.ckpt_root, {**record, "discard": []})
        self.acc.wait_for_everyone()
        self._apply_rollback_record(record)
        self.metrics.write({**event, "checkpoint": path.name, "resumed_step": self.state.step, "lr_scale": lr_scale,
                            "discarded": passed})
        self.acc.print(f"rollback {rollbacks} ({consecutive} in a row): {reason} at rollout {failed_step}; back to "
                       f"{path.name}, lr x{lr_scale:.3g}, skipping to prompt batch {self.state.batch_index}")

    def run(self) -> dict[str, Any]:
        c = self.cfg
        if not self.resume():
            # Step 0 checkpoint: the first rollback needs something to return to.
            save_checkpoint(self.acc, self.ckpt_root, 0, c.keep_checkpoints)
        last = None
        start_step = self.state.step
        t_start = time.perf_counter()
        self.metrics.write({"type": "event", "event": "start", "step": self.state.step,
                            "world_size": self.acc.num_processes,
                            "grad_checkpointing": is_checkpointing(self.acc.unwrap_model(self.model))})
        while self.state.step < c.max_steps:
            step, batch = self.state.step + 1, self.state.batch_index
            ro = self.rollout(batch)
            if "unstable" in ro:
                self.rollback(ro["unstable"], batch)
                continue
            t0 = time.perf_counter()
            st = self.optimise(ro, batch)
            if batch in c.inject_nan_at_batches:
                with torch.no_grad():
                    for p in self.acc.unwrap_model(self.model).actor.parameters():
                        p.fill_(float("nan"))
            if st["optimizer_steps"] == 0:
                self.rollback("every minibatch had a non-finite gradient", batch)
                continue
            if self.any_process(not self.weights_finite()):
                self.rollback("non-finite weights after the update", batch)
                continue
            t_train = time.perf_counter() - t0
            first, totals = self.state.first, self.state.totals
            kl = self.mean(ro["kl"])
            step_time = ro["time_generate"] + ro["time_score"] + t_train
            # Tokens of the rollout's sequences (prompts and answers, every process) per second of the step.
            tokens = float(self.acc.reduce(ro["attn"].sum().float(), "sum"))
            rec = {"type": "step", "step": step, "reward_mean": self.mean(ro["scores"]), "kl": kl,
                   "tokens_per_second": tokens / max(step_time, 1e-9),
                   "kl_coef": self.kl.value, "response_length": self.mean(ro["mask"].sum(1)),
                   "eos_rate": self.mean(ro["ended"]), "lr": self.optimizer.param_groups[0]["lr"],
                   **{k: st[k] for k in ("loss", "policy_loss", "value_loss", "entropy", "clip_fraction",
                                         "value_clip_fraction", "approx_kl", "grad_norm", "skipped_minibatches")
                      if k in st},
                   "time_generate": ro["time_generate"], "time_score": ro["time_score"], "time_train": t_train}
            self.kl.update(kl, c.rollout_batch_size * self.acc.num_processes)
            for k in ("time_generate", "time_score"):
                totals[k] += ro[k]
            totals["time_train"] += t_train
            totals["optimizer_steps"] += st["optimizer_steps"]
            if step % max(1, c.log_every) == 0 or step == c.max_steps:
                self.metrics.write(rec)
            first = first or rec
            last = rec
            self.state.rewards.append(rec["reward_mean"])
            self.acc.print(f"ppo step {step}: reward {rec['reward_mean']:.3f} kl {kl:.3f} "
                           f"len {rec['response_length']:.1f} clip {rec['clip_fraction']:.3f}")
            self.state.step, self.state.kl_coef, self.state.first = step, self.kl.value, first
            self.state.batch_index = batch + 1
            if c.checkpoint_every and step % c.checkpoint_every == 0 and step < c.max_steps:
                save_checkpoint(self.acc, self.ckpt_root, step, c.keep_checkpoints)
        wall = time.perf_counter() - t_start
        first, totals = self.state.first, self.state.totals
        busy = totals["time_generate"] + totals["time_score"] + totals["time_train"]
        quarter = max(1, len(self.state.rewards) // 4)
        return {"steps": c.max_steps, "reward_mean_first": first["reward_mean"], "reward_mean_last": last["reward_mean"],
                "reward_mean_first_quarter": float(np.mean(self.state.rewards[:quarter])),
                "reward_mean_last_quarter": float(np.mean(self.state.rewards[-quarter:])), "quarter": quarter,
                "kl_last": last["kl"], "kl_coef_last": self.kl.value, "response_length_last": last["response_length"],
                "eos_rate_last": last["eos_rate"], "wall_seconds": wall,
                "rollouts_per_second": (c.max_steps - start_step) / wall,
                "optimizer_steps_per_second": totals["optimizer_steps"] / max(totals["time_train"], 1e-9),
                "optimizer_steps": totals["optimizer_steps"],
                "time_share_generate": totals["time_generate"] / busy, "time_share_score": totals["time_score"] / busy,
                "time_share_train": totals["time_train"] / busy, **totals,
                "rollbacks": self.state.rollbacks, "world_size": self.acc.num_processes,
                "update_side_by_side": self.side_by_side is not None,
                "device": str(self.acc.device), "peak_memory_mb": peak_memory_mb(self.acc.device)}

    def save(self, policy: str, reward: str, summary: dict[str, Any]) -> None:
        acc = self.acc
        acc.wait_for_everyone()
        state = acc.get_state_dict(self.model)
        if acc.is_main_process:
            ac = acc.unwrap_model(self.model)
            actor_sd = {k[len("actor."):]: v for k, v in state.items() if k.startswith("actor.")}
            save_model(ac.actor, actor_sd, Path(policy), self.out / "model")
            if self.cfg.save_value_model:
                critic_sd = {k[len("critic."):]: v for k, v in state.items() if k.startswith("critic.")}
                save_model(ac.critic, critic_sd, Path(reward), self.out / "value_model")
            summary["model_dir"] = str((self.out / "model").resolve())
            (self.out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.metrics.write({"type": "event", "event": "done", **summary})
        self.metrics.close()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- entry point


def parse_args(argv=None):
    return stage_parser("ppo", __doc__).parse_args(argv)


def run(cfg: PPOConfig, policy: str, reward: str, prompts_file: str, out: str | Path) -> dict[str, Any]:
    """In-process PPO (one process, or one rank of an accelerate launch)."""
    from transformers import AutoTokenizer

    out = Path(out)
    done = finished_summary(out, cfg.max_steps)
    if done is not None:
        print(f"{out} already finished {done['steps']} steps; model in {out / 'model'}")
        return done
    acc = make_accelerator(cfg)
    if acc.distributed_type == DistributedType.DEEPSPEED:
        # PPO runs four models through its own loop; DeepSpeed's engine would own only one of them.
        raise ValueError("PPO does not run under DeepSpeed; use the gpu_ddp or fsdp accelerate config")
    prepare_out(acc, cfg, out)
    tok = AutoTokenizer.from_pretrained(policy)
    prompt_msgs, skipped = load_prompts(prompts_file)
    prompts = [encode_prompt(tok, m, cfg.max_prompt_len) for m in prompt_msgs]
    runner = PPORunner(cfg, acc, policy, reward, prompts, out)
    acc.print(f"PPO: {len(prompts)} prompts (skipped {dict(skipped)}), {cfg.rollout_batch_size} per rollout per "
              f"process, {cfg.max_steps} rollouts, kl_coef {cfg.kl_coef}{' adaptive' if cfg.adaptive_kl else ''}")
    summary = runner.run()
    summary.update(stage="ppo", policy=str(Path(policy).resolve()), reward=str(Path(reward).resolve()),
                   prompts=str(Path(prompts_file).resolve()), prompt_count=len(prompts), skipped=dict(skipped))
    runner.save(policy, reward, summary)
    if runner.side_by_side is not None:
        runner.side_by_side.pool.shutdown()
    acc.end_training()
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return run(resolve(PPOConfig, args), args.policy, args.reward, args.prompts, args.out)


if __name__ == "__main__":
    run_script(main)
