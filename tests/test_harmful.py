"""Harmful-content filter: the shipped English list drops a page full of listed words
but not one with a stray hit, judges each page by its own language's list (an
English list never drops a German page; a user's German or Chinese list does), and
a real fastText classifier trained here drops what it scores as harmful."""

from __future__ import annotations

import pytest

from crawl2chat.stages.data.harmful import HarmfulContentFilter
from crawl2chat.stages.data.quality import build_quality_blocks
from crawl2chat.stages.data.settings import HarmfulConfig, QualityConfig

CLEAN = ("The river town market opened early and people walked along the old stone bridge while boats "
         "carried fish bread and wine from the farms in the valley. ") * 3


def run(block, docs):
    return [d["drop_reason"] for d in block.run([dict(d, drop_reason=None) for d in docs])]


def test_listed_words_drop_a_page_only_in_number_and_in_its_language(tmp_path):
    abusive = CLEAN + " bitch bastard asshole bullshit " * 3
    stray = CLEAN.replace("walked", "walked, a bastard of a day,", 1)  # one hit among ~90 words
    german = "Der Stadtrat beschloss einen neuen Haushalt. bitch bastard asshole bullshit " * 2
    block = HarmfulContentFilter(HarmfulConfig())
    assert run(block, [{"text": abusive, "lang": "en"}, {"text": stray, "lang": "en"},
                       {"text": german, "lang": "de"}]) == ["harmful:word_list", None, None]
    assert block.stats["not_judged:no_word_list"] == 1

    de = tmp_path / "de.txt"
    de.write_text("# eine Liste\nmistkerl\nblöde kuh\n", encoding="utf-8")
    zh = tmp_path / "zh.txt"
    zh.write_text("混蛋\n", encoding="utf-8")
    block = HarmfulContentFilter(HarmfulConfig(word_lists={"de": str(de), "zh": str(zh)}))
    rude = "Du Mistkerl, du blöde Kuh, Mistkerl! Der Rat tagte heute lange."
    assert run(block, [{"text": rude, "lang": "de"}, {"text": "你这个混蛋混蛋混蛋", "lang": "zh"},
                       {"text": "市政府讨论了城市交通问题", "lang": "zh"}, {"text": abusive, "lang": "en"}]) == [
        "harmful:word_list", "harmful:word_list", None, None]  # no English list given: English is not judged


def test_thresholds_are_settings():
    text = CLEAN + " bastard bastard"
    assert run(HarmfulContentFilter(HarmfulConfig(min_matches=2, max_word_fraction=0.01)),
               [{"text": text, "lang": "en"}]) == ["harmful:word_list"]
    assert run(HarmfulContentFilter(HarmfulConfig(min_matches=3, max_word_fraction=0.01)),
               [{"text": text, "lang": "en"}]) == [None]
    assert not any(b.name == "harmful" for b in build_quality_blocks(QualityConfig(harmful={"enabled": False})))
    assert any(b.name == "harmful" for b in build_quality_blocks(QualityConfig()))


def test_a_fasttext_classifier_drops_what_it_scores_harmful(tmp_path):
    import fasttext

    train = tmp_path / "train.txt"
    lines = [f"__label__harmful you are worthless and i will hurt you {i}" for i in range(40)]
    lines += [f"__label__ok the weather in the valley is mild today {i}" for i in range(40)]
    train.write_text("\n".join(lines) + "\n")
    model = fasttext.train_supervised(str(train), epoch=30, lr=0.5, wordNgrams=1, minCount=1, verbose=0, seed=0,
                                      thread=1)
    path = tmp_path / "harmful.bin"
    model.save_model(str(path))
    block = HarmfulContentFilter(HarmfulConfig(word_lists={}, classifier_model=str(path)))
    assert run(block, [{"text": "i will hurt you, you are worthless", "lang": "en"},
                       {"text": "the weather in the valley is mild", "lang": "en"}]) == ["harmful:classifier", None]
    with pytest.raises(ValueError, match="classifier_label '__label__toxic' is not a label"):
        HarmfulContentFilter(HarmfulConfig(word_lists={}, classifier_model=str(path),
                                           classifier_label="__label__toxic"))


def test_a_missing_list_names_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.quality\.harmful\.word_lists\.fr"):
        HarmfulContentFilter(HarmfulConfig(word_lists={"fr": str(tmp_path / "absent.txt")}))


SHAKESPEARE = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="shared Tiny Shakespeare not present")
def test_the_shipped_list_leaves_ordinary_text_alone():
    """Shakespeare in 40-line pages (murder, gods, virgins and all) and the words of the
    Python documentation the original list matched: nothing is dropped."""
    lines = SHAKESPEARE.read_text().splitlines()
    pages = [{"text": "\n".join(lines[i:i + 40]), "lang": "en"} for i in range(0, len(lines), 40)]
    assert len(pages) > 900
    drops = [d for d in run(HarmfulContentFilter(HarmfulConfig()), pages) if d]
    assert drops == [], drops
    docs = "Return len(x). Strip the string, kill the process, a dummy slave connection, foobar. " * 5
    assert run(HarmfulContentFilter(HarmfulConfig()), [{"text": docs, "lang": "en"}]) == [None]
