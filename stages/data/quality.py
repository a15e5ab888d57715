"""Heuristic quality filters: Gopher quality and repetition, C4, FineWeb.

Each filter follows its published rules, with the published thresholds as
config defaults (Gopher/MassiveText: Rae et al. 2021, appendix A; C4: Raffel et
al. 2020; FineWeb: Penedo et al. 2024), adapted so they do not silently discard
languages the rules were not tuned on:

* words come from :func:`crawl2chat.stages.data.text.split_words`, where each CJK
  character is a word, so word counts work for Chinese and Japanese;
* the mean-word-length and stop-word rules apply only to spaced text, and the
  stop-word rule only to languages with a list (``text.STOP_WORDS``);
* n-gram repetition on unspaced text uses character n-grams of
  ``n * unspaced_chars_per_word`` characters, so a "2-gram" still spans about
  two words and a common two-character word is not mistaken for repetition;
* terminal punctuation includes CJK, Arabic, Devanagari and other marks, and the
  punctuation rules are skipped for Thai and Lao, which end sentences with a space;
* the "alphabetic word" rule accepts any Unicode letter.

Every document a filter looks at gets three columns: ``quality_checks_passed``
and ``quality_checks_total`` (running counts over all heuristic filters) and
``quality_score`` = passed / total. Document-level rules each count as one check;
each line the C4 line rules examine counts as one check too (passed when the
line is kept), so a kept document's score falls below 1 by the share of its
lines that were boilerplate. When the trained classifier runs afterwards
(:mod:`crawl2chat.stages.data.quality_classifier`), ``quality_score`` is replaced by
its probability of high quality.
"""

from __future__ import annotations

import re
from itertools import filterfalse
from typing import Sequence

import numpy as np

from crawl2chat.stages.data.base import Block, Document
from crawl2chat.stages.data.quality_classifier import QualityClassifierFilter
from crawl2chat.stages.data.text import (
    count_sentences, is_unspaced, page_words, split_words, stop_words, unspaced_fraction,
)
from crawl2chat.stages.data.settings import GopherQualityConfig, GopherRepetitionConfig, C4Config, FineWebQualityConfig, QualityConfig


# ---------------------------------------------------------------------------
# Configs


# ---------------------------------------------------------------------------
# Shared helpers

_PARAGRAPH_RE = re.compile(r"\n\s*\n")
_LINE_RE = re.compile(r"\n+")
# A whitespace-separated token without a letter or digit ("|", "»", "★★★", "--"): ``\w`` is
# exactly str.isalnum() plus "_", and ``\s`` exactly str.isspace(), which str.split() splits on,
# so this counts what ``not any(c.isalnum() for c in token)`` over ``text.split()`` counts, in C.
_SYMBOL_TOKEN_RE = re.compile(r"(?<!\S)(?:[^\w\s]|_)+(?!\S)")
_CITATION_RE = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]|\[编辑\]|\[編集\]|\[Bearbeiten[^\]]*\]", re.I)


