"""A fastText-style linear quality classifier, trained from example files.

The model family is fastText's supervised classifier: hashed word uni/bigrams
plus hashed character n-grams (fastText's subwords) feeding one logistic unit.
It is built from scikit-learn rather than the ``fasttext`` package because the
full package installs the same ``fasttext`` module as ``fasttext-predict``
(needed by the language-ID model package) and cannot sit beside it.

Words come from :func:`crawl2chat.stages.data.text.split_words`, so Chinese and
Japanese text yields one "word" per character and word bigrams are character
bigrams there; character n-grams work the same in every script.

A saved model is two files in ``model_dir``: ``quality_classifier.json`` (the
hashing parameters; ``HashingVectorizer`` is stateless, so these fully define
the features) and ``quality_classifier.safetensors`` (the linear weights). No
pickle is involved, so a model folder from an untrusted source loads safely.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

import fsspec
import numpy as np
import pyarrow.parquet as pq
import scipy.sparse as sp
from safetensors.numpy import load_file, save_file
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.linear_model import SGDClassifier

from crawl2chat.stages.data.base import Block, Document
from crawl2chat.stages.data.text import split_words
from crawl2chat.stages.data.settings import QualityClassifierConfig

MODEL_FORMAT = "crawl2chat.quality_classifier"
MODEL_VERSION = 1
PARAMS_FILE = "quality_classifier.json"
WEIGHTS_FILE = "quality_classifier.safetensors"


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


def _vectorizer_params(cfg: QualityClassifierConfig) -> dict:
    """Everything that defines the features, as plain JSON values."""
    common = {"n_features": cfg.hash_buckets, "alternate_sign": False, "lowercase": True, "norm": "l2"}
    return {
        "max_chars": cfg.max_chars,
        # Input is pre-split with split_words and re-joined with spaces.
        "word": {**common, "analyzer": "word", "token_pattern": r"\S+", "ngram_range": [1, cfg.word_ngrams]},
        "char": {**common, "analyzer": "char_wb", "ngram_range": [cfg.char_ngram_min, cfg.char_ngram_max]},
    }


_ALLOWED_ANALYZERS = {"word": {"word"}, "char": {"char", "char_wb"}}
_ALLOWED_KEYS = {"n_features", "alternate_sign", "lowercase", "norm", "analyzer", "token_pattern", "ngram_range"}


def _make_vectorizer(kind: str, params: dict) -> HashingVectorizer:
    """A HashingVectorizer from saved parameters, accepting only known keys and analyzers."""
    if set(params) - _ALLOWED_KEYS or params.get("analyzer") not in _ALLOWED_ANALYZERS[kind]:
        raise ValueError(f"unsupported {kind} vectorizer parameters: {params}")
    low, high = params["ngram_range"]
    return HashingVectorizer(**{**params, "ngram_range": (int(low), int(high)), "dtype": np.float64})


class QualityClassifier:
    """Hashed n-gram features + logistic regression weights; predicts P(high quality)."""

    def __init__(self, params: dict, coef: np.ndarray, intercept: float):
        self.params = params
        self.max_chars = int(params["max_chars"])
        self.word_vectorizer = _make_vectorizer("word", params["word"])
        self.char_vectorizer = _make_vectorizer("char", params["char"])
        n_features = self.word_vectorizer.n_features + self.char_vectorizer.n_features
        coef = np.asarray(coef, dtype=np.float64).reshape(-1)
        if coef.shape[0] != n_features:
            raise ValueError(f"weights have {coef.shape[0]} entries, features need {n_features}")
        self.coef = coef
        self.intercept = float(intercept)

    def features(self, texts: Iterable[str]) -> sp.csr_matrix:
        texts = [t[: self.max_chars] if isinstance(t, str) else "" for t in texts]
        words = self.word_vectorizer.transform([" ".join(split_words(t)) for t in texts])
        chars = self.char_vectorizer.transform(texts)
        return sp.hstack([words, chars], format="csr")

    def predict_proba(self, texts: Iterable[str]) -> np.ndarray:
        """Probability that each text is high quality, shape ``(n,)``."""
        return _sigmoid(self.features(texts) @ self.coef + self.intercept)

    def save(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        meta = {"format": MODEL_FORMAT, "version": MODEL_VERSION, **self.params}
        (model_dir / PARAMS_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        save_file(
            {"coef": self.coef, "intercept": np.array([self.intercept], dtype=np.float64)},
            str(model_dir / WEIGHTS_FILE),
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> "QualityClassifier":
        model_dir = Path(model_dir)
        meta = json.loads((model_dir / PARAMS_FILE).read_text(encoding="utf-8"))
        if meta.get("format") != MODEL_FORMAT or meta.get("version") != MODEL_VERSION:
            raise ValueError(f"{model_dir}: not a {MODEL_FORMAT} v{MODEL_VERSION} model")
        weights = load_file(str(model_dir / WEIGHTS_FILE))
        params = {k: meta[k] for k in ("max_chars", "word", "char")}
        return cls(params, weights["coef"], float(weights["intercept"][0]))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64)))


def _sample(texts: list[str], limit: int | None, rng: random.Random) -> list[str]:
    return texts if limit is None or len(texts) <= limit else rng.sample(texts, limit)


def _split_heldout(n: int, fraction: float, rng: random.Random) -> tuple[list[int], list[int]]:
    """Train/held-out indices of one class; no held-out set when the class is tiny."""
    order = list(range(n))
    rng.shuffle(order)
    n_heldout = int(round(n * fraction)) if n >= 10 else 0
    return order[n_heldout:], order[:n_heldout]


def train_quality_classifier(cfg: QualityClassifierConfig) -> dict[str, float | int | None]:
    """Train on ``cfg.positive_files`` vs ``cfg.negative_files``, save to ``cfg.model_dir``.

    Returns metrics: example counts, skipped-line counts by reason, and accuracy
    on the training set and on a stratified held-out set (None when a class has
    fewer than 10 examples, too few to hold any out).
    """
    rng = random.Random(cfg.seed)
    skipped: Counter[str] = Counter()
    positives = _sample(read_examples(cfg.positive_files, cfg.text_field, skipped), cfg.max_examples_per_class, rng)
    negatives = _sample(read_examples(cfg.negative_files, cfg.text_field, skipped), cfg.max_examples_per_class, rng)
    if not positives or not negatives:
        missing = "positive" if not positives else "negative"
        files = cfg.positive_files if not positives else cfg.negative_files
        raise ValueError(f"no usable {missing} examples in {files} (skipped: {dict(skipped)})")

    texts = positives + negatives
    labels = np.array([1] * len(positives) + [0] * len(negatives))
    pos_train, pos_held = _split_heldout(len(positives), cfg.heldout_fraction, rng)
    neg_train, neg_held = _split_heldout(len(negatives), cfg.heldout_fraction, rng)
    train_idx = pos_train + [len(positives) + i for i in neg_train]
    held_idx = pos_held + [len(positives) + i for i in neg_held]

    params = _vectorizer_params(cfg)
    untrained = QualityClassifier(params, np.zeros(2 * cfg.hash_buckets), 0.0)
    features = untrained.features(texts)
    sgd = SGDClassifier(
        loss="log_loss", alpha=cfg.l2, max_iter=cfg.epochs, tol=None,
        class_weight="balanced", random_state=cfg.seed,
    )
    sgd.fit(features[train_idx], labels[train_idx])
    model = QualityClassifier(params, sgd.coef_[0], sgd.intercept_[0])
    model.save(cfg.model_dir)

    def accuracy(idx: list[int]) -> float | None:
        if not idx:
            return None
        probs = _sigmoid(features[idx] @ model.coef + model.intercept)
        return float(np.mean((probs >= 0.5) == (labels[idx] == 1)))

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
    """Sets ``quality_score`` to the classifier's probability; drops documents below the threshold.

    Documents are scored in batches (one sparse matrix product per batch), not one
    by one; order and the per-document contract of :class:`Block` are unchanged.
    """

    name = "quality_classifier"

    def __init__(self, cfg: QualityClassifierConfig, batch_size: int = 256):
        super().__init__()
        self.threshold = cfg.threshold
        self.batch_size = batch_size
        self.classifier = QualityClassifier.load(cfg.model_dir)

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
