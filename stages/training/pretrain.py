"""Pretraining entry point: packed tokens -> a Hugging Face causal LM.

Run under accelerate (one process, DDP or FSDP; see ``infra/accelerate/``)::

    accelerate launch -m crawl2chat.stages.training.pretrain --data DIR_OR_TEXT_FILE --out OUT \\
        [--config run.yaml] [--max-steps N] [--set preset=cpu --set lr=3e-4 ...]

``--data`` is a data-stage output folder (``DIR/shards/*.parquet`` with a
``text`` column) or a plain text file. Missing preparation is done first and
kept in ``OUT`` (``OUT/tokenizer``, ``OUT/data``), so re-running the same
command resumes from the newest checkpoint in ``OUT/checkpoints``.

Outputs: ``OUT/model`` (``config.json``, ``model.safetensors``, tokenizer
files; ``AutoModelForCausalLM.from_pretrained`` loads it), ``OUT/metrics.jsonl``
(a line per step, evaluation and event) and ``OUT/metrics.json`` (summary:
``val_loss``, ``val_bpb``, ``tokens_per_second``, ``steps``, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

from crawl2chat.stages.training.models import build_model, flops_per_token, model_config, num_params
from crawl2chat.stages.training.packing import INDEX, load_index, open_tokens, pack_shards
from crawl2chat.stages.training.tokenizer import check_tokenizer, load_tokenizer, train_tokenizer
from crawl2chat.stages.training.stage import finished_summary, resolve, run_script, save_model, stage_parser
from crawl2chat.stages.training.trainer import Trainer, make_accelerator
from crawl2chat.stages.training.settings import PretrainConfig

# ---------------------------------------------------------------- data


def prepare_data(cfg: PretrainConfig, data: str | os.PathLike, out: str | os.PathLike) -> tuple[Path, Path]:
    """Tokenizer and packed tokens for ``data`` under ``out``; each step is skipped when
    its output is already complete, so preparation is idempotent."""
    out = Path(out)
    tok_dir = Path(cfg.tokenizer) if cfg.tokenizer else out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(data, tok_dir, vocab_size=cfg.vocab_size, max_docs=cfg.tokenizer_max_docs,
                        tokenizer_type=cfg.tokenizer_type)
    elif cfg.tokenizer:
        check_tokenizer(tok_dir, cfg.tokenizer_type)
    data_dir = out / "data"
    if not (data_dir / INDEX).exists():
        pack_shards(data, tok_dir, data_dir, val_fraction=cfg.val_fraction)
    return tok_dir, data_dir


class TokenWindows:
    """Micro-batches of (seq_len + 1)-token windows from the packed files.

    Training windows start at random offsets drawn from a generator seeded
    with ``(seed, global batch index)``; the global batch's rows are dealt to
    (micro step, rank) pairs, so the same global batch is seen whatever the
    number of processes or accumulation steps. Validation uses consecutive
    non-overlapping windows from the start of ``val.bin``."""

    def __init__(self, data_dir: Path, cfg: PretrainConfig):
        self.train, self.val = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        self.cfg = cfg
        if len(self.train) <= cfg.seq_len + 1:
            raise ValueError(f"training split has {len(self.train)} tokens; need more than seq_len + 1")

    def _rows(self, tokens: np.ndarray, starts) -> torch.Tensor:
        T = self.cfg.seq_len + 1
        return torch.from_numpy(np.stack([tokens[s:s + T].astype(np.int64) for s in starts]))

    def batch(self, batch_index: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        c = self.cfg
        global_rows = c.micro_batch_size * c.grad_accum * world
        rng = np.random.default_rng([c.seed, batch_index])
        starts = rng.integers(0, len(self.train) - c.seq_len - 1, size=global_rows)
        first = (micro * world + rank) * c.micro_batch_size
        return {"tokens": self._rows(self.train, starts[first:first + c.micro_batch_size])}

    def eval_windows(self) -> int:
        c = self.cfg
        return min(c.eval_batches * c.micro_batch_size, (len(self.val) - 1) // c.seq_len)

    def eval_tokens(self) -> int:
        """Validation tokens the evaluation scores (the targets of its windows)."""
        return self.eval_windows() * self.cfg.seq_len or len(self.val) - 1

    def eval_batches(self, rank: int, world: int):
        c = self.cfg
        n_windows = self.eval_windows()
        if n_windows == 0:  # validation shorter than one window: evaluate what there is
            yield {"tokens": torch.from_numpy(self.val.astype(np.int64))[None]}
            return
        mine = list(range(rank, n_windows, world))
        for i in range(0, len(mine), c.micro_batch_size):
            yield {"tokens": self._rows(self.val, [j * c.seq_len for j in mine[i:i + c.micro_batch_size]])}


def unigram_bpb(train: np.ndarray, val: np.ndarray, vocab_size: int, tokens_per_byte: float) -> float:
    """Bits per byte of ``val`` under the training split's unigram distribution
    (add-one smoothed): the baseline a language model has to beat."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    return float(-logp[np.asarray(val, dtype=np.int64)].mean() * tokens_per_byte)


