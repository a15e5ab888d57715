"""Harmful-content filter: per-language word lists and an optional fastText classifier.

The word rule is C4's "bad words" idea with two changes that keep it from
discarding what it should not: a page is dropped only when listed words reach
a share of its words (and a minimum count), never for one stray hit (every list
holds words with harmless uses: anatomy, names), and a page is judged only by
the list of its own language (``lang`` from language ID), so an English list
never drops a German or Chinese page. Words come from
:func:`crawl2chat.stages.data.text.split_words` (a CJK character is a word), so
lists work for unspaced scripts too; phrases match on consecutive words.
Written here: the list-matching packages (better-profanity and its ports)
censor strings in one language rather than count matches per page and language.
"""

from __future__ import annotations

from importlib import resources
from itertools import compress, count
from pathlib import Path

from crawl2chat.stages.data import fasttext_models
from crawl2chat.stages.data.base import Block, Document
from crawl2chat.stages.data.settings import HarmfulConfig
from crawl2chat.stages.data.text import page_words, split_words

DEFAULT_LIST = "default"


def read_word_list(path: str, setting: str) -> tuple[frozenset[str], tuple[tuple[str, ...], ...]]:
    """Single words and multi-word phrases of a list file (lower-cased, split like page text)."""
    if path == DEFAULT_LIST:
        text = resources.files("crawl2chat.stages.data").joinpath("models/harmful_words.en.txt").read_text("utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise FileNotFoundError(f"{setting}: word list {path} cannot be read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{setting}: word list {path} is not UTF-8 text") from None
    words, phrases = set(), set()
    for line in text.splitlines():
        entry = tuple(w.lower() for w in split_words(line.split("#", 1)[0]))
        if len(entry) == 1:
            words.add(entry[0])
        elif entry:
            phrases.add(entry)
    if not words and not phrases:
        raise ValueError(f"{setting}: word list {path} has no entries")
    return frozenset(words), tuple(sorted(phrases))


def _phrase_index(phrases: tuple[tuple[str, ...], ...]) -> tuple[list[tuple[int, frozenset]], frozenset[str]]:
    """A list's phrases grouped by length (``[(n, phrases of n words)]``), and their first words."""
    lengths = sorted({len(p) for p in phrases})
    by_length = [(n, frozenset(p for p in phrases if len(p) == n)) for n in lengths]
    return by_length, frozenset(p[0] for p in phrases)


class HarmfulContentFilter(Block):
    """Drops pages whose listed words reach ``max_word_fraction`` (``harmful:word_list``)
    or that the classifier scores as harmful (``harmful:classifier``)."""

    name = "harmful"

    def __init__(self, cfg: HarmfulConfig | None = None):
        super().__init__()
        self.cfg = cfg or HarmfulConfig()
        self.lists = {lang: read_word_list(path, f"data.quality.harmful.word_lists.{lang}")
                      for lang, path in self.cfg.word_lists.items()}
        self.phrase_index = {lang: _phrase_index(phrases) for lang, (_, phrases) in self.lists.items()}
        self.classifier = None
        if self.cfg.classifier_model:
            from crawl2chat.stages.data.quality_classifier import QualityClassifier

            setting = "data.quality.harmful.classifier_model"
            model = fasttext_models.load_model(self.cfg.classifier_model, setting)
            labels = fasttext_models.supervised_labels(model, self.cfg.classifier_model, setting)
            if self.cfg.classifier_label not in labels:
                raise ValueError(f"data.quality.harmful.classifier_label {self.cfg.classifier_label!r} is not a label "
                                 f"of {self.cfg.classifier_model} (its labels: {labels[:20]})")
            self.classifier = QualityClassifier(model, self.cfg.classifier_model, self.cfg.classifier_label)

    def matches(self, text: str, lang: str | None) -> tuple[int, int] | None:
        """(listed words and phrases found, words on the page); None when no list covers ``lang``."""
        listed = self.lists.get(lang or "")
        if listed is None:
            return None
        words, phrases = listed
        tokens = list(map(str.lower, page_words(text)))
        found = sum(map(words.__contains__, tokens))  # membership tested in C, word by word
        if phrases:
            # Only positions whose word starts a listed phrase are compared, one slice per phrase
            # length, instead of every phrase at every position (which cost more than all the
            # other quality rules together). The phrases are distinct, so a position matches at
            # most one phrase of each length: the count is the same.
            by_length, starts = self.phrase_index[lang or ""]
            for i in compress(count(), map(starts.__contains__, tokens)):
                found += sum(tuple(tokens[i:i + n]) in listed_n for n, listed_n in by_length)
        return found, len(tokens)

    def process(self, doc: Document) -> str | None:
        text = doc.get("text") or ""
        counted = self.matches(text, doc.get("lang"))
        if counted is None:
            self.stats["not_judged:no_word_list"] += 1
        else:
            found, total = counted
            if found >= self.cfg.min_matches and total and found / total >= self.cfg.max_word_fraction:
                return "word_list"
        if self.classifier is not None and self.classifier.predict_proba([text])[0] >= self.cfg.classifier_threshold:
            return "classifier"
        return None
