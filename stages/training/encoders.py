"""What the encoder objectives share: model presets, data preparation, corrupted
windows addressed by batch index, held-out accuracy, and the run itself.

Two stages build on it: :mod:`~crawl2chat.stages.training.mlm` (a BERT encoder
trained by masked language modelling) and :mod:`~crawl2chat.stages.training.span`
(a T5 encoder-decoder trained by span corruption). Both read the data the way
pretraining does: a data-stage folder or a plain text file, tokenised by a
tokenizer trained on it (WordPiece, Unigram or byte-level BPE, with the
objective's special tokens) and packed into ``OUT/data`` by
:func:`~crawl2chat.stages.training.packing.pack_shards` (the same id-hash
held-out split). A training row is a window of the packed stream at an offset
drawn from a generator seeded with ``(seed, batch index, row)``, corrupted with
a generator of the same seed, so a batch is a pure function of its global index
and a resumed run sees exactly the batches an uninterrupted one would.
Held-out rows are the consecutive windows of ``val.bin``, corrupted the same
way at every evaluation, so their loss is comparable from step to step; the
model is evaluated once before the first step as well, so the summary says
what training bought (``initial_val_loss`` against ``val_loss``).

Models are ``transformers`` configs built from scratch (nothing is
downloaded); the saved folder loads with ``AutoModelForMaskedLM`` or
``AutoModelForSeq2SeqLM`` and ``AutoTokenizer``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crawl2chat.stages.training.packing import INDEX, load_index, open_tokens, pack_shards
from crawl2chat.stages.training.settings import EncoderPretrainConfig, SpanConfig
from crawl2chat.stages.training.tokenizer import (MLM_TOKENS, check_tokenizer, load_tokenizer, sentinel,
                                                  tokenizer_family, train_tokenizer)

# name -> (layers, width, heads, ffn width); T5 uses the same numbers for encoder and decoder.
ENCODER_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 64, 4, 192),  # tests: trains in seconds on one CPU core
    "cpu-small": (4, 128, 4, 512),
    "cpu": (6, 256, 8, 1024),
    "base": (12, 768, 12, 3072),  # BERT-base / T5-base shape
}

# ---------------------------------------------------------------- models


def bert_config(preset: str, vocab_size: int, seq_len: int, pad_token_id: int):
    """A BERT encoder with a masked-LM head (tied to the input embeddings)."""
    from transformers import BertConfig

    layers, width, heads, ffn = ENCODER_PRESETS[preset]
    return BertConfig(vocab_size=vocab_size, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=ffn, max_position_embeddings=seq_len, type_vocab_size=1,
                      pad_token_id=pad_token_id, tie_word_embeddings=True)


def t5_config(preset: str, vocab_size: int, pad_token_id: int, eos_token_id: int):
    """A T5 v1.1-style encoder-decoder (gated GELU, untied output layer)."""
    from transformers import T5Config

    layers, width, heads, ffn = ENCODER_PRESETS[preset]
    return T5Config(vocab_size=vocab_size, d_model=width, d_kv=width // heads, d_ff=ffn, num_layers=layers,
                    num_decoder_layers=layers, num_heads=heads, feed_forward_proj="gated-gelu",
                    tie_word_embeddings=False, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                    decoder_start_token_id=pad_token_id)


def build(auto_cls, config, grad_checkpointing: bool):
    """A freshly initialised model of ``config`` through ``auto_cls`` (``from_config``)."""
    model = auto_cls.from_config(config)
    if grad_checkpointing:
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.config.use_cache = False
    return model


# ---------------------------------------------------------------- data


def required_tokens(cfg: EncoderPretrainConfig, objective: str) -> list[str]:
    if objective == "mlm":
        return list(MLM_TOKENS)
    from crawl2chat.stages.training.masking import span_counts

    if isinstance(cfg, SpanConfig):  # as many sentinels as a row has spans
        return [sentinel(i) for i in range(span_counts(cfg.seq_len, cfg.noise_density, cfg.mean_span_length)[1])]
    return []


def prepare_data(cfg: EncoderPretrainConfig, data: str | os.PathLike, out: str | os.PathLike,
                 objective: str) -> tuple[Path, Path]:
    """Tokenizer (trained for ``objective``, or the given one, checked) and packed tokens
    under ``out``; each step is skipped when its output is already complete."""
    out = Path(out)
    if not Path(data).exists():
        raise FileNotFoundError(f"--data {data}: no such file or folder")
    if cfg.tokenizer:
        tok_dir = Path(cfg.tokenizer)
        check_tokenizer(tok_dir, cfg.tokenizer_type, required_tokens(cfg, objective))
    else:
        tok_dir = out / "tokenizer"
        if not (tok_dir / "tokenizer.json").exists():
            tmp = out / "tokenizer.tmp"
            train_tokenizer(data, tmp, vocab_size=cfg.vocab_size, max_docs=cfg.tokenizer_max_docs,
                            tokenizer_type=cfg.tokenizer_type, objective=objective,
                            num_sentinels=cfg.num_sentinels if objective == "span" else 0)
            if tok_dir.exists():
                import shutil

                shutil.rmtree(tok_dir)
            os.replace(tmp, tok_dir)
    data_dir = out / "data"
    if not (data_dir / INDEX).exists():
        pack_shards(data, tok_dir, data_dir, val_fraction=cfg.val_fraction)
    return tok_dir, data_dir


class CorruptedWindows:
    """Micro-batches of corrupted windows of the packed tokens.

    ``corrupt(window, rng)`` turns a window of ``window_len`` tokens into the
    row's arrays (all rows of a batch the same length). Training row ``g`` of
    global batch ``i`` uses the generator ``(seed, 0, i, g)`` for both its offset
    and its corruption; the global batch's rows are dealt to (micro step, rank)
    pairs as in pretraining, so the data does not depend on the process layout.
    Held-out window ``j`` (consecutive from the start of ``val.bin``) uses
    ``(seed, 1, j)``. With ``with_offsets`` a training batch also carries each
    window's offset in ``train.bin`` (``text_ids``), which tells overlapping windows apart."""

    def __init__(self, data_dir: Path, cfg: EncoderPretrainConfig, window_len: int,
                 corrupt: Callable[[np.ndarray, np.random.Generator], dict[str, np.ndarray]],
                 with_offsets: bool = False):
        self.train, self.val = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        self.cfg, self.window_len, self.corrupt = cfg, window_len, corrupt
        self.with_offsets = with_offsets
        if len(self.train) <= window_len:
            source = load_index(data_dir).get("source", data_dir)
            raise ValueError(f"the training split of {source} has {len(self.train)} tokens; seq_len={cfg.seq_len} "
                             f"needs more (add data or lower seq_len)")
        if len(self.val) < 16:
            raise ValueError(f"held-out split has {len(self.val)} tokens, too few to evaluate; raise val_fraction")

    @staticmethod
    def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}

    def batch(self, batch_index: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        c = self.cfg
        first = (micro * world + rank) * c.micro_batch_size
        rows = []
        for g in range(first, first + c.micro_batch_size):
            rng = np.random.default_rng([c.seed, 0, batch_index, g])
            start = int(rng.integers(0, len(self.train) - self.window_len))
            row = self.corrupt(np.asarray(self.train[start:start + self.window_len], dtype=np.int64), rng)
            if self.with_offsets:
                row["text_ids"] = np.int64(start)
            rows.append(row)
        return self._stack(rows)

    def eval_batches(self, rank: int, world: int) -> Iterator[dict[str, torch.Tensor]]:
        c, L = self.cfg, self.window_len
        n_windows = min(c.eval_batches * c.micro_batch_size, len(self.val) // L)
        if n_windows == 0:  # held-out text shorter than one window: evaluate what there is, as one row
            if rank == 0:
                yield self._stack([self.corrupt(np.asarray(self.val, dtype=np.int64), np.random.default_rng(
                    [c.seed, 1, 0]))])
            return
        mine = list(range(rank, n_windows, world))
        for i in range(0, len(mine), c.micro_batch_size):
            yield self._stack([self.corrupt(np.asarray(self.val[j * L:(j + 1) * L], dtype=np.int64),
                                            np.random.default_rng([c.seed, 1, j]))
                               for j in mine[i:i + c.micro_batch_size]])


class LabelledLoss:
    """Mean cross-entropy over labelled positions (``labels != -100``); during
    evaluation (the model in eval mode) it also counts correct arg-max predictions,
    which :meth:`eval_extra` turns into the held-out accuracy (summed over ranks)."""

    def __init__(self, logits_fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor], accuracy_key: str):
        self.logits_fn, self.key = logits_fn, accuracy_key
        self.correct, self.total = 0, 0
        self.acc = None  # the accelerator, for the cross-rank sum

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        import torch.nn.functional as F

        logits = self.logits_fn(model, batch).float()
        labels = batch["labels"]
        keep = labels != -100
        n = int(keep.sum())
        loss = F.cross_entropy(logits[keep], labels[keep], reduction="sum") / max(1, n)
        if not model.training:
            self.correct += int((logits[keep].argmax(-1) == labels[keep]).sum())
            self.total += n
        return loss, n

    def eval_extra(self, val_loss: float) -> dict[str, float]:  # noqa: ARG002 - the Trainer's hook signature
        counts = torch.tensor([self.correct, self.total], dtype=torch.float64, device=self.acc.device)
        counts = self.acc.reduce(counts, "sum")
        self.correct, self.total = 0, 0
        return {self.key: float(counts[0] / counts[1].clamp(min=1))}


# ---------------------------------------------------------------- the run


def run_encoder_stage(name: str, config_cls, argv: list[str] | None, doc: str,
                      setup: Callable[[Any, Any, Path, Path], tuple[Any, CorruptedWindows, LabelledLoss, dict]]) -> dict:
    """The common body of the ``mlm`` and ``span`` scripts. ``setup(cfg, tokenizer,
    tok_dir, data_dir)`` returns the model, the windows, the loss and summary fields."""

    from crawl2chat.stages.training.stage import (finish, finished_summary, prepare_out, resolve, stage_parser)
    from crawl2chat.stages.training.trainer import Trainer, latest_checkpoint, make_accelerator, read_metrics
    from crawl2chat.stages.training.models import num_params

    args = stage_parser(name, doc).parse_args(argv)
    cfg = resolve(config_cls, args)
    out = Path(args.out)
    done = finished_summary(out, cfg.max_steps)
    if done is not None:
        print(f"{out} already finished {done['steps']} steps; model in {out / 'model'}")
        return done
    acc = make_accelerator(cfg)
    prepare_out(acc, cfg, out)
    if acc.is_main_process:
        prepare_data(cfg, args.data, out, name)  # already done when prepare_on_host ran
    acc.wait_for_everyone()
    tok_dir = Path(cfg.tokenizer) if cfg.tokenizer else out / "tokenizer"
    tokenizer = load_tokenizer(tok_dir)
    model, windows, loss, extra = setup(cfg, tokenizer, tok_dir, out / "data")
    loss.acc = acc
    index = load_index(out / "data")
    acc.print(f"{name} {cfg.preset}: {num_params(model) / 1e6:.2f}M parameters, {tokenizer_family(tok_dir)} vocab "
              f"{len(tokenizer)}, {index['train']['tokens']:,} training tokens, {index['val']['tokens']:,} held out")
    trainer = Trainer(cfg, acc, model, out, batch_fn=windows.batch, loss_fn=loss,
                      eval_batches_fn=windows.eval_batches, eval_extra=loss.eval_extra)
    if latest_checkpoint(out / "checkpoints") is None:
        trainer.evaluate()  # the untrained model's held-out figures (an eval record at step 0)
    summary = trainer.fit()
    initial = next((r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval" and r["step"] == 0), {})
    summary.update({f"initial_{k}": v for k, v in initial.items() if k.startswith("val_")})
    summary.update(stage=name, preset=cfg.preset, params=num_params(model), vocab_size=len(tokenizer),
                   tokenizer_type=tokenizer_family(tok_dir), tokenizer=str(tok_dir.resolve()),
                   data=str(Path(args.data).resolve()), data_index=str((out / "data" / INDEX).resolve()), **extra)
    # The split its held-out text came from goes with the model: an evaluation or a
    # contrastive run starting from it keeps that text unseen.
    return finish(acc, trainer, tok_dir, out, summary, split=index.get("split"))


def prepare_on_host_for(name: str, config_cls, doc: str, argv: list[str]) -> None:
    """Tokenizer and packed tokens before the launch, on the host where Ray runs."""
    from crawl2chat.stages.training.stage import resolve, stage_parser

    args: argparse.Namespace = stage_parser(name, doc).parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prepare_data(resolve(config_cls, args), args.data, args.out, name)