def causal_lm_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    tokens = batch["tokens"]
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(input_ids=x, use_cache=False).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    return loss, y.numel()


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return stage_parser("pretrain", __doc__).parse_args(argv)


def prepare_on_host(argv: list[str]) -> None:
    """Tokenizer and packed tokens before the launch, on the host where Ray runs
    (the distributed job then finds them done)."""
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prepare_data(resolve(PretrainConfig, args), args.data, args.out)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = resolve(PretrainConfig, args)
    out = Path(args.out)
    done = finished_summary(out, cfg.max_steps)
    if done is not None:  # re-running a finished run is a no-op
        print(f"{out} already finished {done['steps']} steps; model in {out / 'model'}")
        return done
    acc = make_accelerator(cfg)

    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        prepare_data(cfg, args.data, out)  # already done when prepare_on_host ran
    acc.wait_for_everyone()
    tok_dir, data_dir = Path(cfg.tokenizer) if cfg.tokenizer else out / "tokenizer", out / "data"
    index = load_index(data_dir)
    tokenizer = load_tokenizer(tok_dir)

    mconf = model_config(cfg.preset, vocab_size=len(tokenizer), seq_len=cfg.seq_len,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = build_model(mconf, grad_checkpointing=cfg.grad_checkpointing)
    acc.print(f"{cfg.preset}: {num_params(model) / 1e6:.2f}M parameters, vocab {mconf.vocab_size}, "
              f"{index['train']['tokens']:,} training tokens, {acc.num_processes} process(es) on {acc.device}, "
              f"mixed precision {acc.mixed_precision}")

    windows = TokenWindows(data_dir, cfg)
    tokens_per_byte = index["val"]["tokens"] / max(1, index["val"]["bytes"])
    trainer = Trainer(
        cfg, acc, model, out,
        batch_fn=windows.batch, loss_fn=causal_lm_loss, eval_batches_fn=windows.eval_batches,
        flops_per_token=flops_per_token(mconf, cfg.seq_len),
        # nats per token -> bits per UTF-8 byte of the validation text
        eval_extra=lambda loss: {"val_bpb": loss * tokens_per_byte / math.log(2)},
    )
    summary = trainer.fit()

    acc.wait_for_everyone()
    state_dict = acc.get_state_dict(trainer.model)
    if acc.is_main_process:
        save_model(acc.unwrap_model(trainer.model), state_dict, tok_dir, out / "model")
        # The same validation tokens the model was scored on (the targets of its windows).
        scored = windows.val[1:1 + max(1, windows.eval_tokens())]
        summary["unigram_bpb"] = unigram_bpb(windows.train, scored, mconf.vocab_size, tokens_per_byte)
        summary.update(preset=cfg.preset, params=num_params(model), vocab_size=mconf.vocab_size,
                       tokenizer=str(tok_dir.resolve()), data=str(Path(args.data).resolve()),
                       data_index=str((data_dir / INDEX).resolve()), model_dir=str((out / "model").resolve()))
        (out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        trainer.metrics.write({"type": "event", "event": "done", **summary})
        acc.print(json.dumps(summary))
    trainer.metrics.close()
    acc.end_training()
    return summary


if __name__ == "__main__":
    run_script(main)