def find_duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items that repeat an earlier one, total characters in those repeats)."""
    seen: set[str] = set()
    dup_items = dup_chars = 0
    for item in items:
        if item in seen:
            dup_items += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    return dup_items, dup_chars


def remove_repeated_runs(text: str, run_lines: int) -> tuple[str, int]:
    """``text`` without the second and later copies of any run of ``run_lines``
    consecutive lines (compared without surrounding blanks); returns the text and
    the number of lines removed.

    Written here because the published filters only judge repetition (Gopher) or
    deduplicate across documents (C4's three-sentence spans, exact-substring
    suffix arrays): none repairs a single page. Reference pages need it: every
    class section repeats the members it inherits, so a page such as ``builtins``
    is mostly copies of one block and the repetition rules drop it whole.
    """
    lines = text.split("\n")
    keys = [line.strip() for line in lines]
    keep = [True] * len(lines)
    first_seen: dict[tuple[str, ...], int] = {}
    for i in range(len(lines) - run_lines + 1):
        run = tuple(keys[i:i + run_lines])
        if not any(run):
            continue
        start = first_seen.setdefault(run, i)
        if start + run_lines <= i:  # a copy that does not overlap the first occurrence
            keep[i:i + run_lines] = [False] * run_lines
    removed = keep.count(False)
    return ("\n".join(line for line, k in zip(lines, keep) if k), removed) if removed else (text, 0)


def repetition_units(text: str, lang: str | None, chars_per_word: int) -> tuple[Sequence[str], int]:
    """The units n-gram rules count and how many of them make one "word".

    Spaced text: words, one per word. Unspaced text: the character-words of
    ``split_words``, ``chars_per_word`` of them standing for one word.
    """
    words = page_words(text)
    return words, (chars_per_word if is_unspaced(text, lang) else 1)


class NgramStats:
    """Word n-gram repetition of one document, vectorised with numpy.

    Each word gets an integer id; the n-grams at every position are hashed at
    once (a polynomial hash over the ids, modulo 2**64), so the Gopher
    repetition rules cost a few array operations per n instead of a Python loop
    that builds a tuple per position. Written here because no text library
    computes these two Gopher statistics; a 64-bit hash collision between two
    distinct n-grams of one page is negligible.

    The (n+1)-gram hashes extend the n-gram ones (one multiply-add), and only a
    position whose n-gram occurs more than once can hold an (n+1)-gram that
    does, so the duplicated n-gram rules (n = 5..10 in Gopher) sort a shrinking
    set of positions after the first n instead of the whole page each time.
    """

    _PRIME = np.uint64(0x100000001B3)

    def __init__(self, words: Sequence[str]):
        vocab: dict[str, int] = {}
        ids = [vocab.setdefault(w, len(vocab)) for w in words]
        # Spread small ids over 64 bits (splitmix64's finaliser) before mixing them.
        x = np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        self.ids = x ^ (x >> np.uint64(31))
        self.lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        self._hashes: dict[int, np.ndarray] = {}  # n -> the n-gram hash at every position
        # n -> (positions whose n-gram occurs more than once, their hashes, those that repeat an earlier one)
        self._repeating: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _hashes_of(self, n: int) -> np.ndarray | None:
        """The n-gram hash at every position, or None when the page has no n-gram."""
        m = len(self.ids) - n + 1
        if n <= 0 or m <= 0:
            return None
        if n not in self._hashes:
            shorter = self._hashes.get(n - 1)
            with np.errstate(over="ignore"):
                if shorter is not None:
                    h = shorter[:m] * self._PRIME + self.ids[n - 1:]
                else:
                    h = np.zeros(m, dtype=np.uint64)
                    for k in range(n):
                        h = h * self._PRIME + self.ids[k:k + m]
            self._hashes[n] = h
        return self._hashes[n]

    @staticmethod
    def _split(positions: np.ndarray, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Of ``positions`` (ascending, holding every occurrence of each of their n-grams): those
        whose n-gram occurs more than once, their hashes, and those that repeat an earlier one."""
        _, first, inverse, counts = np.unique(hashes, return_index=True, return_inverse=True, return_counts=True)
        several = counts[inverse] > 1
        repeats = positions[first[inverse] < np.arange(len(positions))]
        return positions[several], hashes[several], repeats

    def _repeats(self, n: int) -> np.ndarray:
        """Positions whose n-gram repeats an earlier one, ascending."""
        if n not in self._repeating:
            below = [k for k in self._repeating if k < n]
            if not below:
                h = self._hashes_of(n)
                if h is None:
                    return np.zeros(0, dtype=np.int64)
                self._repeating[n] = self._split(np.arange(len(h)), h)
            else:
                level = max(below)
                positions, h, _ = self._repeating[level]
                while level < n:
                    level += 1
                    exists = positions + level - 1 < len(self.ids)
                    positions = positions[exists]
                    with np.errstate(over="ignore"):
                        h = h[exists] * self._PRIME + self.ids[positions + level - 1]
                    self._repeating[level] = self._split(positions, h)
                    positions, h, _ = self._repeating[level]
        return self._repeating[n][2]

    def top_chars(self, n: int) -> int:
        """Characters covered by the most frequent n-gram (0 when no n-gram repeats);
        among equally frequent ones, the one that occurs first."""
        h = self._hashes_of(n)
        if h is None:
            return 0
        _, first, inverse, counts = np.unique(h, return_index=True, return_inverse=True, return_counts=True)
        top = int(counts.max())
        if top <= 1:
            return 0
        start = int(first[counts == top].min())
        return int(self.lengths[start:start + n].sum()) * top

    def duplicate_chars(self, n: int) -> int:
        """Characters covered by n-grams that repeat an earlier one, each character counted once."""
        if n <= 0:
            return 0
        repeats = self._repeats(n)
        if not len(repeats):
            return 0
        cover = np.zeros(len(self.ids) + 1, dtype=np.int64)
        np.add.at(cover, repeats, 1)
        np.add.at(cover, repeats + n, -1)
        return int(self.lengths[np.cumsum(cover[:-1]) > 0].sum())


