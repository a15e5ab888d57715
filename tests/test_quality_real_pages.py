"""The quality filters on real crawled pages: the documents kept and every drop reason stay
exactly what the rules decide, and the fast paths count what the plain definitions count."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from crawl2chat.stages.data.harmful import HarmfulContentFilter
from crawl2chat.stages.data.langid import LanguageId
from crawl2chat.stages.data.quality import _SYMBOL_TOKEN_RE, build_quality_blocks
from crawl2chat.stages.data.settings import QualityConfig
from crawl2chat.stages.data.text import page_words, split_words
from crawl2chat.stages.data.warc_input import WarcReader

WARC_FILES = (
    "dolma/sample-0000.warc.gz",  # English (allenai.org, semanticscholar.org)
    "dolma/sample-0001.warc.gz",
    "resiliparse/clueweb-quirk.warc.gz",  # Japanese
    "resiliparse/warcfile.warc.gz",  # Chinese, from Common Crawl
)

# Drop reasons of the 82 pages language ID keeps, with the default rules, and a digest
# of every "id reason" pair (sorted). A rule change that moves any page changes them.
EXPECTED_REASONS = {
    "c4:empty": 2, "c4:too_few_sentences": 2, "fineweb:short_line_ratio": 3,
    "gopher_quality:too_few_alpha_words": 1, "gopher_quality:too_few_words": 4,
    "gopher_quality:too_many_bullet_lines": 1, "gopher_repetition:dup_para_char_frac": 1,
    "gopher_repetition:duplicated_5_n_grams": 3, "gopher_repetition:top_2_gram": 1, "kept": 64,
}
EXPECTED_DIGEST = "7db5d19f52abcb04fbaf9278dee8c0b4d24f2c2500b911077c45ba8b1ddebcbc"


@pytest.fixture(scope="module")
def pages(shared_data) -> list[dict]:
    files = [shared_data / "warc" / name for name in WARC_FILES]
    if not all(f.is_file() for f in files):
        pytest.skip("the real WARC samples are not in the shared data")
    docs = [doc for f in files for doc in WarcReader().run(str(f))]
    return [doc for doc in LanguageId().run(docs) if not doc["drop_reason"]]


def test_real_pages_keep_the_same_documents_for_the_same_reasons(pages):
    docs = iter([dict(doc) for doc in pages])
    for block in build_quality_blocks(QualityConfig()):
        docs = block.run(docs)
    judged = list(docs)
    assert dict(Counter(d["drop_reason"] or "kept" for d in judged)) == EXPECTED_REASONS
    pairs = "\n".join(sorted(f"{d['id']} {d['drop_reason']}" for d in judged))
    assert hashlib.sha256(pairs.encode()).hexdigest() == EXPECTED_DIGEST


def test_symbol_tokens_are_the_tokens_without_a_letter_or_digit(pages):
    texts = [doc["text"] for doc in pages] + ["| » ★★★ -- __ a_b _ 1 ² Ⅷ\u3000… x\u2028#"]
    for text in texts:
        plain = sum(1 for token in text.split() if not any(c.isalnum() for c in token))
        assert len(_SYMBOL_TOKEN_RE.findall(text)) == plain


def test_harmful_phrase_count_is_every_phrase_at_every_position(pages):
    harmful = HarmfulContentFilter()
    words, phrases = harmful.lists["en"]
    # Pages with listed words and phrases (some overlapping, some at the very end).
    texts = [doc["text"] for doc in pages] + [
        " ".join(w for phrase in phrases for w in phrase),
        " ".join(phrases[0] + phrases[0][:1] + phrases[-1]),
        " ".join(phrases[-1][:-1]),
    ]
    for text in texts:
        tokens = [w.lower() for w in split_words(text)]
        found = sum(t in words for t in tokens)
        for phrase in phrases:
            n = len(phrase)
            found += sum(1 for i in range(len(tokens) - n + 1) if tuple(tokens[i:i + n]) == phrase)
        assert harmful.matches(text, "en") == (found, len(tokens))
        assert list(page_words(text)) == split_words(text)
