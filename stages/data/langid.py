"""Language identification with fastText's lid.176 model.

The compressed model (lid.176.ftz, 917 KB, 176 languages; CC BY-SA 3.0, see
``models/lid.176.NOTICE.md`` beside this module) ships inside this package, so
nothing is downloaded at run time. It runs on the real fastText, the same
implementation that trains and applies the quality classifier
(:mod:`crawl2chat.stages.data.fasttext_models`).

FineWeb keeps documents whose top language scores at least 0.65; that is the
default here. Which languages to keep is a config choice (``None`` keeps all),
never an English-only assumption.
"""

from __future__ import annotations

from importlib.resources import files

from crawl2chat.stages.data import fasttext_models
from crawl2chat.stages.data.base import Block, Document
from crawl2chat.stages.data.settings import LangIdConfig

UNKNOWN_LANGUAGE = "unknown"


def bundled_model_path() -> str:
    """Path of the lid.176.ftz file shipped inside this package."""
    return str(files("crawl2chat.stages.data") / "models" / "lid.176.ftz")


def load_model(path: str | None = None):
    """The fastText model, loaded once per process (each Ray worker loads it once)."""
    return fasttext_models.load_model(path or bundled_model_path(), "data.langid.model_path")


def predict_language(text: str, model_path: str | None = None, prefix_chars: int = 2000) -> tuple[str, float]:
    """``(lang, score)`` of the most likely language; ``("unknown", 0.0)`` for blank text.

    fastText reads one line, so newlines become spaces.
    """
    return predict_languages([text], model_path, prefix_chars)[0]


def predict_languages(
    texts: list[str], model_path: str | None = None, prefix_chars: int = 2000
) -> list[tuple[str, float]]:
    """``predict_language`` over a batch: one fastText call for all non-blank texts."""
    lines = [fasttext_models.to_line(text, "whitespace", prefix_chars) for text in texts]
    results = [(UNKNOWN_LANGUAGE, 0.0)] * len(texts)
    todo = [i for i, line in enumerate(lines) if line]
    if todo:
        all_labels, all_scores = load_model(model_path).predict([lines[i] for i in todo], k=1)
        for i, labels, scores in zip(todo, all_labels, all_scores):
            if len(labels):
                lang = labels[0].removeprefix(fasttext_models.LABEL_PREFIX)
                results[i] = (lang, min(max(float(scores[0]), 0.0), 1.0))
    return results


class LanguageId(Block):
    """Sets ``doc["lang"]`` and ``doc["lang_score"]``; drops unsure and unwanted languages."""

    name = "langid"

    def __init__(self, config: LangIdConfig | None = None) -> None:
        super().__init__()
        self.config = config or LangIdConfig()
        self._allowed = set(self.config.languages) if self.config.languages is not None else None

    def process(self, doc: Document) -> str | None:
        lang, score = predict_language(doc.get("text") or "", self.config.model_path, self.config.prefix_chars)
        doc["lang"] = lang
        doc["lang_score"] = score
        if score < self.config.min_score:
            return "low_confidence"
        if self._allowed is not None and lang not in self._allowed:
            return "not_allowed_language"
        return None