class _Checks:
    """Counts rules evaluated and passed for one document, for ``quality_score``."""

    def __init__(self) -> None:
        self.passed = 0
        self.total = 0

    def fails(self, failed: bool) -> bool:
        self.total += 1
        self.passed += not failed
        return failed


class HeuristicFilter(Block):
    """A rule-based filter that records how many of its checks a document passed."""

    def check(self, doc: Document, checks: _Checks) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def process(self, doc: Document) -> str | None:
        checks = _Checks()
        text = doc.get("text")
        rule = self.check(doc, checks) if isinstance(text, str) else "no_text"
        passed = (doc.get("quality_checks_passed") or 0) + checks.passed
        total = (doc.get("quality_checks_total") or 0) + checks.total
        doc["quality_checks_passed"] = passed
        doc["quality_checks_total"] = total
        doc["quality_score"] = passed / total if total else (0.0 if rule else 1.0)
        return rule


# ---------------------------------------------------------------------------
# Filters


class GopherQualityFilter(HeuristicFilter):
    """Gopher/MassiveText quality rules: length, word shape, symbols, bullets, stop words."""

    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig | None = None):
        super().__init__()
        self.cfg = cfg or GopherQualityConfig()
        self.bullets = tuple(self.cfg.bullets)

    def check(self, doc: Document, checks: _Checks) -> str | None:
        cfg, text, lang = self.cfg, doc["text"], doc.get("lang")
        words = page_words(text)
        n_words = len(words)
        if cfg.min_words is not None and checks.fails(n_words < cfg.min_words):
            return "too_few_words"
        if cfg.max_words is not None and checks.fails(n_words > cfg.max_words):
            return "too_many_words"
        if n_words == 0:
            return "no_words"

        spaced = not is_unspaced(text, lang)
        if spaced:
            mean_length = sum(map(len, words)) / n_words
            if cfg.min_mean_word_length is not None and checks.fails(mean_length < cfg.min_mean_word_length):
                return "short_mean_word_length"
            if cfg.max_mean_word_length is not None and checks.fails(mean_length > cfg.max_mean_word_length):
                return "long_mean_word_length"

        if cfg.max_symbol_word_ratio is not None:
            if checks.fails(text.count("#") / n_words > cfg.max_symbol_word_ratio):
                return "too_many_hashes"
            ellipses = text.count("...") + text.count("…")
            if checks.fails(ellipses / n_words > cfg.max_symbol_word_ratio):
                return "too_many_ellipses"

        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines and cfg.max_bullet_lines_ratio is not None:
            bullet_lines = sum(line.startswith(self.bullets) for line in lines)
            if checks.fails(bullet_lines / len(lines) > cfg.max_bullet_lines_ratio):
                return "too_many_bullet_lines"
        if lines and cfg.max_ellipsis_lines_ratio is not None:
            ellipsis_lines = sum(line.endswith(("...", "…")) for line in lines)
            if checks.fails(ellipsis_lines / len(lines) > cfg.max_ellipsis_lines_ratio):
                return "too_many_ellipsis_lines"

        if cfg.min_alpha_words_ratio is not None:
            # Tokens made only of symbols ("|", "»", "★★★") are words without letters too.
            symbol_tokens = len(_SYMBOL_TOKEN_RE.findall(text))
            # Words made only of letters are passed over in C (filterfalse); only the others
            # (numbers, "co-op", "don't") are looked at character by character.
            no_letter = sum(1 for w in filterfalse(str.isalpha, words) if not any(c.isalpha() for c in w))
            alpha_words = n_words - no_letter
            if checks.fails(alpha_words / (n_words + symbol_tokens) < cfg.min_alpha_words_ratio):
                return "too_few_alpha_words"

        vocabulary = stop_words(lang) if spaced else None
        if cfg.min_stop_words is not None and vocabulary is not None:
            found = sum(map(vocabulary.__contains__, map(str.lower, words)))
            if checks.fails(found < cfg.min_stop_words):
                return "too_few_stop_words"
        return None


