"""The fastText quality classifier: trained from example files, or any published one.

Training writes the user's positive and negative examples as a fastText training
file (``__label__hq <text>`` / ``__label__lq <text>``, labels configurable) and
runs the real ``fasttext.train_supervised`` on it: hashed word n-grams and
character n-grams (subwords) feeding a linear classifier. The result is saved as
a standard fastText ``.bin``, which ``fasttext.load_model`` and the ``fasttext``
command line read, so it can be handed to other tools; and the filter loads any
fastText classifier (``.bin`` or ``.ftz``, e.g. the ones DCLM-style pipelines
publish), keeping the probability of the configured label as ``quality_score``.

Text is turned into one line the same way for training and filtering
(:func:`crawl2chat.stages.data.fasttext_models.to_line`, the ``preprocess``
setting), so Chinese and Japanese documents are split into characters and
punctuation runs count as tokens when the model is trained here.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import fsspec
import pyarrow.parquet as pq

from crawl2chat.stages.data import fasttext_models
from crawl2chat.stages.data.base import Block, Document
from crawl2chat.stages.data.settings import QualityClassifierConfig

MODEL_SETTING = "data.quality.classifier.model"


# ---------------------------------------------------------------------------
# Reading example files


def _open_text(path: str):
    return fsspec.open(path, "rt", encoding="utf-8", errors="replace", compression="infer").open()


def _iter_jsonl(path: str, text_field: str, skipped: Counter) -> Iterator[str]:
    with _open_text(path) as f:
        for line in f:
            if not line.strip():
                skipped["empty"] += 1
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped["malformed_json"] += 1
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                skipped["missing_text"] += 1
                continue
            yield text


def _iter_txt(path: str, skipped: Counter) -> Iterator[str]:
    with _open_text(path) as f:
        for line in f:
            yield line.rstrip("\n")


def _iter_parquet(path: str, text_field: str, skipped: Counter) -> Iterator[str]:
    with fsspec.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        if text_field not in parquet.schema_arrow.names:
            raise ValueError(f"{path}: no `{text_field}` column (columns: {parquet.schema_arrow.names})")
        for batch in parquet.iter_batches(columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    skipped["missing_text"] += 1
                    continue
                yield text


def read_examples(paths: Iterable[str], text_field: str, skipped: Counter) -> list[str]:
    """Non-empty texts from example files; bad or empty entries are counted in ``skipped``."""
    texts = []
    for path in paths:
        name = path.lower().removesuffix(".gz")
        if name.endswith(".parquet"):
            rows = _iter_parquet(path, text_field, skipped)
        elif name.endswith((".jsonl", ".json", ".ndjson")):
            rows = _iter_jsonl(path, text_field, skipped)
        else:
            rows = _iter_txt(path, skipped)
        for text in rows:
            if text.strip():
                texts.append(text)
            else:
                skipped["empty"] += 1
    return texts


# ---------------------------------------------------------------------------
# The model


class QualityClassifier:
    """A fastText classifier and the label whose probability is the quality score."""

    def __init__(self, model, path: str, label: str, preprocess: str = "tokens", max_chars: int = 20_000):
        labels = fasttext_models.supervised_labels(model, path, MODEL_SETTING)
        if label not in labels:
            shown = labels if len(labels) <= 20 else labels[:20] + ["..."]
            raise ValueError(
                f"data.quality.classifier.label {label!r} is not a label of {path} (its labels: {shown})"
            )
        self.model = model
        self.path = path
        self.label = label
        self.preprocess = preprocess
        self.max_chars = max_chars

    @classmethod
    def load(cls, cfg: QualityClassifierConfig) -> "QualityClassifier":
        """The classifier at ``cfg.model`` (loaded once per process)."""
        if not cfg.model:
            raise ValueError(f"{MODEL_SETTING} is not set: no classifier to filter with")
        model = fasttext_models.load_model(cfg.model, MODEL_SETTING)
        return cls(model, cfg.model, cfg.label, cfg.preprocess, cfg.max_chars)

    def line(self, text: str) -> str:
        return fasttext_models.to_line(text, self.preprocess, self.max_chars)

    def predict_proba(self, texts: Iterable[str]) -> list[float]:
        """Probability of ``label`` for each text (non-strings count as empty text)."""
        lines = [self.line(t) if isinstance(t, str) else "" for t in texts]
        if not lines:
            return []
        all_labels, all_probs = self.model.predict(lines, k=-1)
        out = []
        for labels, probs in zip(all_labels, all_probs):
            prob = next((float(p) for lab, p in zip(labels, probs) if lab == self.label), 0.0)
            out.append(min(max(prob, 0.0), 1.0))  # fastText's softmax can round past 1
        return out


def _sample(texts: list[str], limit: int | None, rng: random.Random) -> list[str]:
    return texts if limit is None or len(texts) <= limit else rng.sample(texts, limit)


def _split_heldout(n: int, fraction: float, rng: random.Random) -> tuple[list[int], list[int]]:
    """Train/held-out indices of one class; no held-out set when the class is tiny."""
    order = list(range(n))
    rng.shuffle(order)
    n_heldout = int(round(n * fraction)) if n >= 10 else 0
    return order[n_heldout:], order[:n_heldout]


def train_quality_classifier(cfg: QualityClassifierConfig, output: str | os.PathLike) -> dict[str, float | int | None]:
    """Train on ``cfg.positive_files`` vs ``cfg.negative_files``; save a fastText ``.bin`` at ``output``.

    The file is written atomically (a temporary file in the same folder, then renamed).
    Returns metrics: example counts, skipped-line counts by reason, and accuracy on
    the training set and on a stratified held-out set (None when a class has fewer
    than 10 examples, too few to hold any out).
    """
    import fasttext

    rng = random.Random(cfg.seed)
    skipped: Counter[str] = Counter()
    positives = _sample(read_examples(cfg.positive_files, cfg.text_field, skipped), cfg.max_examples_per_class, rng)
    negatives = _sample(read_examples(cfg.negative_files, cfg.text_field, skipped), cfg.max_examples_per_class, rng)
    if not positives or not negatives:
        missing = "positive" if not positives else "negative"
        files = cfg.positive_files if not positives else cfg.negative_files
        raise ValueError(f"no usable {missing} examples in {files} (skipped: {dict(skipped)})")

    def line(text: str) -> str:
        return fasttext_models.to_line(text, cfg.preprocess, cfg.max_chars)

    examples = [(cfg.label, line(t)) for t in positives] + [(cfg.negative_label, line(t)) for t in negatives]
    pos_train, pos_held = _split_heldout(len(positives), cfg.heldout_fraction, rng)
    neg_train, neg_held = _split_heldout(len(negatives), cfg.heldout_fraction, rng)
    train_idx = pos_train + [len(positives) + i for i in neg_train]
    held_idx = pos_held + [len(positives) + i for i in neg_held]
    rng.shuffle(train_idx)  # fastText reads the file in order; classes interleaved

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".train-", dir=output.parent) as tmp:
        train_file = Path(tmp) / "train.txt"
        with open(train_file, "w", encoding="utf-8") as f:
            for i in train_idx:
                label, text = examples[i]
                f.write(f"{label} {text}\n")
        try:
            model = fasttext.train_supervised(
                input=str(train_file), epoch=cfg.epoch, lr=cfg.lr, dim=cfg.dim, wordNgrams=cfg.word_ngrams,
                minCount=cfg.min_count, minn=cfg.minn, maxn=cfg.maxn, bucket=cfg.bucket,
                thread=cfg.threads, seed=cfg.seed, loss="softmax", verbose=0,
            )
        except RuntimeError as e:  # "Encountered NaN": the learning rate is too high for the data
            raise ValueError(f"fastText training failed ({e}); try a smaller data.quality.classifier.lr "
                             f"than {cfg.lr}") from None
        partial = Path(tmp) / output.name
        model.save_model(str(partial))
        os.replace(partial, output)

    classifier = QualityClassifier(model, str(output), cfg.label, cfg.preprocess, cfg.max_chars)

    def accuracy(idx: list[int]) -> float | None:
        if not idx:
            return None
        probs = classifier.predict_proba([positives[i] if i < len(positives) else negatives[i - len(positives)]
                                          for i in idx])
        return sum((p >= 0.5) == (i < len(positives)) for p, i in zip(probs, idx)) / len(idx)

    metrics: dict[str, float | int | None] = {
        "n_pos": len(positives),
        "n_neg": len(negatives),
        "n_train": len(train_idx),
        "n_heldout": len(held_idx),
        "train_accuracy": accuracy(train_idx),
        "heldout_accuracy": accuracy(held_idx),
    }
    for reason in ("empty", "malformed_json", "missing_text"):
        metrics[f"skipped_{reason}"] = skipped[reason]
    return metrics


class QualityClassifierFilter(Block):
    """Sets ``quality_score`` to the probability of the configured label; drops documents below the threshold.

    Documents are scored in batches (one fastText call per batch), not one by one;
    order and the per-document contract of :class:`Block` are unchanged.
    """

    name = "quality_classifier"

    def __init__(self, cfg: QualityClassifierConfig, batch_size: int = 256):
        super().__init__()
        self.threshold = cfg.threshold
        self.batch_size = batch_size
        self.classifier = QualityClassifier.load(cfg)

    def process(self, doc: Document) -> str | None:
        return self._decide(doc, float(self.classifier.predict_proba([doc.get("text")])[0]))

    def _decide(self, doc: Document, prob: float) -> str | None:
        if not isinstance(doc.get("text"), str) or not doc["text"].strip():
            return "no_text"
        doc["quality_score"] = prob
        return "below_threshold" if prob < self.threshold else None

    def run(self, docs: Iterable[Document]) -> Iterator[Document]:
        batch: list[Document] = []
        for doc in docs:
            batch.append(doc)
            if len(batch) >= self.batch_size:
                yield from self._run_batch(batch)
                batch = []
        yield from self._run_batch(batch)

    def _run_batch(self, batch: list[Document]) -> list[Document]:
        live = [doc for doc in batch if not doc.get("drop_reason")]
        probs = self.classifier.predict_proba([doc.get("text") for doc in live]) if live else []
        for doc, prob in zip(live, probs):
            self.stats["seen"] += 1
            rule = self._decide(doc, float(prob))
            if rule:
                doc["drop_reason"] = f"{self.name}:{rule}"
                self.stats[f"dropped:{rule}"] += 1
            else:
                doc["drop_reason"] = None
                self.stats["kept"] += 1
        return batch
