"""Language identification with the bundled lid.176 model on real sentences and WARC samples."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy
import pydantic
import pytest

import crawl2chat.stages.data
from crawl2chat.stages.data.langid import LanguageId, bundled_model_path, load_model, predict_languages
from crawl2chat.stages.data.settings import LangIdConfig
from crawl2chat.stages.data.warc_input import WarcReader

WARC_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "warc"

LID_176_SHA256 = "8f3472cfe8738a7b6099e8e999c3cbfae0dcd15696aac7d7738a8039db603e83"

SENTENCES = {
    "en": "The committee will publish its annual report on public transport next week.",
    "de": "Der Ausschuss veröffentlicht nächste Woche seinen Jahresbericht über den öffentlichen Nahverkehr.",
    "ja": "委員会は来週、公共交通機関に関する年次報告書を発表する予定です。",
    "zh": "委员会将于下周发布关于公共交通的年度报告，欢迎市民查阅。",
    "ru": "Комитет опубликует свой ежегодный доклад об общественном транспорте на следующей неделе.",
}


def test_model_is_the_bundled_file_and_loaded_once():
    assert Path(bundled_model_path()).is_file()
    assert load_model() is load_model()


def test_bundled_model_ships_with_its_licence():
    """lid.176.ftz is package data of crawl2chat (never downloaded), with its CC BY-SA 3.0 notice."""
    path = Path(bundled_model_path())
    assert path.parent == Path(crawl2chat.stages.data.__file__).parent / "models"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == LID_176_SHA256
    notice = path.with_name("lid.176.NOTICE.md").read_text(encoding="utf-8")
    assert "CC BY-SA 3.0" in notice and LID_176_SHA256 in notice
    assert len(load_model().get_labels()) == 176


@pytest.mark.parametrize("lang", sorted(SENTENCES))
def test_single_documents_are_identified(lang):
    block = LanguageId()
    [doc] = list(block.run([{"text": SENTENCES[lang], "drop_reason": None}]))
    assert doc["lang"] == lang and doc["lang_score"] >= 0.65 and doc["drop_reason"] is None


def test_batch_prediction_under_numpy_2():
    assert int(numpy.__version__.split(".")[0]) >= 2  # the case upstream fastText 0.9.2's predict broke on
    texts = list(SENTENCES.values()) + ["Zeile eins\nZeile zwei ist auch auf Deutsch geschrieben.\n"]
    results = predict_languages(texts)
    assert [lang for lang, _ in results] == list(SENTENCES) + ["de"]
    assert all(isinstance(score, float) and 0.0 <= score <= 1.0 for _, score in results)


def test_drops_low_confidence_and_unwanted_languages():
    block = LanguageId(LangIdConfig(languages=["en", "de"]))
    docs = [
        {"text": SENTENCES["ja"], "drop_reason": None},
        {"text": SENTENCES["de"], "drop_reason": None},
        {"text": "ok 42", "drop_reason": None},
        {"text": "", "drop_reason": None},
        {"text": "", "drop_reason": "extract:empty_body"},  # already dropped: left alone
    ]
    out = list(block.run(docs))
    assert [d["drop_reason"] for d in out] == [
        "langid:not_allowed_language", None, "langid:low_confidence", "langid:low_confidence",
        "extract:empty_body",
    ]
    assert out[0]["lang"] == "ja" and out[3]["lang"] == "unknown" and "lang" not in out[4]
    assert block.stats["seen"] == 4 and block.stats["kept"] == 1


def test_long_text_is_classified_on_its_prefix():
    text = SENTENCES["de"] + " " + " ".join([SENTENCES["en"]] * 500)
    [doc] = list(LanguageId(LangIdConfig(prefix_chars=100)).run([{"text": text, "drop_reason": None}]))
    assert doc["lang"] == "de"


def test_config_defaults_and_validation():
    config = LangIdConfig()
    assert config.min_score == 0.65 and config.languages is None and config.model_path is None
    with pytest.raises(pydantic.ValidationError):
        LangIdConfig(min_score=1.5)
    with pytest.raises(pydantic.ValidationError):
        LangIdConfig(threshold=0.5)


def test_model_path_override_uses_the_given_file(tmp_path):
    copy = tmp_path / "lid.ftz"
    copy.write_bytes(Path(bundled_model_path()).read_bytes())
    [doc] = list(LanguageId(LangIdConfig(model_path=str(copy))).run([{"text": SENTENCES["ru"], "drop_reason": None}]))
    assert doc["lang"] == "ru"


needs_data = pytest.mark.skipif(not WARC_DATA.is_dir(), reason="shared WARC samples not present")


def languages_of(path: Path) -> list[str]:
    block = LanguageId()
    return [d["lang"] for d in block.run(WarcReader().run(str(path))) if "lang" in d]


@needs_data
def test_warc_samples_languages():
    assert languages_of(WARC_DATA / "cc_net/sample.warc.wet.txt") == ["en", "zh", "ru"]
    ja = languages_of(WARC_DATA / "resiliparse/clueweb-quirk.warc.gz")
    assert ja.count("ja") == len(ja) == 29
    zh = languages_of(WARC_DATA / "resiliparse/warcfile.warc.gz")
    assert zh.count("zh") >= len(zh) // 2
    en = languages_of(WARC_DATA / "dolma/sample-0000.warc.gz")
    assert en.count("en") >= 20
    # Aragonese Wikipedia: the full lid.176.bin says "an"; the compressed model bundled here
    # names its close neighbour Spanish.
    assert languages_of(WARC_DATA / "whirlwind/whirlwind.warc.wet.gz")[0] in ("an", "es")