class GopherRepetitionFilter(HeuristicFilter):
    """Gopher repetition rules: repeated lines/paragraphs and repeated n-grams.

    With ``repair_runs`` set, a page that fails them is judged once more without
    its repeated line runs (:func:`remove_repeated_runs`) and kept in that form
    when it then passes; ``repeated_lines`` records the lines removed.
    """

    name = "gopher_repetition"

    def __init__(self, cfg: GopherRepetitionConfig | None = None):
        super().__init__()
        self.cfg = cfg or GopherRepetitionConfig()

    def process(self, doc: Document) -> str | None:
        before = dict(doc)
        rule = super().process(doc)
        if not rule or not self.cfg.repair_runs or not isinstance(doc.get("text"), str):
            return rule
        text, removed = remove_repeated_runs(doc["text"], self.cfg.repair_runs)
        if not removed:
            return rule
        repaired = {**before, "text": text, "repeated_lines": removed}
        if super().process(repaired):
            return rule
        doc.update(repaired)
        self.stats["repaired"] += 1
        return None

    def check(self, doc: Document, checks: _Checks) -> str | None:
        cfg, text = self.cfg, doc["text"]
        text_chars = len(text)
        if checks.fails(not text.strip()):
            return "empty"

        paragraphs = [p for p in _PARAGRAPH_RE.split(text.strip()) if p.strip()]
        dup_paras, dup_para_chars = find_duplicates(paragraphs)
        if cfg.dup_para_frac is not None and checks.fails(dup_paras / len(paragraphs) > cfg.dup_para_frac):
            return "dup_para_frac"
        if cfg.dup_para_char_frac is not None and checks.fails(dup_para_chars / text_chars > cfg.dup_para_char_frac):
            return "dup_para_char_frac"

        lines = [line for line in _LINE_RE.split(text.strip()) if line.strip()]
        dup_lines, dup_line_chars = find_duplicates(lines)
        if cfg.dup_line_frac is not None and checks.fails(dup_lines / len(lines) > cfg.dup_line_frac):
            return "dup_line_frac"
        if cfg.dup_line_char_frac is not None and checks.fails(dup_line_chars / text_chars > cfg.dup_line_char_frac):
            return "dup_line_char_frac"

        units, per_word = repetition_units(text, doc.get("lang"), cfg.unspaced_chars_per_word)
        grams = NgramStats(units)
        for n, max_frac in sorted(cfg.top_n_grams.items()):
            if checks.fails(grams.top_chars(n * per_word) / text_chars > max_frac):
                return f"top_{n}_gram"
        for n, max_frac in sorted(cfg.dup_n_grams.items()):
            if checks.fails(grams.duplicate_chars(n * per_word) / text_chars > max_frac):
                return f"duplicated_{n}_n_grams"
        return None


class C4Filter(HeuristicFilter):
    """C4's rules: remove boilerplate lines (rewriting ``text``), drop code, lorem ipsum and stubs.

    Paragraph breaks between surviving lines are kept, so later rules that look
    at paragraphs still see them.
    """

    name = "c4"

    def __init__(self, cfg: C4Config | None = None):
        super().__init__()
        self.cfg = cfg or C4Config()
        self.terminal = tuple(self.cfg.terminal_punctuation)
        # One alternation searched in C instead of a Python test per substring and line.
        policy = sorted({p.lower() for p in self.cfg.policy_substrings}, key=len, reverse=True)
        self.policy = re.compile("|".join(map(re.escape, policy))) if policy else None

    def clean_line(self, line: str, punctuated_script: bool) -> tuple[str, str | None]:
        """The line with citations removed, and why it is removed (None keeps it).

        'lorem_ipsum' and 'curly_bracket' drop the whole page, as in C4.
        """
        cfg = self.cfg
        if cfg.max_word_length is not None and len(line) > cfg.max_word_length and any(
            len(token) > cfg.max_word_length and unspaced_fraction(token) < 0.5 for token in line.split()
        ):
            # A URL, base64 or minified blob; a long unspaced CJK sentence is not one word.
            return line, "too_long_word"
        if cfg.remove_citations:
            line = _CITATION_RE.sub("", line).strip()
        if cfg.filter_no_terminal_punct and punctuated_script:
            if not line.endswith(self.terminal) or line.endswith(("...", "…")):
                return line, "no_terminal_punct"
        if cfg.min_words_per_line is not None and len(split_words(line)) < cfg.min_words_per_line:
            return line, "too_few_words"
        lower = line.lower()
        if cfg.filter_lorem_ipsum and "lorem ipsum" in lower:
            return line, "lorem_ipsum"
        if cfg.filter_javascript and "javascript" in lower:
            return line, "javascript"
        if cfg.filter_curly_bracket and "{" in line:
            return line, "curly_bracket"
        if cfg.filter_policy and self.policy is not None and self.policy.search(lower):
            return line, "policy"
        return line, None

    def check(self, doc: Document, checks: _Checks) -> str | None:
        cfg, text = self.cfg, doc["text"]
        punctuated = doc.get("lang") not in cfg.no_punctuation_languages
        kept_paragraphs: list[str] = []
        for paragraph in _PARAGRAPH_RE.split(text):
            kept_lines = []
            for raw_line in paragraph.split("\n"):
                line = raw_line.strip()
                if not line:
                    continue
                line, rule = self.clean_line(line, punctuated)
                if rule in ("lorem_ipsum", "curly_bracket"):
                    checks.fails(True)
                    return rule
                if not checks.fails(rule is not None):
                    kept_lines.append(line)
                else:
                    self.stats[f"line_removed:{rule}"] += 1
            if kept_lines:
                kept_paragraphs.append("\n".join(kept_lines))
        doc["text"] = "\n\n".join(kept_paragraphs)
        if checks.fails(not doc["text"]):
            return "empty"
        if cfg.min_sentences is not None and punctuated:
            if checks.fails(count_sentences(doc["text"]) < cfg.min_sentences):
                return "too_few_sentences"
        return None


