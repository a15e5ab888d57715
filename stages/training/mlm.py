"""Masked language modelling: text -> a BERT encoder trained from scratch.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.mlm --data DIR_OR_TEXT_FILE --out OUT \\
        [--config mlm.yaml] [--max-steps N] [--set whole_word_masking=true --set preset=tiny ...]

``--data`` is a data-stage output folder or a plain text file. A tokenizer
(``tokenizer_type``: WordPiece by default, Unigram or byte-level BPE) with
``<|cls|>``, ``<|sep|>`` and ``<|mask|>`` is trained on it and the text packed
into ``OUT/data``, as in pretraining. A training row is ``<|cls|>`` + a window
of ``seq_len - 2`` tokens + ``<|sep|>`` (RoBERTa's full-sentence rows: documents
follow each other, separated by ``<|endoftext|>``; no next-sentence task).
Masking is BERT's (:func:`~crawl2chat.stages.training.masking.mask_tokens`):
``mlm_probability`` (15%) of the ordinary tokens are selected, of which 80% become
``<|mask|>``, 10% a random token and 10% stay; ``whole_word_masking`` selects
whole words. Masks are drawn anew for every batch from the batch index (dynamic
masking), so resuming is exact. Optimizer, schedule, checkpoints, resume and
rollback are the shared :class:`~crawl2chat.stages.training.trainer.Trainer`'s.

Outputs: ``OUT/model`` (``AutoModelForMaskedLM`` and ``AutoTokenizer`` load it),
``OUT/metrics.jsonl`` and ``OUT/metrics.json``: ``val_loss`` (cross-entropy on
the masked held-out tokens) and ``val_masked_accuracy``, beside
``initial_val_loss`` and ``initial_val_masked_accuracy`` of the untrained model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from crawl2chat.stages.training.encoders import (CorruptedWindows, LabelledLoss, bert_config, build,
                                                 prepare_on_host_for, run_encoder_stage)
from crawl2chat.stages.training.masking import mask_tokens, word_boundaries, word_ids
from crawl2chat.stages.training.settings import MLMConfig
from crawl2chat.stages.training.stage import run_script
from crawl2chat.stages.training.tokenizer import tokenizer_family


class MLMRows:
    """A window -> ``{input_ids, labels}``: ``<|cls|> window <|sep|>``, masked."""

    def __init__(self, tokenizer, cfg: MLMConfig, tokenizer_type: str):
        V = len(tokenizer)
        self.special = np.zeros(V, dtype=bool)
        self.special[list(tokenizer.added_tokens_decoder)] = True
        self.random_ids = np.flatnonzero(~self.special)
        self.cls, self.sep, self.mask = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.mask_token_id
        self.cfg = cfg
        self.starts = self.ends_space = None
        if cfg.whole_word_masking:
            self.starts, self.ends_space = word_boundaries(tokenizer.convert_ids_to_tokens(list(range(V))),
                                                           tokenizer_type)

    def __call__(self, window: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        c = self.cfg
        ids = np.concatenate([[self.cls], window, [self.sep]]).astype(np.int64)
        words = word_ids(ids, self.special, self.starts, self.ends_space) if c.whole_word_masking else None
        inputs, labels = mask_tokens(ids, rng, self.special, self.mask, self.random_ids, c.mlm_probability,
                                     c.mask_replace_prob, c.random_replace_prob, words)
        return {"input_ids": inputs, "labels": labels}


def mlm_logits(model, batch):
    return model(input_ids=batch["input_ids"]).logits


def setup(cfg: MLMConfig, tokenizer, tok_dir: Path, data_dir: Path):
    from transformers import AutoModelForMaskedLM

    if tokenizer.mask_token_id is None or tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError(f"tokenizer: {tok_dir} has no mask, cls or sep token; leave tokenizer unset to train one")
    rows = MLMRows(tokenizer, cfg, tokenizer_family(tok_dir))
    windows = CorruptedWindows(data_dir, cfg, cfg.seq_len - 2, rows)
    model = build(AutoModelForMaskedLM, bert_config(cfg.preset, len(tokenizer), cfg.seq_len, tokenizer.pad_token_id),
                  cfg.grad_checkpointing)
    return model, windows, LabelledLoss(mlm_logits, "val_masked_accuracy"), {
        "whole_word_masking": cfg.whole_word_masking, "mlm_probability": cfg.mlm_probability}


def main(argv: list[str] | None = None) -> dict:
    return run_encoder_stage("mlm", MLMConfig, argv, __doc__, setup)


def prepare_on_host(argv: list[str]) -> None:
    prepare_on_host_for("mlm", MLMConfig, __doc__, argv)


if __name__ == "__main__":
    run_script(main)
