"""Span corruption: text -> a T5 encoder-decoder trained from scratch.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.span --data DIR_OR_TEXT_FILE --out OUT \\
        [--config span.yaml] [--max-steps N] [--set preset=tiny --set noise_density=0.15 ...]

``--data`` is a data-stage output folder or a plain text file. A tokenizer
(``tokenizer_type``: Unigram by default, as SentencePiece in T5; WordPiece or
byte-level BPE) with ``num_sentinels`` sentinel tokens ``<extra_id_0>``, ... is
trained on it and the text packed into ``OUT/data``, as in pretraining. A
training row is a window of ``seq_len`` tokens corrupted as in T5
(:func:`~crawl2chat.stages.training.masking.random_spans_noise_mask`):
``noise_density`` (15%) of its tokens in spans of mean length
``mean_span_length`` (3) are each replaced by one sentinel in the encoder input;
the decoder's target is each sentinel followed by the span it replaced; both end
with ``<|endoftext|>``. Every row of a given ``seq_len`` has the same input and
target lengths, so nothing is padded. The corruption is drawn from the batch
index, so resuming is exact. Optimizer, schedule, checkpoints, resume and
rollback are the shared :class:`~crawl2chat.stages.training.trainer.Trainer`'s.

Outputs: ``OUT/model`` (``AutoModelForSeq2SeqLM`` and ``AutoTokenizer`` load
it), ``OUT/metrics.jsonl`` and ``OUT/metrics.json``: ``val_loss`` (cross-entropy
per target token on held-out windows) and ``val_token_accuracy``, beside
``initial_val_loss`` and ``initial_val_token_accuracy`` of the untrained model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from crawl2chat.stages.training.encoders import (CorruptedWindows, LabelledLoss, build, prepare_on_host_for,
                                                 run_encoder_stage, t5_config)
from crawl2chat.stages.training.masking import corrupt_spans, random_spans_noise_mask, span_counts
from crawl2chat.stages.training.settings import SpanConfig
from crawl2chat.stages.training.stage import run_script
from crawl2chat.stages.training.tokenizer import sentinel


class SpanRows:
    """A window -> ``{input_ids, labels}``: the corrupted input and the sentinel-delimited target."""

    def __init__(self, tokenizer, cfg: SpanConfig, sentinel_ids: list[int]):
        self.cfg, self.sentinels, self.eos = cfg, sentinel_ids, tokenizer.eos_token_id

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        noise = random_spans_noise_mask(len(window), self.cfg.noise_density, self.cfg.mean_span_length, rng)
        inputs, targets = corrupt_spans(window, noise, self.sentinels, self.eos)
        return {"input_ids": inputs, "labels": targets}


def span_logits(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).logits


def sentinel_ids(tokenizer, tok_dir: Path, needed: int) -> list[int]:
    ids = []
    for i in range(needed):
        t = tokenizer.convert_tokens_to_ids(sentinel(i))
        if t is None or t == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer: {tok_dir} has {i} sentinel tokens but a row needs {needed}; "
                             f"leave tokenizer unset to train one with num_sentinels sentinels")
        ids.append(t)
    return ids


def setup(cfg: SpanConfig, tokenizer, tok_dir: Path, data_dir: Path):
    from transformers import AutoModelForSeq2SeqLM

    noise, spans = span_counts(cfg.seq_len, cfg.noise_density, cfg.mean_span_length)
    rows = SpanRows(tokenizer, cfg, sentinel_ids(tokenizer, tok_dir, spans))
    windows = CorruptedWindows(data_dir, cfg, cfg.seq_len, rows)
    model = build(AutoModelForSeq2SeqLM, t5_config(cfg.preset, len(tokenizer), tokenizer.pad_token_id,
                                                   tokenizer.eos_token_id), cfg.grad_checkpointing)
    return model, windows, LabelledLoss(span_logits, "val_token_accuracy"), {
        "noise_tokens_per_row": noise, "spans_per_row": spans, "input_len": cfg.seq_len - noise + spans + 1,
        "target_len": noise + spans + 1}


def main(argv: list[str] | None = None) -> dict:
    return run_encoder_stage("span", SpanConfig, argv, __doc__, setup)


def prepare_on_host(argv: list[str]) -> None:
    prepare_on_host_for("span", SpanConfig, __doc__, argv)


if __name__ == "__main__":
    run_script(main)