class FineWebQualityFilter(HeuristicFilter):
    """FineWeb's rules: punctuated lines, short lines, duplicated line characters, list-like pages."""

    name = "fineweb"

    def __init__(self, cfg: FineWebQualityConfig | None = None):
        super().__init__()
        self.cfg = cfg or FineWebQualityConfig()
        self.stop_chars = tuple(self.cfg.stop_chars)

    def check(self, doc: Document, checks: _Checks) -> str | None:
        cfg, text = self.cfg, doc["text"]
        lines = [line.rstrip() for line in text.split("\n") if line.strip()]
        if checks.fails(not lines):
            return "empty"
        if cfg.line_punct_thr is not None and doc.get("lang") not in cfg.no_punctuation_languages:
            ratio = sum(line.endswith(self.stop_chars) for line in lines) / len(lines)
            if checks.fails(ratio < cfg.line_punct_thr and not (ratio == 0 and cfg.line_punct_exclude_zero)):
                return "line_punct_ratio"
        if cfg.short_line_thr is not None:
            ratio = sum(len(line) <= cfg.short_line_length for line in lines) / len(lines)
            if checks.fails(ratio >= cfg.short_line_thr):
                return "short_line_ratio"
        if cfg.char_duplicates_ratio is not None:
            ratio = find_duplicates(lines)[1] / max(1, len(text.replace("\n", "")))
            if checks.fails(ratio >= cfg.char_duplicates_ratio):
                return "char_dup_ratio"
        if cfg.new_line_ratio is not None:
            n_words = len(page_words(text))
            if checks.fails(n_words == 0 or text.count("\n") / n_words > cfg.new_line_ratio):
                return "list_ratio"
        return None


def build_quality_blocks(cfg: QualityConfig) -> list[Block]:
    """The enabled quality blocks in pipeline order.

    Repetition runs first (on the page as crawled, before C4 removes lines),
    then the Gopher quality rules, C4's line cleaning, FineWeb's rules on the
    cleaned text, the harmful-content filter, and last the trained classifier, which overwrites
    ``quality_score`` with its probability.
    """
    blocks: list[Block] = []
    if cfg.gopher_repetition.enabled:
        blocks.append(GopherRepetitionFilter(cfg.gopher_repetition))
    if cfg.gopher_quality.enabled:
        blocks.append(GopherQualityFilter(cfg.gopher_quality))
    if cfg.c4.enabled:
        blocks.append(C4Filter(cfg.c4))
    if cfg.fineweb.enabled:
        blocks.append(FineWebQualityFilter(cfg.fineweb))
    if cfg.harmful.enabled:
        from crawl2chat.stages.data.harmful import HarmfulContentFilter

        blocks.append(HarmfulContentFilter(cfg.harmful))
    if cfg.classifier.enabled:
        blocks.append(QualityClassifierFilter(cfg.classifier))
    return blocks
