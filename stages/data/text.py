"""Language-aware text helpers shared by the quality filters and dedup.

Word-based rules were designed for languages that put spaces between words.
Chinese, Japanese and Thai do not, so a whitespace split would see a whole
paragraph as one "word". Here every CJK ideograph, kana and Hangul syllable
counts as a word of its own (the usual convention in multilingual filtering),
and everything else is split on Unicode word boundaries (letters, digits and
the combining marks that Indic scripts need inside words).
"""

from __future__ import annotations

import functools
import re
import unicodedata

# Scripts written without spaces between words: CJK ideographs (with extensions),
# Hiragana, Katakana, Hangul syllables, Thai, Lao, Khmer, Myanmar.
_UNSPACED = (
    "\u3040-\u30ff"  # Hiragana, Katakana
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # CJK ideographs
    "\U00020000-\U0002fa1f"
    "\uac00-\ud7af"  # Hangul syllables
    "\u0e00-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f"  # Thai, Lao, Khmer, Myanmar
)


def _combining_mark_class() -> str:
    """Regex class body of the combining marks (Unicode categories Mn, Mc, Me) below U+20000.

    Python's ``\\w`` excludes them, which would cut Devanagari, Bengali, Tamil
    and other Indic words at every vowel sign, and decomposed (NFD) Latin at
    every accent. Derived from ``unicodedata`` at import (a few ms) rather than
    pasted as a table, so it follows the interpreter's Unicode version.
    """
    parts, start = [], None
    for code in range(0x20001):
        is_mark = code < 0x20000 and unicodedata.category(chr(code))[0] == "M"
        if is_mark and start is None:
            start = code
        elif not is_mark and start is not None:
            first, last = re.escape(chr(start)), re.escape(chr(code - 1))
            parts.append(first if code - 1 == start else f"{first}-{last}")
            start = None
    return "".join(parts)


_MARKS = _combining_mark_class()
# A run of word characters, continued across combining marks.
_RUN = rf"[^\W{_UNSPACED}]+(?:[{_MARKS}]+[^\W{_UNSPACED}]*)*"
_WORD_RE = re.compile(rf"[{_UNSPACED}]|{_RUN}(?:['’\-]{_RUN})*", re.UNICODE)
_UNSPACED_RE = re.compile(rf"[{_UNSPACED}]")
# Words as above, or a run of punctuation/symbols ("!!!", "$$$", ">>>", "|").
_TOKEN_RE = re.compile(rf"{_WORD_RE.pattern}|[^\w\s]+", re.UNICODE)

UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "km", "my", "bo", "wuu", "yue"})


def split_words(text: str) -> list[str]:
    """Words of ``text``: runs of letters/digits, each unspaced-script character on its own."""
    return _WORD_RE.findall(text)


@functools.lru_cache(maxsize=4)
def page_words(text: str) -> tuple[str, ...]:
    """:func:`split_words` of a whole page, remembered for the last few pages.

    The quality filters each count a page's words (Gopher's repetition and quality
    rules on the page as crawled, FineWeb's and the harmful-content rules on C4's
    cleaned text); the split is most of their work, so each page is split once.
    A tuple, so that no caller can change what the next one gets.
    """
    return tuple(split_words(text))


def split_tokens(text: str) -> list[str]:
    """:func:`split_words` plus runs of punctuation and symbols as tokens of their own.

    A classifier that judges pages (spam, navigation bars) needs "!!!" and "|" as much as the words.
    """
    return _TOKEN_RE.findall(text)


def unspaced_fraction(text: str) -> float:
    """Share of non-space characters that belong to scripts written without spaces."""
    unspaced = len(_UNSPACED_RE.findall(text))
    if not unspaced:  # most pages: no need to count the rest
        return 0.0
    # Non-space characters: str.split's whitespace is exactly the regex \s (str.isspace).
    return unspaced / sum(map(len, text.split()))


@functools.lru_cache(maxsize=4)
def _page_unspaced_fraction(text: str) -> float:
    """:func:`unspaced_fraction` of a whole page, remembered for the last few pages (several
    quality filters ask it of the same page)."""
    return unspaced_fraction(text)


class _Blanks(dict):
    """``str.translate`` table: a character of a punctuation, symbol, number, separator or
    other (control, format, unassigned) category becomes a space, any other stays. Filled
    as characters are first seen (a few hundred on most corpora; past 65,536 entries it
    stops remembering), so a text is translated in C instead of by a Python loop over its
    characters (4-5x faster, the same output)."""

    def __missing__(self, code: int):
        value = " " if unicodedata.category(chr(code))[0] in "PSNZC" else code
        if len(self) < 65536:
            self[code] = value
        return value


_BLANKS = _Blanks()


