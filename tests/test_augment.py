"""Data augmentation in the data stage: noise, synonyms and back-translation as new rows
with provenance, reproducible per document, and never across the held-out split."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crawl2chat.stages.data import augment as A
from crawl2chat.stages.data import pipeline as steps
from crawl2chat.stages.data.versions import shard_files
from crawl2chat.stages.settings import SettingsError, load_config
from crawl2chat.stages.training.heldout import HeldOutSplit, held_out_rows, training_rows
from crawl2chat.stages.training.packing import is_validation, pack_shards

from test_data_pipeline import PROSE, run_all, write_warc

WORDS = sorted(set(PROSE))


def synonym_file(path: Path) -> Path:
    path.write_text("# town words\nriver\tstream,brook\nold\tancient\nmarket\tbazaar, fair\n\nmorning\tdawn\n",
                    encoding="utf-8")
    return path


def augment_cfg(**overrides):
    flat = {"data.augment.enabled": True, **{f"data.augment.{k}": v for k, v in overrides.items()}}
    return load_config(overrides=flat).data.augment


# --------------------------------------------------------------------------- methods


def test_noise_rates_are_roughly_respected_on_a_large_sample():
    words = [f"w{i}" for i in range(20000)]
    text = "\n".join(" ".join(words[i:i + 50]) for i in range(0, len(words), 50))

    dropped = A.noise_text(text, random.Random(1), 0, 0, 0.1, 0).split()
    assert abs(1 - len(dropped) / len(words) - 0.1) < 0.01

    swapped = A.noise_text(text, random.Random(2), 0, 0, 0, 0.1).split()
    assert sorted(swapped) == sorted(words)
    moved = sum(a != b for a, b in zip(swapped, words)) / len(words)
    assert abs(moved - 2 * 0.1 / 1.1) < 0.02  # each swap moves two words; a swapped pair is not swapped again

    chars = "".join(words)
    kept = "".join(A.noise_text(text, random.Random(3), 0.05, 0, 0, 0).split())
    assert abs(1 - len(kept) / len(chars) - 0.05) < 0.005

    one_word = "abcdefghij " * 2000
    swapped_chars = A.noise_text(one_word, random.Random(4), 0, 0.1, 0, 0).split()
    changed = sum(a != b for w in swapped_chars for a, b in zip(w, "abcdefghij")) / (10 * 2000)
    assert 0.1 < changed < 0.2  # 9 pairs a word, swaps of p=0.1 touching two letters each


def test_lines_and_at_least_one_word_per_line_are_kept():
    text = "one two three\n\nfour five\nsix"
    out = A.noise_text(text, random.Random(0), 0, 0, 1.0, 0)
    assert out.split("\n") == ["one", "", "four", "six"]


def test_synonyms_replace_listed_words_keeping_case(tmp_path):
    table = A.load_word_list(str(synonym_file(tmp_path / "syn.tsv")))
    assert table == {"river": ["stream", "brook"], "old": ["ancient"], "market": ["bazaar", "fair"],
                     "morning": ["dawn"]}
    out = A.synonym_text("The Old river and the OLD market.", random.Random(0), table, 1.0)
    assert out.startswith("The Ancient ") and "ANCIENT" in out and "river" not in out and out.endswith(".")
    rate = A.synonym_text("old " * 10000, random.Random(5), table, 0.3).split().count("ancient") / 10000
    assert abs(rate - 0.3) < 0.02


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("", "holds no entry"),
    ("# only a comment\n", "holds no entry"),
    ("river stream,brook\n", "line 1 is not `word<TAB>synonym1,synonym2`"),
    ("river\tstream\nold\t\n", "line 2"),
    ("two words\tsynonym\n", "line 1"),
    (b"\xff\xfe\x00river", "is not UTF-8"),
])
def test_a_missing_or_malformed_word_list_is_refused_naming_the_setting(tmp_path, content, message):
    path = tmp_path / "syn.tsv"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(A.AugmentSettingsError, match="data.augment.synonym.word_list") as err:
        A.prepare(augment_cfg(**{"synonym.enabled": True, "synonym.word_list": str(path)}))
    assert message in str(err.value)


def test_settings_that_cannot_work_are_refused():
    for overrides, field in (({}, "data.augment"),  # enabled without a method
                             ({"synonym.enabled": True}, "data.augment.synonym"),
                             ({"back_translation.enabled": True}, "data.augment.back_translation"),
                             ({"noise.enabled": True, "noise.char_drop_rate": 0, "noise.char_swap_rate": 0,
                               "noise.word_drop_rate": 0, "noise.word_swap_rate": 0}, "data.augment.noise"),
                             ({"noise.enabled": True, "noise.word_drop_rate": 1.5}, "data.augment.noise.word_drop_rate"),
                             ({"noise.enabled": True, "fraction": 0}, "data.augment.fraction")):
        with pytest.raises(SettingsError, match=field.replace(".", r"\.")):
            augment_cfg(**overrides)
    with pytest.raises(A.AugmentSettingsError, match="data.augment.back_translation.forward_model"):
        A.prepare(augment_cfg(**{"back_translation.enabled": True, "back_translation.forward_model": "/nowhere",
                                 "back_translation.backward_model": "/nowhere"}))
    assert load_config().data.augment.enabled is False


def _docs(n: int) -> list[dict]:
    rng = random.Random(7)
    return [{"id": f"doc-{i}", "url": f"http://x.example/{i}", "lang": "en", "source": "a.warc.gz",
             "sample_weight": 0.5 + i, "text": "\n".join(" ".join(rng.choice(WORDS) for _ in range(12))
                                                         for _ in range(3))}
            for i in range(n)]


def test_rows_are_identical_whatever_the_batching_and_carry_provenance(tmp_path):
    cfg, _ = A.prepare(augment_cfg(**{"noise.enabled": True, "synonym.enabled": True, "synonym.rate": 1.0,
                                      "synonym.word_list": str(synonym_file(tmp_path / "syn.tsv"))}))
    docs = _docs(20)
    table = pa.Table.from_pylist(docs)
    whole = A.AugmentBatch(cfg, table.schema.names)(table).to_pylist()
    parts = []
    for s in (slice(0, 7), slice(7, 20)):
        parts += A.AugmentBatch(cfg, table.schema.names)(pa.Table.from_pylist(docs[s])).to_pylist()
    assert sorted(map(json.dumps, whole)) == sorted(map(json.dumps, parts))

    originals = {d["id"]: d for d in docs}
    new = [r for r in whole if r["augmented_from"]]
    assert Counter(r["augment_method"] for r in new) == {"noise": 20, "synonym": 20}
    for r in new:
        src = originals[r["augmented_from"]]
        assert r["id"] == A.augmented_id(src["id"], r["augment_method"], 0) and r["id"] not in originals
        assert r["text"] != src["text"]
        assert {k: r[k] for k in ("url", "lang", "source", "sample_weight")} == {
            k: src[k] for k in ("url", "lang", "source", "sample_weight")}
    assert len({r["id"] for r in whole}) == len(whole)

    other_seed, _ = A.prepare(cfg.model_copy(update={"seed": 1}))
    reseeded = A.AugmentBatch(other_seed, table.schema.names)(table).to_pylist()
    assert {r["id"] for r in reseeded if r["augmented_from"]}.isdisjoint({r["id"] for r in new})

    half = A.AugmentBatch(cfg.model_copy(update={"fraction": 0.5, "held_out_fraction": 0.3}),
                          table.schema.names)(table).to_pylist()
    sources = {r["augmented_from"] for r in half if r["augmented_from"]}
    assert 0 < len(sources) < 20 and not any(is_validation(s, 0.3) for s in sources)


# --------------------------------------------------------------------------- back-translation models


def tiny_t5(folder: Path, pairs: list[tuple[str, str]], steps_: int = 40) -> Path:
    """A one-layer T5 with a word-level tokenizer, trained a few steps on ``pairs``."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for src, tgt in pairs:
        for w in (src + " " + tgt).split():
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps_):
        batch = pairs[(step * 8) % len(pairs):][:8]
        enc = fast([s for s, _ in batch], return_tensors="pt", padding=True)
        labels = fast([t for _, t in batch], return_tensors="pt", padding=True)["input_ids"]
        labels[labels == 0] = -100
        loss = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def translators(tmp_path_factory):
    root = tmp_path_factory.mktemp("bt")
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8))) for _ in range(64)]
    foreign = [" ".join(w[::-1] for w in s.split()) for s in sentences]
    forward = tiny_t5(root / "forward", list(zip(sentences, foreign)))
    backward = tiny_t5(root / "backward", list(zip(foreign, sentences)))
    return forward, backward


