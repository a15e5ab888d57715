"""Supervised fine-tuning: a base causal LM -> a chat model.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.sft --base MODEL_DIR --data FILE --out OUT \\
        [--config sft.yaml] [--max-steps N] [--set lr=1e-4 ...]

Conversations (``messages``, ``prompt``/``response`` or Alpaca rows; see
:mod:`crawl2chat.stages.training.chat_data`) are rendered with the base model's chat
template; only assistant tokens carry labels. Examples are packed whole into
``seq_len`` rows (first fit in a seeded order, the rest of a row padded and
unlabelled), so few tokens are spent on padding. Packed conversations share
one causal attention span (no per-conversation mask): each starts with its
role header after the previous one's end-of-turn marker, and only assistant
tokens are scored; ``--set pack=false`` gives one conversation per row. Optimizer, schedule,
clipping, checkpoints, resume and rollback are the shared
:class:`~crawl2chat.stages.training.trainer.Trainer`'s; re-running on the same ``OUT``
resumes.

Outputs: ``OUT/model`` (Hugging Face causal LM + tokenizer), ``OUT/metrics.jsonl``
and ``OUT/metrics.json`` (``val_loss``, ``steps``, ``examples``, ``skipped``,
``base`` and ``data`` for lineage).

This module also holds what the other post-training scripts (reward, DPO)
share: argument parsing, the index-addressed example sampler and the final
save.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.chat_data import (IGNORE_INDEX, encode_sft, held_out_phrase, load_sft,
                                                    scored_logits, split_held_out)
from crawl2chat.stages.training.sampling import ExampleSampler
from crawl2chat.stages.training.stage import finish, run_script, stage_parser, start_stage
from crawl2chat.stages.training.models import enable_grad_checkpointing
from crawl2chat.stages.training.trainer import Trainer
from crawl2chat.stages.training.settings import SFTConfig

# ---------------------------------------------------------------- shared by the post-training scripts


# ---------------------------------------------------------------- SFT data and loss


def pack_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, pack: bool,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) examples -> ``(rows, seq_len)`` tensors. With ``pack``, whole
    examples are placed first-fit in a seeded order; padding is unlabelled."""
    order = np.random.default_rng(seed).permutation(len(examples)) if pack else range(len(examples))
    rows: list[tuple[list[int], list[int]]] = []
    for i in order:
        ids, labels = examples[int(i)]
        if pack:
            for r in rows:
                if len(r[0]) + len(ids) <= seq_len:
                    r[0].extend(ids)
                    r[1].extend(labels)
                    break
            else:
                rows.append((list(ids), list(labels)))
        else:
            rows.append((list(ids), list(labels)))
    ids_t = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    lab_t = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    for j, (ids, labels) in enumerate(rows):
        ids_t[j, :len(ids)] = torch.tensor(ids)
        lab_t[j, :len(labels)] = torch.tensor(labels)
    return ids_t, lab_t


def sft_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean next-token cross-entropy over labelled (assistant) positions, projected onto
    the vocabulary only there (:func:`~crawl2chat.stages.training.chat_data.scored_logits`)."""
    logits, targets = scored_logits(model, batch["input_ids"], batch["labels"] != IGNORE_INDEX)
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    return loss / max(1, len(targets)), len(targets)


def build_sft_rows(tokenizer, conversations, cfg: SFTConfig) -> dict[str, Any]:
    """Tokenise, split (:func:`~crawl2chat.stages.training.chat_data.split_held_out`) and pack;
    returns the train/val row tensors, skip counts and the split rule."""
    encoded, keys, skipped = [], [], Counter()
    for msgs in conversations:
        try:
            encoded.append(encode_sft(tokenizer, msgs, cfg.seq_len))
        except ValueError as e:
            skipped[str(e)] += 1
            continue
        keys.append(json.dumps(msgs, sort_keys=True))
    held, rule = split_held_out(keys, cfg.val_fraction)
    train = [ex for ex, h in zip(encoded, held) if not h]
    val = [ex for ex, h in zip(encoded, held) if h]
    if not train:
        raise ValueError(f"no SFT examples left after tokenisation (skipped {dict(skipped)})")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tr = pack_examples(train, cfg.seq_len, pad_id, cfg.pack, cfg.seed)
    va = pack_examples(val, cfg.seq_len, pad_id, cfg.pack, cfg.seed) if val else None
    return {"train": tr, "val": va, "skipped": skipped, "n_train": len(train), "n_val": len(val), "rule": rule}


# ---------------------------------------------------------------- entry point


def parse_args(argv=None):
    return stage_parser("sft", __doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    args = parse_args(argv)
    start, done = start_stage(SFTConfig, args, args.base)
    if start is None:
        return done
    cfg, out, acc, tokenizer = start.cfg, start.out, start.acc, start.tokenizer
    conversations, bad_rows = load_sft(args.data)
    data = build_sft_rows(tokenizer, conversations, cfg)
    (tr_ids, tr_labels), val = data["train"], data["val"]
    val_ids, val_labels = val if val is not None else (tr_ids[:0], tr_labels[:0])
    all_ids, all_labels = torch.cat([tr_ids, val_ids]), torch.cat([tr_labels, val_labels])
    n_tr = len(tr_ids)
    sampler = ExampleSampler(n_tr, list(range(n_tr, len(all_ids))),
                             lambda ids: {"input_ids": all_ids[ids], "labels": all_labels[ids]}, cfg)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    model.config.use_cache = False
    if cfg.grad_checkpointing:
        enable_grad_checkpointing(model)
    acc.print(f"SFT: {data['n_train']} conversations in {n_tr} rows of {cfg.seq_len}, "
              f"{held_out_phrase(data['n_val'], data['rule'])}; skipped {dict(bad_rows + data['skipped'])}")
    trainer = Trainer(cfg, acc, model, out, batch_fn=sampler.batch, loss_fn=sft_loss,
                      eval_batches_fn=sampler.eval_batches if len(val_ids) else None)
    summary = trainer.fit()
    summary.update(stage="sft", base=str(Path(args.base).resolve()), data=str(Path(args.data).resolve()),
                   examples=data["n_train"], held_out=data["n_val"], held_out_rule=data["rule"], rows=n_tr,
                   skipped=dict(bad_rows + data["skipped"]),
                   label_fraction=float((tr_labels != IGNORE_INDEX).float().mean()))
    return finish(acc, trainer, Path(args.base), out, summary)


if __name__ == "__main__":
    run_script(main)
