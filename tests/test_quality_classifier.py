"""The hashed n-gram quality classifier: training from files, safe save/load, the filter block."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crawl2chat.stages.data.quality import build_quality_blocks
from crawl2chat.stages.data.settings import QualityConfig
from crawl2chat.stages.data.quality_classifier import PARAMS_FILE, WEIGHTS_FILE, QualityClassifier, QualityClassifierFilter, train_quality_classifier
from crawl2chat.stages.data.settings import QualityClassifierConfig

# Sentence material for "good" documents, in four languages.
GOOD_SENTENCES = [
    "The river flows through the old town before it reaches the sea.",
    "Researchers at the university published their results in a scientific journal last year.",
    "The museum displays paintings from the early modern period and hosts regular lectures.",
    "Farmers in the valley grow wheat, barley and apples on terraced fields.",
    "The committee discussed the proposal at length and agreed to revise the budget.",
    "Der Bahnhof wurde im neunzehnten Jahrhundert gebaut und später mehrfach erweitert.",
    "Die Bibliothek besitzt eine bedeutende Sammlung mittelalterlicher Handschriften.",
    "Im Sommer kommen viele Besucher, um am See zu wandern und die Berge zu sehen.",
    "この町は江戸時代から港町として栄え、多くの商人が行き交った。",
    "研究チームは新しい観測結果を学会で発表し、大きな注目を集めた。",
    "図書館では地域の歴史に関する資料を無料で閲覧することができる。",
    "这座城市位于河流的下游，自古以来就是重要的交通枢纽。",
    "研究人员对当地的气候变化进行了长期观测，并发表了详细的报告。",
    "博物馆收藏了大量古代陶器和书画作品，每年吸引众多游客。",
]

# Material for "bad" documents: spam, navigation, keyword stuffing, in several languages.
BAD_FRAGMENTS = [
    "BUY NOW!!! cheap pills $$$ best price", "CLICK HERE free casino bonus >>>", "Home | About | Contact | Login",
    "viagra cialis cheap online pharmacy", "WIN WIN WIN iPhone giveaway 100% free", "Jetzt kaufen!!! Gratis Bonus",
    "Startseite | Impressum | Kontakt | Warenkorb", "今すぐ登録 無料 ボーナス 激安 最安値 ★★★",
    "ホーム | 会社概要 | お問い合わせ", "免费领取 点击这里 >>> 优惠 大促销 !!!", "首页 | 关于我们 | 联系我们 | 登录",
    "sexy singles in your area click", "download crack keygen serial free", "$$$ make money fast $$$",
]


def good_doc(rng: random.Random) -> str:
    return " ".join(rng.sample(GOOD_SENTENCES, 4))


def bad_doc(rng: random.Random) -> str:
    return " ".join(rng.sample(BAD_FRAGMENTS, 4))


@pytest.fixture(scope="module")
def example_files(tmp_path_factory):
    """Positives as .txt and Parquet, negatives as JSONL with some bad lines mixed in."""
    root = tmp_path_factory.mktemp("quality_examples")
    rng = random.Random(1)
    (root / "good.txt").write_text("\n".join(good_doc(rng) for _ in range(150)) + "\n\n", encoding="utf-8")
    pq.write_table(pa.table({"text": [good_doc(rng) for _ in range(100)] + [None]}), root / "good.parquet")
    lines = [json.dumps({"text": bad_doc(rng)}, ensure_ascii=False) for _ in range(250)]
    lines[10] = "{not json"
    lines[20] = ""
    lines[30] = json.dumps({"body": "no text field"})
    lines[40] = json.dumps({"text": "   "})
    (root / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def trained(example_files, tmp_path_factory):
    cfg = QualityClassifierConfig(
        enabled=True,
        positive_files=[str(example_files / "good.txt"), str(example_files / "good.parquet")],
        negative_files=[str(example_files / "bad.jsonl")],
        model_dir=str(tmp_path_factory.mktemp("model")),
        hash_buckets=2**16,
    )
    return cfg, train_quality_classifier(cfg)


def test_training_reads_all_formats_and_counts_bad_lines(trained):
    _, metrics = trained
    assert metrics["n_pos"] == 250
    assert metrics["n_neg"] == 246
    # One blank line in good.txt, one blank and one whitespace-only line in bad.jsonl.
    assert metrics["skipped_empty"] == 3
    assert metrics["skipped_malformed_json"] == 1
    assert metrics["skipped_missing_text"] == 2  # the JSON line without `text` and the Parquet null
    assert metrics["n_train"] + metrics["n_heldout"] == 496 and metrics["n_heldout"] == 50


def test_separable_data_is_learned(trained):
    _, metrics = trained
    assert metrics["train_accuracy"] >= 0.99
    assert metrics["heldout_accuracy"] >= 0.95


def test_unseen_documents_are_ranked(trained):
    cfg, _ = trained
    model = QualityClassifier.load(cfg.model_dir)
    rng = random.Random(99)
    good = [good_doc(rng) for _ in range(20)]
    bad = [bad_doc(rng) for _ in range(20)]
    probs = model.predict_proba(good + bad)
    assert probs.shape == (40,) and np.all((probs >= 0) & (probs <= 1))
    assert probs[:20].min() > 0.5 > probs[20:].max()


def test_save_load_round_trip_is_exact(trained, tmp_path):
    cfg, _ = trained
    model = QualityClassifier.load(cfg.model_dir)
    model.save(tmp_path)
    again = QualityClassifier.load(tmp_path)
    texts = ["Die Bibliothek besitzt eine bedeutende Sammlung.", "CLICK HERE free casino bonus >>>", ""]
    assert np.array_equal(model.predict_proba(texts), again.predict_proba(texts))
    # Only JSON and safetensors are written: nothing that unpickles code on load.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([PARAMS_FILE, WEIGHTS_FILE])


def test_tampered_parameters_are_refused(trained, tmp_path):
    cfg, _ = trained
    QualityClassifier.load(cfg.model_dir).save(tmp_path)
    meta = json.loads((tmp_path / PARAMS_FILE).read_text())
    meta["word"]["preprocessor"] = "os.system"
    (tmp_path / PARAMS_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unsupported"):
        QualityClassifier.load(tmp_path)


def test_filter_block_scores_and_drops(trained):
    cfg, _ = trained
    rng = random.Random(7)
    docs = [{"id": str(i), "text": good_doc(rng) if i % 2 == 0 else bad_doc(rng), "lang": "en",
             "drop_reason": None} for i in range(10)]
    docs.append({"id": "gone", "text": "x", "drop_reason": "langid:low_score"})
    docs.append({"id": "none", "text": None, "drop_reason": None})
    block = QualityClassifierFilter(cfg, batch_size=4)
    out = list(block.run(docs))
    assert [d["id"] for d in out] == [d["id"] for d in docs]  # order kept across batches
    for doc in out[:10]:
        if int(doc["id"]) % 2 == 0:
            assert doc["drop_reason"] is None and doc["quality_score"] >= 0.5
        else:
            assert doc["drop_reason"] == "quality_classifier:below_threshold" and doc["quality_score"] < 0.5
    assert out[10]["drop_reason"] == "langid:low_score" and "quality_score" not in out[10]
    assert out[11]["drop_reason"] == "quality_classifier:no_text"
    assert block.stats == {"seen": 11, "kept": 5, "dropped:below_threshold": 5, "dropped:no_text": 1}


def test_classifier_is_the_last_quality_block(trained):
    cfg, _ = trained
    blocks = build_quality_blocks(QualityConfig(classifier=cfg))
    assert [b.name for b in blocks][-1] == "quality_classifier"


def test_no_usable_examples_is_a_clear_error(tmp_path):
    (tmp_path / "good.txt").write_text("A fine sentence about the river and the town.\n", encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text("{broken\n\n", encoding="utf-8")
    cfg = QualityClassifierConfig(
        positive_files=[str(tmp_path / "good.txt")], negative_files=[str(tmp_path / "bad.jsonl")],
        model_dir=str(tmp_path / "model"), hash_buckets=2**12,
    )
    with pytest.raises(ValueError, match="no usable negative examples"):
        train_quality_classifier(cfg)