def test_back_translation_round_trips_lines_in_batches(translators, tmp_path):
    forward, backward = translators
    cfg, identity = A.prepare(augment_cfg(**{"back_translation.enabled": True,
                                             "back_translation.forward_model": str(forward),
                                             "back_translation.backward_model": str(backward),
                                             "back_translation.batch_size": 4, "back_translation.max_new_tokens": 6,
                                             "back_translation.max_segments": 2, "back_translation.device": "cpu"}))
    assert len(identity) == 2
    docs = _docs(5)
    out = A.BackTranslator(cfg.back_translation)([d["text"] for d in docs])
    assert len(out) == 5
    for text in out:
        lines = text.split("\n")
        assert 1 <= len(lines) <= 2  # max_segments
        assert all(len(line.split()) <= 6 for line in lines)  # max_new_tokens (one token a word)
    assert out == A.BackTranslator(cfg.back_translation)([d["text"] for d in docs])  # greedy: the same again


# --------------------------------------------------------------------------- the data stage, packing


@pytest.fixture(scope="module")
def augmented_version(ray_local, translators, tmp_path_factory):
    forward, backward = translators
    root = tmp_path_factory.mktemp("aug")
    write_warc(root / "in" / "a.warc.gz", range(16))
    out = root / "data"
    cfg = load_config(overrides={
        "data.out": str(out), "data.dedup.num_shards": 4,
        "data.augment.enabled": True, "data.augment.noise.enabled": True,
        "data.augment.synonym.enabled": True, "data.augment.synonym.rate": 1.0,
        "data.augment.synonym.word_list": str(synonym_file(root / "syn.tsv")),
        "data.augment.back_translation.enabled": True,
        "data.augment.back_translation.forward_model": str(forward),
        "data.augment.back_translation.backward_model": str(backward),
        "data.augment.back_translation.max_new_tokens": 8, "data.augment.back_translation.max_segments": 2,
        "data.augment.back_translation.device": "cpu",
    })
    results, _ = run_all(cfg, [str(root / "in" / "a.warc.gz")], out)
    augmented = steps.augment_step(results[-1], str(out / "work"), cfg.data.augment)
    manifest = steps.write_dataset(results + [augmented], str(out), cfg.data.shard_bytes,
                                   cfg.model_dump(mode="json"))
    return cfg, out, results, augmented, manifest


