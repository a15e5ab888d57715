"""Direct preference optimisation: an SFT model aligned on preference pairs.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.dpo --policy SFT_MODEL_DIR --data PREFS --out OUT \\
        [--config dpo.yaml] [--max-steps N] [--set beta=0.1 ...]

Loss per pair (Rafailov et al., 2023)::

    -logsigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))

with optional label smoothing (conservative DPO). The reference is the frozen
starting policy; its log-probabilities are computed once before training and
carried with each pair, so the training step runs one model. Implicit reward
``beta * (log pi - log ref)``; ``eval_reward_accuracy`` is the share of held-out
pairs where the chosen answer's implicit reward is higher (ties count half,
so the untrained policy scores exactly 0.5). Same preference data formats as
the reward model; same Trainer machinery (re-running on ``OUT`` resumes).

Outputs: ``OUT/model`` (Hugging Face causal LM + tokenizer), ``OUT/metrics.jsonl``,
``OUT/metrics.json`` (``eval_reward_accuracy``, ``eval_reward_accuracy_start``,
``eval_reward_margin``, ``policy``/``data`` lineage).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from crawl2chat.stages.training.chat_data import held_out_phrase, load_preferences, response_logprobs
from crawl2chat.stages.training.models import enable_grad_checkpointing
from crawl2chat.stages.training.reward import collate_pairs, pair_accuracy, tokenise_pairs
from crawl2chat.stages.training.sampling import ExampleSampler
from crawl2chat.stages.training.stage import finish, run_script, stage_parser, start_stage
from crawl2chat.stages.training.trainer import Trainer
from crawl2chat.stages.training.settings import DPOConfig

def policy_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    lp = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    n = lp.shape[0] // 2
    return lp[:n], lp[n:]


def dpo_loss_terms(pc, pr, rc, rr, beta: float, label_smoothing: float = 0.0):
    """Per-pair loss and the chosen/rejected implicit rewards."""
    logits = beta * ((pc - rc) - (pr - rr))
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, beta * (pc - rc), beta * (pr - rr)


def make_dpo_loss(cfg: DPOConfig):
    def loss_fn(model, batch):
        pc, pr = policy_logprobs(model, batch)
        loss, _, _ = dpo_loss_terms(pc, pr, batch["ref_chosen"], batch["ref_rejected"], cfg.beta,
                                    cfg.label_smoothing)
        return loss.mean(), pc.shape[0]

    def implicit_rewards(model, batch):
        pc, pr = policy_logprobs(model, batch)
        _, c, r = dpo_loss_terms(pc, pr, batch["ref_chosen"], batch["ref_rejected"], cfg.beta)
        return c, r

    return loss_fn, implicit_rewards


@torch.no_grad()
def attach_reference_logprobs(model, encoded, pad_id: int, batch_size: int = 16) -> None:
    """Adds ``ref_chosen``/``ref_rejected`` (summed answer log-probabilities) to each encoded pair."""
    model.eval()
    for i in range(0, len(encoded), batch_size):
        chunk = encoded[i:i + batch_size]
        b = collate_pairs(chunk, pad_id)
        lc, lr = policy_logprobs(model, b)
        for e, c, r in zip(chunk, lc.tolist(), lr.tolist()):
            e["ref_chosen"], e["ref_rejected"] = c, r


def collate_with_ref(encoded, pad_id):
    b = collate_pairs(encoded, pad_id)
    b["ref_chosen"] = torch.tensor([e["ref_chosen"] for e in encoded])
    b["ref_rejected"] = torch.tensor([e["ref_rejected"] for e in encoded])
    return b


def parse_args(argv=None):
    return stage_parser("dpo", __doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    start, done = start_stage(DPOConfig, args, args.policy)
    if start is None:
        return done
    cfg, out, acc, tokenizer, pad_id = start.cfg, start.out, start.acc, start.tokenizer, start.pad_id
    pairs, bad_rows = load_preferences(args.data)
    train, val, skipped, rule = tokenise_pairs(tokenizer, pairs, cfg)
    encoded = train + val
    # The reference is the starting policy: score every pair once, before any update.
    model = AutoModelForCausalLM.from_pretrained(args.policy)
    model.config.use_cache = False
    attach_reference_logprobs(model.to(acc.device), encoded, pad_id)
    if cfg.grad_checkpointing:
        enable_grad_checkpointing(model)
    sampler = ExampleSampler(len(train), list(range(len(train), len(encoded))),
                             lambda ids: collate_with_ref([encoded[i] for i in ids], pad_id), cfg)
    loss_fn, implicit_rewards = make_dpo_loss(cfg)
    acc.print(f"DPO: {len(train)} pairs, {held_out_phrase(len(val), rule)}, beta {cfg.beta}; "
              f"skipped {dict(bad_rows + skipped)}")
    trainer: Trainer | None = None

    def eval_extra(_loss: float) -> dict[str, float]:
        r = pair_accuracy(acc, trainer.model, sampler.eval_batches(trainer.rank, trainer.world), implicit_rewards)
        return {"eval_reward_accuracy": r["accuracy"], "eval_reward_margin": r["margin_mean"]} if r else {}

    trainer = Trainer(cfg, acc, model, out, batch_fn=sampler.batch, loss_fn=loss_fn,
                      eval_batches_fn=sampler.eval_batches if val else None, eval_extra=eval_extra)
    start = {}
    if val:
        start = pair_accuracy(acc, trainer.model, sampler.eval_batches(trainer.rank, trainer.world), implicit_rewards)
    summary = trainer.fit()
    summary.update(stage="dpo", policy=str(Path(args.policy).resolve()), data=str(Path(args.data).resolve()),
                   beta=cfg.beta, pairs=len(train), held_out=len(val), held_out_rule=rule,
                   skipped=dict(bad_rows + skipped))
    if start:
        summary["eval_reward_accuracy_start"] = start["accuracy"]
    return finish(acc, trainer, Path(args.policy), out, summary)


if __name__ == "__main__":
    run_script(main)
