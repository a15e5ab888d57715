"""Settings and specs of the tiny runs the fault tests kill (shared by their fixtures and tests)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

WORDS = ("the king queen night day sword crown river stone bright dark speak answer gentle noble "
         "fool heart blood honour tomorrow love death war peace lord lady").split()

# A tiny model, 32-token windows, a checkpoint every 10 of 40 steps.
PRETRAIN = ["preset=tiny", "seq_len=32", "micro_batch_size=4", "lr=3e-3", "min_lr=3e-4", "warmup_steps=5",
            "eval_batches=2", "val_fraction=0.1", "eval_every=0", "checkpoint_every=10", "keep_checkpoints=2"]
PRETRAIN_STEPS = 40
SFT = ["seq_len=64", "micro_batch_size=4", "lr=1e-3", "min_lr=1e-4", "warmup_steps=2", "eval_every=0",
       "eval_batches=2", "checkpoint_every=10", "keep_checkpoints=2"]
SFT_STEPS = 30


def text_lines(n_lines: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


def pretrain_spec(corpus: dict, out: Path) -> dict:
    return {"stage": "pretrain", "inputs": {"data": corpus["text"]}, "out": str(out), "max_steps": PRETRAIN_STEPS,
            "overrides": [*PRETRAIN, f"tokenizer={corpus['tokenizer']}"]}


def sft_spec(corpus: dict, base: Path, out: Path) -> dict:
    return {"stage": "sft", "inputs": {"base": str(base), "data": corpus["sft"]}, "out": str(out),
            "max_steps": SFT_STEPS, "overrides": SFT}


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst
