"""Supervised fine-tuning: a base causal LM -> a chat model.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.sft --base MODEL_DIR --data FILE --out OUT \\
        [--config sft.yaml] [--max-steps N] [--set lr=1e-4 ...]

Conversations (``messages``, ``prompt``/``response`` or Alpaca rows; see
:mod:`crawl2chat.stages.chat_data`) are rendered with the base model's chat
template; only assistant tokens carry labels. Examples are packed whole into
``seq_len`` rows (first fit in a seeded order, the rest of a row padded and
unlabelled), so few tokens are spent on padding. Packed conversations share
one causal attention span (no per-conversation mask): each starts with its
role header after the previous one's end-of-turn marker, and only assistant
tokens are scored; ``--set pack=false`` gives one conversation per row. Optimizer, schedule,
clipping, checkpoints, resume and rollback are the shared
:class:`~crawl2chat.stages.trainer.Trainer`'s; re-running on the same ``OUT``
resumes.

Outputs: ``OUT/model`` (Hugging Face causal LM + tokenizer), ``OUT/metrics.jsonl``
and ``OUT/metrics.json`` (``val_loss``, ``steps``, ``examples``, ``skipped``,
``base`` and ``data`` for lineage).

This module also holds what the other post-training scripts (reward, DPO)
share: argument parsing, the index-addressed example sampler and the final
save.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from crawl2chat.stages.chat_data import IGNORE_INDEX, encode_sft, is_held_out, load_sft
from crawl2chat.stages.pretrain import finished_summary, save_model
from crawl2chat.stages.trainer import TrainConfig, Trainer, load_config, make_accelerator, parse_overrides

MODULE = "crawl2chat.stages.sft"


class SFTConfig(TrainConfig):
    seq_len: int = 512
    micro_batch_size: int = 8
    max_steps: int = 300
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    pack: bool = True  # several conversations per row; False: one per row, padded
    val_fraction: float = 0.05  # share of conversations (by content hash) held out


# ---------------------------------------------------------------- shared by the post-training scripts


def stage_parser(module: str, doc: str, model_flags: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=module, description=doc.split("\n\n")[0])
    for flag, help_ in model_flags.items():
        p.add_argument(flag, required=True, help=help_)
    p.add_argument("--out", required=True, help="run folder; re-running on it resumes")
    p.add_argument("--config", help="YAML file of config fields")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (dotted for nested, e.g. rollback.max_rollbacks=2)")
    return p


def resolve(cls, args: argparse.Namespace):
    overrides = parse_overrides(args.overrides)
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    return load_config(cls, args.config, overrides)


def argv_for(flags: dict[str, Any], out: str, config: str | None = None, max_steps: int | None = None,
             overrides: list[str] | None = None) -> list[str]:
    """The script's argv from keyword values (for a host-side launcher)."""
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))] + ["--out", str(out)]
    if config:
        argv += ["--config", str(config)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    for o in overrides or []:
        argv += ["--set", o]
    return argv


class ExampleSampler:
    """Micro-batches of examples addressed by global batch index.

    Global batch ``i`` takes positions ``i*G .. i*G+G-1`` of an endless stream
    that visits the training examples in a fresh seeded permutation each
    epoch (``G`` = micro batch x accumulation x processes); its rows are dealt
    to (micro step, rank) pairs, so the data seen does not depend on the
    process layout and a checkpoint's batch index is the whole data position."""

    def __init__(self, n_train: int, eval_ids: list[int], collate: Callable[[list[int]], dict[str, torch.Tensor]],
                 cfg: TrainConfig, train_ids: list[int] | None = None):
        self.train_ids = train_ids if train_ids is not None else list(range(n_train))
        if not self.train_ids:
            raise ValueError("no training examples")
        self.eval_ids, self.collate, self.cfg = eval_ids, collate, cfg
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.train_ids))}
        return self._perms[epoch]

    def ids(self, batch_index: int, micro: int, rank: int, world: int) -> list[int]:
        c, n = self.cfg, len(self.train_ids)
        G = c.micro_batch_size * c.grad_accum * world
        first = batch_index * G + (micro * world + rank) * c.micro_batch_size
        return [self.train_ids[int(self._perm(p // n)[p % n])] for p in range(first, first + c.micro_batch_size)]

    def batch(self, batch_index: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        return self.collate(self.ids(batch_index, micro, rank, world))

    def eval_batches(self, rank: int, world: int):
        c = self.cfg
        mine = self.eval_ids[: c.eval_batches * c.micro_batch_size][rank::world]
        for i in range(0, len(mine), c.micro_batch_size):
            yield self.collate(mine[i:i + c.micro_batch_size])


@dataclass
class StageStart:
    """What every post-training script has once it is under way."""

    cfg: Any
    out: Path
    acc: Any
    tokenizer: Any
    pad_id: int


def start_stage(config_cls, args: argparse.Namespace, model_path: str) -> tuple[StageStart | None, dict | None]:
    """The common opening of the SFT, reward and DPO scripts: settings, the finished-run
    check (returns ``(None, summary)`` when the run is already done), the accelerator,
    the output folder and the tokenizer of the starting model."""
    from transformers import AutoTokenizer

    cfg = resolve(config_cls, args)
    out = Path(args.out)
    done = finished_summary(out, cfg.max_steps)
    if done is not None:
        print(f"{out} already finished {done['steps']} steps; model in {out / 'model'}")
        return None, done
    acc = make_accelerator(cfg)
    prepare_out(acc, cfg, out)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return StageStart(cfg, out, acc, tokenizer, pad_id), None


def prepare_out(acc, cfg, out: Path) -> None:
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    acc.wait_for_everyone()


def finish(acc, trainer: Trainer, tok_dir: Path, out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Save ``OUT/model`` (weights, config, tokenizer files) and ``OUT/metrics.json``."""
    acc.wait_for_everyone()
    state_dict = acc.get_state_dict(trainer.model)
    if acc.is_main_process:
        save_model(acc.unwrap_model(trainer.model), state_dict, Path(tok_dir), out / "model")
        summary["model_dir"] = str((out / "model").resolve())
        (out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        trainer.metrics.write({"type": "event", "event": "done", **summary})
        acc.print(json.dumps(summary))
    trainer.metrics.close()
    acc.end_training()
    return summary


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
    """Mean next-token cross-entropy over labelled (assistant) positions."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    n = int((labels != IGNORE_INDEX).sum())
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss / max(1, n), n


def build_sft_rows(tokenizer, conversations, cfg: SFTConfig) -> dict[str, Any]:
    """Tokenise, split by content hash and pack; returns the train/val row tensors and skip counts."""
    train, val, skipped = [], [], Counter()
    for msgs in conversations:
        try:
            ex = encode_sft(tokenizer, msgs, cfg.seq_len)
        except ValueError as e:
            skipped[str(e)] += 1
            continue
        (val if is_held_out(json.dumps(msgs, sort_keys=True), cfg.val_fraction) else train).append(ex)
    if not train:
        raise ValueError(f"no SFT examples left after tokenisation (skipped {dict(skipped)})")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tr = pack_examples(train, cfg.seq_len, pad_id, cfg.pack, cfg.seed)
    va = pack_examples(val, cfg.seq_len, pad_id, cfg.pack, cfg.seed) if val else None
    return {"train": tr, "val": va, "skipped": skipped, "n_train": len(train), "n_val": len(val)}


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return stage_parser(MODULE, __doc__, {"--base": "base model folder (Hugging Face causal LM + tokenizer)",
                                          "--data": "SFT data (JSONL, .jsonl.gz or Parquet)"}).parse_args(argv)


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
    acc.print(f"SFT: {data['n_train']} conversations in {n_tr} rows of {cfg.seq_len}, {data['n_val']} held out; "
              f"skipped {dict(bad_rows + data['skipped'])}")
    trainer = Trainer(cfg, acc, model, out, batch_fn=sampler.batch, loss_fn=sft_loss,
                      eval_batches_fn=sampler.eval_batches if len(val_ids) else None)
    summary = trainer.fit()
    summary.update(stage="sft", base=str(Path(args.base).resolve()), data=str(Path(args.data).resolve()),
                   examples=data["n_train"], held_out=data["n_val"], rows=n_tr,
                   skipped=dict(bad_rows + data["skipped"]),
                   label_fraction=float((tr_labels != IGNORE_INDEX).float().mean()))
    return finish(acc, trainer, Path(args.base), out, summary)


if __name__ == "__main__":
    main(sys.argv[1:])
