"""The fastText quality classifier: training from files, standard .bin models both ways, the filter block."""

from __future__ import annotations

import json
import random

import fasttext
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest

from crawl2chat.stages.data.langid import bundled_model_path
from crawl2chat.stages.data.pipeline import prepare_quality_classifier
from crawl2chat.stages.data.quality import build_quality_blocks
from crawl2chat.stages.data.quality_classifier import QualityClassifier, QualityClassifierFilter, train_quality_classifier
from crawl2chat.stages.data.settings import QualityClassifierConfig, QualityConfig

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


def _training_config(example_files, **overrides) -> QualityClassifierConfig:
    return QualityClassifierConfig(
        positive_files=[str(example_files / "good.txt"), str(example_files / "good.parquet")],
        negative_files=[str(example_files / "bad.jsonl")],
        bucket=20_000,
        dim=16,
        **overrides,
    )


@pytest.fixture(scope="module")
def trained(example_files, tmp_path_factory):
    cfg = _training_config(example_files)
    path = tmp_path_factory.mktemp("model") / "quality.bin"
    metrics = train_quality_classifier(cfg, path)
    return cfg.model_copy(update={"model": str(path), "positive_files": [], "negative_files": []}), metrics


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
    model = QualityClassifier.load(cfg)
    rng = random.Random(99)
    good = [good_doc(rng) for _ in range(20)]
    bad = [bad_doc(rng) for _ in range(20)]
    probs = model.predict_proba(good + bad)
    assert len(probs) == 40 and all(0.0 <= p <= 1.0 for p in probs)
    assert min(probs[:20]) > 0.5 > max(probs[20:])


def test_our_model_is_a_standard_fasttext_model(trained):
    """The saved .bin is read by plain fastText, which gives the same labels and probabilities."""
    cfg, _ = trained
    plain = fasttext.load_model(cfg.model)
    assert sorted(plain.get_labels()) == ["__label__hq", "__label__lq"]
    assert plain.get_dimension() == 16
    rng = random.Random(5)
    texts = [good_doc(rng), bad_doc(rng), "Die Bibliothek besitzt eine bedeutende Sammlung mittelalterlicher Handschriften."]
    ours = QualityClassifier.load(cfg)
    for text, prob in zip(texts, ours.predict_proba(texts)):
        labels, probs = plain.predict(ours.line(text), k=2)
        assert dict(zip(labels, probs))["__label__hq"] == pytest.approx(prob, abs=1e-6)
    assert plain.predict(ours.line(texts[0]))[0] == ("__label__hq",)
    assert plain.predict(ours.line(texts[1]))[0] == ("__label__lq",)


def test_plain_fasttext_model_filters_through_our_config(tmp_path):
    """A classifier trained with plain ``fasttext.train_supervised`` (own labels, raw text, quantized
    to .ftz) is loaded through ``quality.classifier.model`` and filters with its own label."""
    rng = random.Random(3)
    lines = []
    for _ in range(300):
        lines.append("__label__keep " + good_doc(rng))
        lines.append("__label__spam " + bad_doc(rng))
        lines.append("__label__other " + " ".join(rng.sample(GOOD_SENTENCES, 1) + rng.sample(BAD_FRAGMENTS, 1)))
    rng.shuffle(lines)
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = fasttext.train_supervised(
        input=str(tmp_path / "train.txt"), epoch=10, dim=16, wordNgrams=2, bucket=2_000, thread=1, verbose=0
    )
    model.save_model(str(tmp_path / "plain.bin"))
    model.quantize(input=str(tmp_path / "train.txt"), qnorm=True, retrain=False, cutoff=0)
    model.save_model(str(tmp_path / "plain.ftz"))

    docs_rng = random.Random(11)
    docs = [{"id": str(i), "text": good_doc(docs_rng) if i % 2 == 0 else bad_doc(docs_rng), "drop_reason": None}
            for i in range(20)]
    for name in ("plain.bin", "plain.ftz"):
        cfg = QualityClassifierConfig(
            enabled=True, model=str(tmp_path / name), label="__label__keep", preprocess="whitespace", threshold=0.6
        )
        out = list(QualityClassifierFilter(cfg, batch_size=8).run([dict(d) for d in docs]))
        kept = [d["id"] for d in out if d["drop_reason"] is None]
        assert kept == [str(i) for i in range(0, 20, 2)], name
        assert all(d["quality_score"] >= 0.6 for d in out if d["drop_reason"] is None)

    # Through the pipeline's preparation: the given model is used as is and identified by its file.
    quality = QualityConfig(classifier=QualityClassifierConfig(enabled=True, model=str(tmp_path / "plain.bin"),
                                                               label="__label__keep", preprocess="whitespace"))
    prepared, info, identity = prepare_quality_classifier(quality, str(tmp_path / "work"))
    assert info == {"classifier": "given", "model": str(tmp_path / "plain.bin")}
    assert identity and identity[0][0][0] == str(tmp_path / "plain.bin")
    assert [b.name for b in build_quality_blocks(prepared)][-1] == "quality_classifier"


