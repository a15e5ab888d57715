"""fastText models, loaded one way for language ID and the quality classifier.

Both use the real fastText (the ``fasttext`` module of the ``fasttext-community``
build: facebookresearch/fastText with numpy 2 support and prebuilt wheels), so a
model trained here is a standard fastText ``.bin`` that ``fasttext.load_model``
and the ``fasttext`` command line read, and any published fastText classifier
(``.bin`` or quantized ``.ftz``) loads here.

Why that build, measured on this project's machine (Python 3.11, numpy 2.4) against
the other maintained numpy-2 builds on PyPI: all install from a wheel in about 2 s
without compiling and predict lid.176 at the same speed (about 2,700 documents of
2,000 characters per second, single-threaded; ``fasttext-predict`` managed about
1,100), but in 12 small ``train_supervised`` runs (1,000 lines, default settings,
one thread) ``fasttext-numpy2`` 0.10.4 failed all 12 with "Encountered NaN",
``fasttext-numpy2-wheel`` 0.9.2 failed 6 and ``fasttext-modern`` 0.10.0 failed 5,
while ``fasttext-community`` 0.11.9 failed none: it fixes upstream's partly
uninitialised input matrix (its ``tests/test_matrix_init.py``). It is also the
most recently released of them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Literal

from crawl2chat.stages.data.text import split_tokens

LABEL_PREFIX = "__label__"
Preprocess = Literal["tokens", "whitespace"]


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int):
    import fasttext

    return fasttext.load_model(path)


def load_model(path: str | os.PathLike, setting: str):
    """The fastText model at ``path``, loaded once per process (and again if the file changes).

    ``setting`` names the configuration field the path came from, for the error message
    when the file is missing or is not a fastText model.
    """
    path = str(path)
    try:
        stat = os.stat(path)
    except OSError as e:
        raise FileNotFoundError(f"{setting}: fastText model {path} cannot be read ({e.strerror})") from None
    if not Path(path).is_file():
        raise FileNotFoundError(f"{setting}: {path} is not a file")
    try:
        return _load(path, stat.st_mtime_ns, stat.st_size)
    except (ValueError, RuntimeError, MemoryError) as e:
        raise ValueError(f"{setting}: {path} is not a fastText model ({e})") from None


def supervised_labels(model, path: str, setting: str) -> list[str]:
    """Labels of a supervised model; a clear error for word-vector models."""
    import fasttext

    if model.f.getArgs().model != fasttext.FastText.model_name.supervised:
        raise ValueError(f"{setting}: {path} is a fastText word-vector model, not a classifier")
    return list(model.get_labels())


def to_line(text: str, preprocess: Preprocess = "whitespace", max_chars: int | None = None) -> str:
    """``text`` as the single line fastText reads.

    ``"whitespace"`` only turns newlines and runs of spaces into one space (what
    lid.176 and DCLM-style published classifiers were trained on); ``"tokens"``
    lower-cases and splits with :func:`~crawl2chat.stages.data.text.split_tokens`
    (each CJK character a word, punctuation runs apart), which is what the quality
    classifier trained here uses. Tokens that start with ``__label__`` would be read
    as labels, so they are dropped.
    """
    if max_chars is not None:
        text = text[:max_chars]
    tokens = split_tokens(text.lower()) if preprocess == "tokens" else text.split()
    return " ".join(t for t in tokens if not t.startswith(LABEL_PREFIX))