def normalize_for_hash(text: str) -> str:
    """Canonical form for exact-duplicate hashing: NFKC, case-folded, punctuation and
    digits removed, whitespace collapsed. Two pages that differ only in such noise
    hash the same."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(text.translate(_BLANKS).split())


@functools.lru_cache(maxsize=4)  # asked of the same page by several quality filters
def is_unspaced(text: str, lang: str | None = None) -> bool:
    """Whether ``text`` is mostly written without spaces between words.

    Word-length and stop-word rules, and n-gram sizes measured in words, only
    mean what they were designed to mean on spaced text. The detected language
    decides when it is a known unspaced one; otherwise the script does (Korean,
    for instance, is spaced but its syllables are split one per word above).
    """
    if lang in UNSPACED_LANGUAGES:
        return True
    return _page_unspaced_fraction(text) >= 0.5


# Characters that end a sentence (or a quoted sentence) across scripts: Latin,
# CJK full-width forms and corner brackets, Arabic/Urdu, Devanagari, Ethiopic,
# Armenian, Myanmar, Khmer, Tibetan.
TERMINAL_PUNCTUATION: tuple[str, ...] = (
    ".", "!", "?", '"', "'", "”", "’", "»", "«",
    "。", "！", "？", "｡", "．", "」", "』",
    "؟", "۔", "।", "॥", "።", "։", "။", "។", "།",
)

# Languages whose prose does not end sentences with punctuation (Thai and Lao
# mark them with a space), so punctuation-based line rules must not apply.
NO_TERMINAL_PUNCTUATION_LANGUAGES = frozenset({"th", "lo"})

_SENTENCE_END_RE = re.compile(r"[.!?؟۔।]+(?=[\s\"'”’»)\]]|$)|[。！？｡]+")


def count_sentences(text: str) -> int:
    """Approximate number of sentences: runs of sentence-ending punctuation.

    Latin-style marks count only when followed by a space, a closing quote or
    the end (so "16.937" or "e.g.x" do not split); CJK full stops count
    anywhere, since no space follows them. Hand-written rather than NLTK's Punkt
    because Punkt needs per-language model downloads and knows no CJK; the C4
    rule only needs a count, not sentence boundaries.
    """
    count = len(_SENTENCE_END_RE.findall(text))
    # A final sentence without a closing mark still counts as one.
    if text.strip() and not text.rstrip().endswith(TERMINAL_PUNCTUATION):
        count += 1
    return count


# Very frequent function words per language, for the Gopher "at least two stop
# words" rule: real prose of any length contains several, navigation menus,
# keyword lists and tables usually contain none. English is Gopher's list;
# the others are the same kind of words (articles, "to be"/"to have", common
# prepositions and conjunctions).
STOP_WORDS: dict[str, frozenset[str]] = {
    "en": frozenset({"the", "be", "to", "of", "and", "that", "have", "with"}),
    "de": frozenset({"der", "die", "das", "und", "zu", "von", "mit", "ist", "sein", "haben",
                     "den", "dem", "des", "ein", "eine", "nicht", "sich", "auf", "für", "im"}),
    "fr": frozenset({"le", "la", "les", "de", "des", "du", "et", "à", "un", "une", "que",
                     "est", "être", "avoir", "avec", "pour", "dans", "en", "sur"}),
    "es": frozenset({"el", "la", "los", "las", "de", "del", "y", "que", "a", "en", "un",
                     "una", "ser", "es", "con", "por", "para", "se"}),
    "it": frozenset({"il", "lo", "la", "le", "gli", "di", "e", "che", "un", "una", "è",
                     "essere", "avere", "con", "per", "del", "della", "in"}),
    "pt": frozenset({"o", "a", "os", "as", "de", "do", "da", "e", "que", "um", "uma",
                     "ser", "é", "com", "em", "para", "no", "na"}),
    "nl": frozenset({"de", "het", "een", "en", "van", "dat", "is", "zijn", "hebben", "met",
                     "te", "in", "op", "voor", "niet"}),
    "ru": frozenset({"и", "в", "не", "на", "что", "с", "быть", "это", "по", "как", "к",
                     "из", "он", "она", "они", "был", "была", "для"}),
    "pl": frozenset({"i", "w", "nie", "na", "że", "z", "się", "do", "jest", "być", "to",
                     "jak", "o", "od", "po"}),
    "sv": frozenset({"och", "att", "det", "som", "en", "ett", "är", "av", "för", "med",
                     "till", "den", "har", "på", "i"}),
}


def stop_words(lang: str | None) -> frozenset[str] | None:
    """The stop-word list for ``lang``, or None where there is none (the rule is skipped)."""
    if lang is None:
        return None
    return STOP_WORDS.get(lang)