def test_a_data_stage_run_writes_augmented_rows_into_the_version(augmented_version):
    cfg, out, results, augmented, manifest = augmented_version
    originals = results[-1].kept
    assert originals == 16
    added = augmented.extra["augmented"]
    # Noise and synonyms (rate 1) change every page; the tiny translators' round trip may give
    # back an empty or unchanged text, which adds no row.
    assert added["noise"] == added["synonym"] == 16 and 1 <= added["back_translation"] <= 16
    n_added = sum(added.values())
    assert augmented.kept == originals + n_added and augmented.extra["source_documents"] == 16
    assert manifest["augmented"] == {"version_documents_added": n_added, "source_documents": 16,
                                     "by_method": added}
    assert manifest["documents_kept"] == 16 + n_added and manifest["steps"][-1]["name"] == "augment"

    rows = pq.read_table(shard_files(out)).to_pylist()
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == 16 + n_added
    assert Counter(r["augment_method"] for r in rows if r["augment_method"]) == added
    for r in rows:
        if r["augmented_from"] is None:
            assert r["augment_method"] is None
            continue
        src = by_id[r["augmented_from"]]
        assert r["id"] == A.augmented_id(src["id"], r["augment_method"], 0)
        for column in ("url", "lang", "source", "host", "sample_weight", "lang_score", "quality_score"):
            assert r[column] == src[column], column

    # A rerun skips the step and finds the same rows.
    again = steps.augment_step(results[-1], str(out / "work"), cfg.data.augment)
    assert again.skipped and again.extra["augmented"] == augmented.extra["augmented"]


