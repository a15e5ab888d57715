"""Reward model: a base causal LM + a scalar head, trained on preference pairs.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.reward --base MODEL_DIR --data PREFS --out OUT \\
        [--config rm.yaml] [--max-steps N] [--set lr=1e-4 ...]

The model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` on
the base weights (a Llama base gives ``LlamaForSequenceClassification``): its
score is read at the last non-padding token, which here is the end-of-turn
marker closing the assistant answer. Loss per pair is
``-logsigmoid(r_chosen - r_rejected - margin)`` (Bradley-Terry with a margin:
the pair's own ``margin`` column where it has one, else the ``margin`` setting,
0.1 by default). A row with ``ranked`` answers (best first, 2-16 of them) gives
all of its K choose 2 pairs, drawn into one batch together and averaged per
prompt, as InstructGPT does, so a prompt counts once however many answers it
ranks. Training machinery is the shared
:class:`~crawl2chat.stages.training.trainer.Trainer`; re-running on the same ``OUT`` resumes.

Outputs: ``OUT/model`` (loads with ``AutoModelForSequenceClassification``;
``pad_token_id`` set in its config), ``OUT/metrics.jsonl`` and
``OUT/metrics.json`` (``eval_accuracy`` on held-out pairs, ``val_loss``,
``base``/``data`` lineage).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from crawl2chat.stages.training.chat_data import encode_pair, held_out_phrase, load_preferences, pad, split_held_out
from crawl2chat.stages.training.models import enable_grad_checkpointing
from crawl2chat.stages.training.sampling import ExampleSampler
from crawl2chat.stages.training.stage import finish, run_script, stage_parser, start_stage
from crawl2chat.stages.training.trainer import Trainer
from crawl2chat.stages.training.settings import RewardConfig

def _pair_key(pair: dict[str, Any]) -> str:
    """A ranked row's pairs share their prompt's key, so they fall on one side of the split."""
    return pair.get("group") or json.dumps(pair, sort_keys=True)


def tokenise_pairs(tokenizer, pairs, cfg, key=_pair_key):
    """Encoded pairs split into train/held-out
    (:func:`~crawl2chat.stages.training.chat_data.split_held_out`), skip counts and the split rule."""
    encoded, keys, skipped = [], [], Counter()
    for p in pairs:
        try:
            e = encode_pair(tokenizer, p, cfg.seq_len)
        except ValueError as err:
            skipped[str(err)] += 1
            continue
        e["group"] = p.get("group")
        encoded.append(e)
        keys.append(key(p))
    held, rule = split_held_out(keys, cfg.val_fraction)
    train = [e for e, h in zip(encoded, held) if not h]
    val = [e for e, h in zip(encoded, held) if h]
    if not train:
        raise ValueError(f"no preference pairs left after tokenisation (skipped {dict(skipped)})")
    return train, val, skipped, rule


def collate_pairs(encoded: list[dict[str, Any]], pad_id: int, margin: float = 0.0) -> dict[str, torch.Tensor]:
    """Chosen and rejected rows right-padded to one length (chosen first, then rejected);
    ``margin`` for the pairs that carry none of their own; ``weight`` of each pair in
    the loss (``1 / pairs`` of its prompt in the batch, so every prompt counts once)."""
    rows = [e["chosen"] for e in encoded] + [e["rejected"] for e in encoded]
    masks = [e["chosen_mask"] for e in encoded] + [e["rejected_mask"] for e in encoded]
    ids = pad(rows, pad_id)
    sizes = Counter(e.get("group") for e in encoded if e.get("group"))
    return {"input_ids": ids, "attention_mask": pad([[1] * len(r) for r in rows], 0, ids.shape[1]),
            "response_mask": pad(masks, 0, ids.shape[1]),
            "margin": torch.tensor([margin if e["margin"] is None else float(e["margin"]) for e in encoded]),
            "weight": torch.tensor([1.0 / sizes[e["group"]] if e.get("group") else 1.0 for e in encoded])}


def prompt_units(n_train: int, encoded: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]]]:
    """Indices of ``encoded`` (train first, then held-out) grouped by prompt: a ranked
    row's pairs form one unit, drawn into one batch together (InstructGPT); any other
    pair is a unit of its own."""
    units: list[list[int]] = []
    for i, e in enumerate(encoded):
        same = units and i != n_train and e.get("group") and encoded[units[-1][-1]].get("group") == e["group"]
        if same:
            units[-1].append(i)
        else:
            units.append([i])
    first_val = next((u for u, idx in enumerate(units) if idx[0] >= n_train), len(units))
    return units[:first_val], units[first_val:]


def pair_rewards(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    scores = scores.squeeze(-1).float()
    n = scores.shape[0] // 2
    return scores[:n], scores[n:]


def pairwise_loss(model, batch) -> tuple[torch.Tensor, int]:
    """``-logsigmoid(r_chosen - r_rejected - margin)`` averaged per prompt, then over the
    prompts of the batch (plain pairs: the mean over pairs)."""
    rc, rr = pair_rewards(model, batch)
    losses = -F.logsigmoid(rc - rr - batch["margin"])
    weight = batch.get("weight")
    if weight is None:
        return losses.mean(), rc.shape[0]
    return (losses * weight).sum() / weight.sum(), rc.shape[0]


@torch.no_grad()
def pair_accuracy(acc, model, batches, score_fn) -> dict[str, float]:
    """Share of held-out pairs whose chosen side scores higher (reduced over ranks)."""
    model.eval()
    right = torch.zeros((), device=acc.device)
    total = torch.zeros((), device=acc.device)
    margins = []
    for b in batches:
        b = {k: v.to(acc.device) for k, v in b.items()}
        rc, rr = score_fn(model, b)
        right += (rc > rr).sum() + 0.5 * (rc == rr).sum()  # a tie is a coin flip
        total += rc.numel()
        margins.append((rc - rr).sum())
    margin_sum = torch.stack(margins).sum() if margins else torch.zeros((), device=acc.device)
    right, total, margin_sum = acc.reduce(right, "sum"), acc.reduce(total, "sum"), acc.reduce(margin_sum, "sum")
    if total.item() == 0:
        return {}  # nothing held out: no figures (never NaN)
    return {"accuracy": (right / total).item(), "margin_mean": (margin_sum / total).item()}


def load_reward_model(path, pad_token_id: int | None = None):
    from transformers import AutoModelForSequenceClassification

    kw = {"pad_token_id": pad_token_id} if pad_token_id is not None else {}
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kw)
    model.config.use_cache = False
    return model


def parse_args(argv=None):
    return stage_parser("reward", __doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start, done = start_stage(RewardConfig, args, args.base)
    if start is None:
        return done
    cfg, out, acc, tokenizer, pad_id = start.cfg, start.out, start.acc, start.tokenizer, start.pad_id
    pairs, bad_rows = load_preferences(args.data)
    train, val, skipped, rule = tokenise_pairs(tokenizer, pairs, cfg)
    encoded = train + val
    train_units, val_units = prompt_units(len(train), encoded)
    units = train_units + val_units
    sampler = ExampleSampler(len(train_units), list(range(len(train_units), len(units))),
                             lambda ids: collate_pairs([encoded[j] for i in ids for j in units[i]], pad_id, cfg.margin),
                             cfg)
    model = load_reward_model(args.base, pad_id)
    if cfg.grad_checkpointing:
        enable_grad_checkpointing(model)
    acc.print(f"reward model: {len(train)} pairs, {held_out_phrase(len(val), rule)}, margin {cfg.margin} "
              f"(unless a pair has its own); skipped {dict(bad_rows + skipped)}")
    trainer: Trainer | None = None

    def eval_extra(_loss: float) -> dict[str, float]:
        r = pair_accuracy(acc, trainer.model, sampler.eval_batches(trainer.rank, trainer.world), pair_rewards)
        return {"eval_accuracy": r["accuracy"], "eval_margin": r["margin_mean"]} if r else {}

    trainer = Trainer(cfg, acc, model, out, batch_fn=sampler.batch, loss_fn=pairwise_loss,
                      eval_batches_fn=sampler.eval_batches if val else None, eval_extra=eval_extra)
    summary = trainer.fit()
    summary.update(stage="reward", base=str(Path(args.base).resolve()), data=str(Path(args.data).resolve()),
                   pairs=len(train), prompts=len(train_units), held_out=len(val), held_out_rule=rule, margin=cfg.margin,
                   skipped=dict(bad_rows + skipped))
    return finish(acc, trainer, Path(args.base), out, summary)


if __name__ == "__main__":
    run_script(main)