def test_pipeline_trains_once_and_retrains_when_examples_change(example_files, tmp_path):
    files = tmp_path / "examples"
    files.mkdir()
    for name in ("good.txt", "good.parquet", "bad.jsonl"):
        (files / name).write_bytes((example_files / name).read_bytes())
    quality = QualityConfig(classifier=_training_config(files, enabled=True, epoch=5))
    first, info, _ = prepare_quality_classifier(quality, str(tmp_path))
    assert info["classifier"] == "trained" and info["heldout_accuracy"] >= 0.95
    path = first.classifier.model
    assert path.endswith(".bin") and fasttext.load_model(path).get_labels()
    again, info, _ = prepare_quality_classifier(quality, str(tmp_path))
    assert info == {"classifier": "reused", "model": path} and again.classifier.model == path
    with open(files / "bad.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "FREE BONUS click here now"}) + "\n")
    changed, info, _ = prepare_quality_classifier(quality, str(tmp_path))
    assert info["classifier"] == "trained" and changed.classifier.model != path


def test_training_is_repeatable_with_one_thread(example_files, tmp_path):
    cfg = _training_config(example_files, epoch=3)
    train_quality_classifier(cfg, tmp_path / "a.bin")
    train_quality_classifier(cfg, tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]  # no temporary files left


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
    blocks = build_quality_blocks(QualityConfig(classifier=cfg.model_copy(update={"enabled": True})))
    assert [b.name for b in blocks][-1] == "quality_classifier"


def test_wrong_label_or_file_is_a_clear_error(trained, tmp_path):
    cfg, _ = trained
    with pytest.raises(ValueError, match=r"label '__label__good' is not a label of .*quality.bin.*__label__hq"):
        QualityClassifier.load(cfg.model_copy(update={"label": "__label__good"}))
    with pytest.raises(ValueError, match=r"label '__label__hq' is not a label of .*lid.176.ftz.*__label__en"):
        QualityClassifier.load(cfg.model_copy(update={"model": bundled_model_path()}))
    (tmp_path / "model.bin").write_text("not a model", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.quality.classifier.model: .*model.bin is not a fastText model"):
        QualityClassifier.load(cfg.model_copy(update={"model": str(tmp_path / "model.bin")}))
    with pytest.raises(FileNotFoundError, match=r"data.quality.classifier.model: .*missing.bin"):
        QualityClassifier.load(cfg.model_copy(update={"model": str(tmp_path / "missing.bin")}))


def test_config_refuses_ambiguous_or_retired_settings():
    with pytest.raises(pydantic.ValidationError, match="either `model`"):
        QualityClassifierConfig(model="q.bin", positive_files=["good.txt"])
    with pytest.raises(pydantic.ValidationError, match="neither `model`"):
        QualityClassifierConfig(enabled=True, positive_files=["good.txt"])
    with pytest.raises(pydantic.ValidationError, match="must start with '__label__'"):
        QualityClassifierConfig(positive_files=["g"], negative_files=["b"], label="hq")
    for retired in ("hash_buckets", "l2", "model_dir", "epochs"):
        with pytest.raises(pydantic.ValidationError, match=retired):
            QualityClassifierConfig(**{retired: 1})


def test_no_usable_examples_is_a_clear_error(tmp_path):
    (tmp_path / "good.txt").write_text("A fine sentence about the river and the town.\n", encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text("{broken\n\n", encoding="utf-8")
    cfg = QualityClassifierConfig(
        positive_files=[str(tmp_path / "good.txt")], negative_files=[str(tmp_path / "bad.jsonl")], bucket=1000,
    )
    with pytest.raises(ValueError, match="no usable negative examples"):
        train_quality_classifier(cfg, tmp_path / "model.bin")
    assert not (tmp_path / "model.bin").exists()