def test_the_augment_step_adds_the_same_rows_in_this_process(augmented_version, tmp_path):
    """The local data engine (stages.data.engine): the same augmented rows as on Ray."""
    cfg, out, results, augmented, _ = augmented_version
    local = steps.augment_step(results[-1], str(tmp_path / "work"), cfg.data.augment, engine_name="local")

    def rows(step_dir):
        table = pq.read_table(sorted(Path(step_dir).glob("*.parquet")),
                              columns=["id", "augmented_from", "augment_method", "text", "drop_reason"])
        return sorted(tuple(r.values()) for r in table.to_pylist())

    assert local.extra["augmented"] == augmented.extra["augmented"] and local.kept == augmented.kept
    assert rows(local.out_dir) == rows(augmented.out_dir)


def test_no_augmented_row_of_a_held_out_document_is_trained_on(augmented_version, tmp_path):
    from crawl2chat.stages.training.tokenizer import train_tokenizer

    _, out, *_ = augmented_version
    tok = train_tokenizer(out, tmp_path / "tok", vocab_size=300)
    val_fraction = 0.3
    index = pack_shards(out, tok, tmp_path / "packed", val_fraction=val_fraction, num_cpus=1)
    rows = pq.read_table(shard_files(out), columns=["id", "augmented_from"]).to_pylist()
    source_of = {r["id"]: r["augmented_from"] for r in rows}
    held = {i for i, s in source_of.items() if s is None and is_validation(i, val_fraction)}
    assert 0 < len(held) < 16

    packed = pq.read_table(tmp_path / "packed" / "documents.parquet").to_pylist()
    split_of = {d["id"]: d["split"] for d in packed}
    copies_of_held = [i for i, s in source_of.items() if s in held]
    assert copies_of_held and not any(i in split_of for i in copies_of_held)  # neither trained nor evaluated on
    assert index["augmented_held_out"] == len(copies_of_held)
    assert {i for i, s in split_of.items() if s == "val"} == held
    assert all(split_of[i] == "train" for i, s in source_of.items() if s and s not in held)

    split = HeldOutSplit.from_dict(index["split"])
    trained = {r["id"] for r in training_rows(split, out, ["id"])}
    assert trained.isdisjoint(held | set(copies_of_held))
    assert len(trained) == len(source_of) - len(held) - len(copies_of_held)
    evaluated, _ = held_out_rows(split, out)
    assert {r["id"] for r in evaluated} == held


def test_tail_hold_out_takes_a_documents_copies_out_of_training(ray_local, tmp_path):
    """A corpus too small for the hash split holds out its last documents; their augmented
    copies, wherever they were packed, leave training too."""
    from crawl2chat.stages.training.tokenizer import train_tokenizer

    docs = _docs(4)
    copies = [{**d, "id": A.augmented_id(d["id"], "noise", 0), "augmented_from": d["id"], "augment_method": "noise",
               "text": d["text"].upper()} for d in docs]
    rows = [{**d, "augmented_from": None, "augment_method": None} for d in docs][:2] + copies + \
        [{**d, "augmented_from": None, "augment_method": None} for d in docs][2:]
    (tmp_path / "run" / "shards").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "run" / "shards" / "part-00000.parquet")
    tok = train_tokenizer(tmp_path / "run", tmp_path / "tok", vocab_size=300)
    index = pack_shards(tmp_path / "run", tok, tmp_path / "packed", val_fraction=0.001, num_cpus=1)
    assert index["val"]["held_out_tail"] is True
    packed = pq.read_table(tmp_path / "packed" / "documents.parquet").to_pylist()
    val_keys = {d["key"] for d in packed if d["split"] == "val"}
    assert val_keys and not any(d["key"] in val_keys for d in packed if d["split"] == "train")
    assert index["augmented_held_out"] >= 1
    from crawl2chat.stages.training.packing import open_tokens

    assert len(open_tokens(tmp_path / "packed", "train")) == index["train"]["tokens"] == sum(
        d["tokens"] for d in packed if d["split"] == "train")
