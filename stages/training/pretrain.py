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
``val_loss``, ``val_bpb``, ``tokens_per_second``, ``steps``, ``sampling``, per
language (or source) ``share.<g>.target`` / ``share.<g>.realised`` /
``share.<g>.natural``, and ``split``, the held-out split, which is also written to
``OUT/model/held_out_split.json`` for every later stage and evaluation).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.models import build_model, flops_per_token, model_config, num_params
from crawl2chat.stages.training.pipeline import whole_model
from crawl2chat.stages.training.packing import INDEX, load_documents, load_index, open_tokens, pack_shards
from crawl2chat.stages.training.tokenizer import check_tokenizer, load_tokenizer, train_tokenizer
from crawl2chat.stages.training.stage import (finished_summary, resolve, run_script, save_model, stage_parser,
                                              write_settings)
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

    Every global batch is a pure function of ``(seed, global batch index)``: its
    rows are drawn from a generator seeded with both and dealt to (micro step,
    rank) pairs, so the same global batch is seen whatever the number of
    processes or accumulation steps, and a resumed run reads what an
    uninterrupted one would.

    * ``weighted`` (``sample_by_weight`` on data the data stage weighted): a row
      is a stretch of an endless stream of documents drawn with probability
      proportional to their ``sample_weight``; it starts inside a document drawn
      by weight x length (where a uniformly random token of that stream lies), at
      a uniform offset, and continues with further documents drawn by weight.
      Each group's (language's or source's) expected token share is then exactly
      ``sum(weight x tokens) over its documents / the same over all`` -- the
      balance target. (The data stage computes the weights on bytes, so in bytes
      this is exactly its target mixture; a language that costs more tokens per
      byte gets a proportionally larger token share.)
    * ``uniform``: windows at uniformly random offsets of ``train.bin`` (the
      corpus's natural mixture).

    Validation uses consecutive non-overlapping windows from the start of ``val.bin``."""

    # Realised shares are counted over at most this many rows (evenly spaced batches beyond).
    MAX_COUNTED_ROWS = 200_000

    def __init__(self, data_dir: Path, cfg: PretrainConfig):
        self.train, self.val = open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
        self.cfg = cfg
        index = load_index(data_dir)
        if len(self.train) <= cfg.seq_len + 1:
            raise ValueError(f"the training split of {index.get('source', data_dir)} has {len(self.train)} tokens; "
                             f"seq_len={cfg.seq_len} needs more (add data or lower seq_len)")
        docs = load_documents(data_dir, "train")
        if docs is None or not len(docs["offset"]):  # a packing from before documents were recorded
            docs = {"offset": np.zeros(1, np.int64), "tokens": np.array([len(self.train)]),
                    "weight": np.ones(1), "group": np.array(["unknown"], dtype=object)}
        self.offset = docs["offset"].astype(np.int64)
        self.length = docs["tokens"].astype(np.int64)
        self.weight = docs["weight"].astype(np.float64)
        self.group_names, self.group_code = np.unique(docs["group"].astype(str), return_inverse=True)
        origin = (index.get("weights") or {}).get("origin", "none: the packing records no weights")
        self.weighted = cfg.sample_by_weight and origin == "sample_weight"
        self.sampling = "weighted" if self.weighted else "uniform"
        self.sampling_reason = (
            "sample_weight of the data stage" if self.weighted
            else "sample_by_weight is off" if not cfg.sample_by_weight else f"no weights ({origin})")
        self._cdf_mass = np.cumsum(self.weight * self.length)  # first document of a row
        self._cdf_weight = np.cumsum(self.weight)  # the documents that follow it
        self._chunk = max(2, int(math.ceil((cfg.seq_len + 1) / max(1.0, float(self.length.mean())))) + 1)
        self._cached: tuple[int, list] | None = None

    def _global_rows(self, world: int) -> int:
        return self.cfg.micro_batch_size * self.cfg.grad_accum * world

    def plan(self, batch_index: int, world: int = 1) -> list[list[tuple[int, int, int]]]:
        """The rows of global batch ``batch_index`` as (document, start in train.bin, length) segments."""
        if self._cached and self._cached[0] == (batch_index, world):
            return self._cached[1]
        c, T = self.cfg, self.cfg.seq_len + 1
        rows_n = self._global_rows(world)
        rng = np.random.default_rng([c.seed, batch_index])
        rows: list[list[tuple[int, int, int]]] = []
        if not self.weighted:
            for s in rng.integers(0, len(self.train) - c.seq_len - 1, size=rows_n):
                d, pos, need, segs = int(np.searchsorted(self.offset, s, side="right")) - 1, int(s), T, []
                while need > 0:
                    take = min(int(self.offset[d] + self.length[d]) - pos, need)
                    segs.append((d, pos, take))
                    need, pos, d = need - take, pos + take, d + 1
                rows.append(segs)
        else:
            n = len(self.length)
            first = np.minimum(np.searchsorted(self._cdf_mass, rng.random(rows_n) * self._cdf_mass[-1], "right"), n - 1)
            inside = np.minimum((rng.random(rows_n) * self.length[first]).astype(np.int64), self.length[first] - 1)
            needs = []
            for d, u in zip(first.tolist(), inside.tolist()):
                take = min(int(self.length[d]) - u, T)
                rows.append([(d, int(self.offset[d]) + u, take)])
                needs.append(T - take)
            while True:
                open_rows = [r for r in range(rows_n) if needs[r] > 0]
                if not open_rows:
                    break
                u = rng.random((len(open_rows), self._chunk)) * self._cdf_weight[-1]
                draws = np.minimum(np.searchsorted(self._cdf_weight, u, "right"), n - 1)
                for r, ds in zip(open_rows, draws.tolist()):
                    for d in ds:
                        if needs[r] <= 0:
                            break
                        take = min(int(self.length[d]), needs[r])
                        rows[r].append((d, int(self.offset[d]), take))
                        needs[r] -= take
        self._cached = ((batch_index, world), rows)
        return rows

    def _rows(self, tokens: np.ndarray, starts) -> torch.Tensor:
        T = self.cfg.seq_len + 1
        return torch.from_numpy(np.stack([tokens[s:s + T].astype(np.int64) for s in starts]))

    def batch(self, batch_index: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
        c = self.cfg
        rows = self.plan(batch_index, world)
        first = (micro * world + rank) * c.micro_batch_size
        mine = rows[first:first + c.micro_batch_size]
        return {"tokens": torch.from_numpy(np.stack([
            np.concatenate([self.train[a:a + n] for _, a, n in segs]).astype(np.int64) for segs in mine]))}

    def shares(self, n_batches: int, world: int = 1) -> dict[str, float]:
        """Per group: ``share.<g>.target`` (what the weights give), ``share.<g>.natural``
        (the corpus as packed) and ``share.<g>.realised`` (tokens of the first
        ``n_batches`` global batches, counted from their plans)."""
        counts = np.zeros(len(self.group_names), dtype=np.float64)
        per_batch = self._global_rows(world)
        batches = range(n_batches)
        if n_batches * per_batch > self.MAX_COUNTED_ROWS:
            batches = np.linspace(0, n_batches - 1, max(1, self.MAX_COUNTED_ROWS // per_batch)).astype(int).tolist()
        for b in batches:
            for segs in self.plan(b, world):
                for d, _, n in segs:
                    counts[self.group_code[d]] += n
        self._cached = None
        mass = np.bincount(self.group_code, weights=self.weight * self.length, minlength=len(self.group_names))
        natural = np.bincount(self.group_code, weights=self.length, minlength=len(self.group_names))
        out: dict[str, float] = {}
        for i, g in enumerate(self.group_names):
            key = re.sub(r"[^A-Za-z0-9_\-/ ]", "_", str(g))
            out[f"share.{key}.target"] = float(mass[i] / mass.sum())
            out[f"share.{key}.natural"] = float(natural[i] / natural.sum())
            if counts.sum():
                out[f"share.{key}.realised"] = float(counts[i] / counts.sum())
        return out

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
        write_settings(cfg, out)
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
    targets = {k.split(".")[1]: v for k, v in windows.shares(0).items() if k.endswith(".target")}
    acc.print(f"sampling: {windows.sampling} ({windows.sampling_reason}); target token shares "
              + ", ".join(f"{g} {v:.3f}" for g, v in sorted(targets.items(), key=lambda kv: -kv[1])[:8])
              + f"; held out: {index['split']['name'] if index.get('split') else 'none recorded'}")
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
        # Under pipeline parallelism each rank holds its stage only: the gathered stages make one model.
        whole = whole_model(mconf, state_dict) if trainer.pipeline is not None else acc.unwrap_model(trainer.model)
        save_model(whole, state_dict, tok_dir, out / "model", split=index.get("split"))
        # What the batches held: each group's token share next to the share its weights give.
        summary.update(sampling=windows.sampling, **windows.shares(trainer.state.batch_index, trainer.dp_world))
        if index.get("split"):
            summary.update(split=index["split"]["name"], split_val_fraction=index["split"]["val_fraction"])
        # The same validation tokens the model was scored on (the targets of its windows).
        scored = windows.val[1:1 + max(1, windows.eval_tokens())]
        summary["unigram_bpb"] = unigram_bpb(windows.train, scored, mconf.vocab_size, tokens_per_byte)
        summary.update(preset=cfg.preset, params=num_params(whole), vocab_size=mconf.vocab_size,
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
