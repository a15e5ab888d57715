"""Tokenizer training, Hugging Face loading, and packing into token files."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from crawl2chat.stages.training.packing import is_validation, load_index, open_tokens, pack_shards, token_dtype
from crawl2chat.stages.training.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, load_tokenizer, train_tokenizer

WORDS = ("the king queen night day sword crown river stone bright dark speak answer gentle "
         "noble fool heart blood honour tomorrow love death war peace lord lady").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(rng.randint(2, 6))]
        docs.append("\n".join(lines))
    docs[0] += " Ünïcödé — 東京 🙂"  # bytes outside ASCII must round-trip
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    p.write_text("\n\n".join(make_docs(400)), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    return train_tokenizer(corpus, tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_tokenizer_loads_with_auto_tokenizer(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert 256 + len(SPECIAL_TOKENS) < len(tok) <= 400  # bytes + specials + learnt merges
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(len(SPECIAL_TOKENS)))  # fixed ids, same in every run
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.pad_token_id != tok.eos_token_id
    text = "The noble lord — 東京 🙂 speaks."
    assert tok.decode(tok(text)["input_ids"]) == text
    # Merges were learnt: common words take fewer tokens than bytes.
    assert len(tok("the king")["input_ids"]) < len("the king")


def test_chat_template_saved_and_rendered(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    tok = load_tokenizer(tok_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    # Role markers are single special tokens, never split into bytes.
    assert tok.convert_tokens_to_ids("<|user|>") in ids and tok.convert_tokens_to_ids("<|end|>") in ids


def test_pack_text_file_splits_at_the_end(corpus, tok_dir, tmp_path):
    index = pack_shards(corpus, tok_dir, tmp_path / "packed", val_fraction=0.1)
    assert index == load_index(tmp_path / "packed")
    assert index["dtype"] == "uint16"
    train, val = open_tokens(tmp_path / "packed", "train"), open_tokens(tmp_path / "packed", "val")
    assert len(train) == index["train"]["tokens"] and len(val) == index["val"]["tokens"]
    text = corpus.read_text(encoding="utf-8")
    assert index["train"]["bytes"] + index["val"]["bytes"] == len(text.encode("utf-8"))
    assert 0.08 < index["val"]["bytes"] / len(text.encode()) < 0.12
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert train[-1] == eos and val[-1] == eos
    # Validation is the tail of the file, starting at a line break.
    val_text = tok.decode(val[:-1].tolist(), skip_special_tokens=False)
    assert text.endswith(val_text) and text[len(text) - len(val_text) - 1] == "\n"


def test_token_dtype_follows_vocabulary():
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


@pytest.mark.slow
def test_pack_parquet_shards_here_and_with_ray(tok_dir, tmp_path, ray_local, monkeypatch):
    """A data-stage folder (DIR/shards/*.parquet) is tokenised in this process (small shards)
    or by the Ray Data job, into the same files; dropped documents are left out and the
    split follows the id hash."""
    from crawl2chat.stages.training import packing

    docs = make_docs(300, seed=1)
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    ids = [f"doc-{i:04d}" for i in range(len(docs))]
    drop = [("gopher_quality:too_few_words" if i % 7 == 0 else None) for i in range(len(docs))]
    for s in range(3):
        sl = slice(s, None, 3)
        pq.write_table(pa.table({"id": ids[sl], "text": docs[sl], "drop_reason": drop[sl]}),
                       shards / f"part-{s:05d}.parquet")

    assert not packing.packs_on_ray(tmp_path / "run")
    index = pack_shards(tmp_path / "run", tok_dir, tmp_path / "packed", val_fraction=0.2, num_cpus=2)
    kept = [i for i in range(len(docs)) if drop[i] is None]
    val_ids = [i for i in kept if is_validation(ids[i], 0.2)]
    assert index["val"]["documents"] == len(val_ids)
    assert index["train"]["documents"] == len(kept) - len(val_ids)
    assert index["val"]["bytes"] == sum(len(docs[i].encode()) for i in val_ids)

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    val = open_tokens(tmp_path / "packed", "val")
    assert int((np.asarray(val) == eos).sum()) == len(val_ids)  # one separator per document
    expected = sum(len(tok.encode(docs[i], add_special_tokens=False).ids) + 1 for i in val_ids)
    assert len(val) == expected

    # Packed by Ray Data (shards past PACK_LOCAL_MAX_MB): byte-identical files; the split and
    # order depend neither on the engine nor on scheduling.
    monkeypatch.setattr(packing, "PACK_LOCAL_MAX_MB", 0.0)
    assert packing.packs_on_ray(tmp_path / "run")
    again = pack_shards(tmp_path / "run", tok_dir, tmp_path / "packed2", val_fraction=0.2, num_cpus=2)
    assert {k: again[k] for k in ("train", "val")} == {k: index[k] for k in ("train", "val")}
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "packed" / name).read_bytes() == (tmp_path / "packed2" / name).read_bytes()
    assert pq.read_table(tmp_path / "packed" / "documents.parquet").equals(
        pq.read_table(tmp_path / "packed2" / "documents.parquet"))


def test_tiny_corpus_still_gets_a_validation_split(tok_dir, tmp_path):
    """Too few documents for the hash split to pick one: the tail of the training
    tokens is held out instead, so training can still report validation loss."""
    docs = make_docs(4, seed=2)
    ids = [f"doc-{i}" for i in range(len(docs))]
    assert not any(is_validation(i, 0.01) for i in ids)
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    pq.write_table(pa.table({"id": ids, "text": docs}), shards / "part-00000.parquet")

    index = pack_shards(tmp_path / "run", tok_dir, tmp_path / "packed", val_fraction=0.01, num_cpus=2)
    assert index["val"]["held_out_tail"] is True
    assert index["val"]["tokens"] > 0 and index["train"]["tokens"] > 0
    total = len(open_tokens(tmp_path / "packed", "train")) + len(open_tokens(tmp_path / "packed", "val"))
    assert total == index["train"]["tokens"] + index["val"]["tokens"]
    assert index["val"]["bytes"] + index["train"]["bytes"] == sum(len(d.encode()) for d in docs)


# ---------------------------------------------------------------- WordPiece and Unigram beside BPE

ROUND_TRIP = "The noble lord speaks. Gentle queen answers the fool."


@pytest.mark.parametrize("tokenizer_type", ["bpe", "wordpiece", "unigram"])
def test_each_tokenizer_type_trains_round_trips_and_loads(corpus, tmp_path, tokenizer_type):
    from crawl2chat.stages.training.tokenizer import UNK_TOKEN, tokenizer_family

    tok_dir = train_tokenizer(corpus, tmp_path / "tok", vocab_size=400, tokenizer_type=tokenizer_type)
    assert tokenizer_family(tok_dir) == tokenizer_type
    tok = load_tokenizer(tok_dir)
    # The six shared special tokens keep ids 0..5 in every family; WordPiece and Unigram add <|unk|> next.
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>" and tok.chat_template == CHAT_TEMPLATE
    ids = tok(ROUND_TRIP)["input_ids"]
    assert tok.decode(ids) == ROUND_TRIP
    assert len(ids) < len(ROUND_TRIP.split()) * 2  # words, not characters
    markers = {"bpe": "Ġ", "wordpiece": "##", "unigram": "▁"}[tokenizer_type]
    assert any(markers in t for t in tok.convert_ids_to_tokens(tok("speaks answers gentleness")["input_ids"]))
    if tokenizer_type == "bpe":
        assert tok.unk_token is None and tok.decode(tok("東京 🙂")["input_ids"]) == "東京 🙂"  # bytes: nothing unknown
    else:
        assert tok.unk_token == UNK_TOKEN and tok.unk_token_id == len(SPECIAL_TOKENS)
        assert tok.unk_token_id in tok("queen ☃")["input_ids"]  # a character never seen in training


def test_every_family_trains_the_same_tokenizer_on_every_run(tmp_path):
    """Three fresh processes train each family on the same text: byte-identical
    ``tokenizer.json`` files (the library's WordPiece and Unigram trainers alone
    differ from run to run: hash-map order). WordPiece's vocabulary is as large
    as the library trainer's and encodes the text in as many tokens, give or take
    its choices between merges of equal count."""
    import subprocess
    import sys

    from tokenizers import models, normalizers, pre_tokenizers, trainers

    from crawl2chat.stages.training.tokenizer import UNK_TOKEN

    text = tmp_path / "mixed.txt"
    text.write_text("\n".join(make_docs(300, seed=3)) + "\nStraße Größe naïve café — Привет мир, привет! 東京 🙂x\n",
                    encoding="utf-8")
    script = ("import sys\nfrom crawl2chat.stages.training.tokenizer import train_tokenizer\n"
              "for kind in ('bpe', 'wordpiece', 'unigram'):\n"
              "    train_tokenizer(sys.argv[1], f'{sys.argv[2]}/{kind}', vocab_size=300, tokenizer_type=kind)\n")
    for run in range(3):
        subprocess.run([sys.executable, "-c", script, str(text), str(tmp_path / f"run{run}")], check=True, timeout=300)
    for kind in ("bpe", "wordpiece", "unigram"):
        files = {(tmp_path / f"run{run}" / kind / "tokenizer.json").read_bytes() for run in range(3)}
        assert len(files) == 1, kind

    ours = Tokenizer.from_file(str(tmp_path / "run0" / "wordpiece" / "tokenizer.json"))
    library = Tokenizer(models.WordPiece(unk_token=UNK_TOKEN))
    library.normalizer = normalizers.BertNormalizer(strip_accents=False, lowercase=False)
    library.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    library.train_from_iterator(text.read_text(encoding="utf-8").splitlines(), trainers.WordPieceTrainer(
        vocab_size=300, min_frequency=2, special_tokens=SPECIAL_TOKENS + [UNK_TOKEN], show_progress=False))
    lines = text.read_text(encoding="utf-8").splitlines()
    mine, theirs = (sum(len(e.ids) for e in t.encode_batch(lines)) for t in (ours, library))
    assert len(ours.get_vocab()) == len(library.get_vocab()) and abs(mine - theirs) <= 0.02 * theirs, (mine, theirs)
    mine = set(ours.get_vocab())
    assert {"##ß", "ß", "##ö", "##и", "и"} <= mine  # each character also stands as a word's first
    assert ours.encode("Größe Привет").tokens and ours.token_to_id(UNK_TOKEN) not in ours.encode("Größe Привет").ids


def test_wordpiece_training_marks_exactly_the_characters_inside_words():
    """BERT's pre-tokenizer splits the marked text into the same words as the plain
    text; in each, every character but the first is marked; each character met
    inside a word also comes once as a word of its own."""
    from tokenizers import normalizers, pre_tokenizers

    from crawl2chat.stages.training.tokenizer import _ContinuationMarker, _unmark

    text = ("Straße, naïve café! «Привет» — 東京は日本 x2+y=z ^_^ don't e-mail "
            "tab\there\u00a0nbsp\u3000ideo ¿qué? ١٢٣ हिन्दी 𝔘𝔫𝔦 smile🙂 a\U000f0001b")
    normal = normalizers.BertNormalizer(strip_accents=False, lowercase=False).normalize_str(text)
    split = pre_tokenizers.BertPreTokenizer().pre_tokenize_str
    mark = _ContinuationMarker()
    marked = mark(normal)
    plain_words = [w for w, _ in split(normal.replace("\U000f0001", ""))]
    marked_words = [w for w, _ in split(marked)]
    words, singles = marked_words[:len(plain_words)], marked_words[len(plain_words):]
    assert [_unmark(w) for w in words] == plain_words
    for plain, word in zip(plain_words, words):
        assert word[0] == plain[0] and all(ord(c) >= 0xF0000 for c in word[1:]), (plain, word)
    assert sorted(singles) == sorted({c for w in plain_words for c in w[1:]})
    assert [w for w, _ in split(mark(normal))] == words  # each character comes alone once only


@pytest.mark.parametrize("tokenizer_type", ["bpe", "wordpiece", "unigram"])
def test_encoder_objectives_get_their_special_tokens(corpus, tmp_path, tokenizer_type):
    from crawl2chat.stages.training.tokenizer import CLS_TOKEN, MASK_TOKEN, SEP_TOKEN, sentinel

    mlm = load_tokenizer(train_tokenizer(corpus, tmp_path / "mlm", vocab_size=400, tokenizer_type=tokenizer_type,
                                         objective="mlm"))
    assert (mlm.cls_token, mlm.sep_token, mlm.mask_token) == (CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)
    ids = mlm("the king")["input_ids"]
    assert ids[0] == mlm.cls_token_id and ids[-1] == mlm.sep_token_id  # BERT's template
    assert mlm.decode(ids, skip_special_tokens=True) == "the king"
    masked = mlm(f"the {MASK_TOKEN} speaks")["input_ids"]
    assert masked.count(mlm.mask_token_id) == 1  # the mask is one token, never split
    assert mlm.chat_template is None

    span = load_tokenizer(train_tokenizer(corpus, tmp_path / "span", vocab_size=400, tokenizer_type=tokenizer_type,
                                          objective="span", num_sentinels=8))
    sentinels = span.convert_tokens_to_ids([sentinel(i) for i in range(8)])
    assert len(set(sentinels)) == 8 and span.unk_token_id not in sentinels
    ids = span(f"the {sentinel(0)} speaks {sentinel(1)}")["input_ids"]
    assert ids[-1] == span.eos_token_id and sentinels[0] in ids and sentinels[1] in ids  # T5: input ends with EOS
    assert "token_type_ids" not in span("the king")  # a seq2seq model takes ids and attention mask only


def test_pretrain_tokenizer_type_takes_effect_and_a_mismatch_is_refused(corpus, tmp_path):
    from crawl2chat.stages.training.pretrain import prepare_data
    from crawl2chat.stages.training.settings import PretrainConfig
    from crawl2chat.stages.training.tokenizer import tokenizer_family

    cfg = PretrainConfig(vocab_size=300, val_fraction=0.1, tokenizer_type="unigram")
    tok_dir, data_dir = prepare_data(cfg, corpus, tmp_path / "run")
    assert tokenizer_family(tok_dir) == "unigram" and load_index(data_dir)["val"]["tokens"] > 0
    with pytest.raises(ValueError, match="holds a unigram tokenizer but tokenizer_type is 'bpe'"):
        prepare_data(PretrainConfig(tokenizer=str(tok_dir)), corpus, tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizer_type"):
        train_tokenizer(corpus, tmp_path / "x", tokenizer_type="sentencepiece")


@pytest.mark.slow
def test_both_tokenizing_paths_keep_the_same_documents(tok_dir, tmp_path, ray_local):
    """Packing in this process and packing by Ray Data leave out the same rows: dropped
    ones (a reason; an empty reason is none), empty or null texts, superseded ids and the
    augmented copies of superseded documents; and keep the order and weights."""
    from crawl2chat.stages.training.packing import _local_tokenize, _ray_tokenize

    docs = make_docs(60, seed=3)
    ids = [f"d{i:03d}" for i in range(len(docs))]
    texts = [None if i == 5 else "" if i == 6 else t for i, t in enumerate(docs)]
    drop = ["quality:x" if i % 9 == 0 else "" if i % 9 == 1 else None for i in range(len(docs))]
    aug = [ids[i - 1] if i % 10 == 4 else None for i in range(len(docs))]
    weight = [0.5 + (i % 3) for i in range(len(docs))]
    files = []
    for s in range(2):
        sl = slice(s * 30, (s + 1) * 30)
        path = tmp_path / f"part-{s}.parquet"
        pq.write_table(pa.table({"id": ids[sl], "text": texts[sl], "drop_reason": drop[sl],
                                 "augmented_from": aug[sl], "sample_weight": weight[sl]}), path)
        files.append(path)
    superseded = frozenset({ids[3], ids[13], ids[33]})  # d013 and d033 have augmented copies (d014, d034)

    def rows(batches):
        return [(str(i), float(w), tuple(int(t) for t in toks)) for b in batches
                for i, w, toks in zip(b["id"], b["weight"], b["tokens"])]

    args = (files, tok_dir / "tokenizer.json", 0.2, 2, superseded, None, True)
    here, on_ray = rows(_local_tokenize(*args)), rows(_ray_tokenize(*args))
    assert here == on_ray
    kept = {r[0] for r in here}
    assert not kept & {"d003", "d013", "d014", "d033", "d034", "d005", "d006", "d000", "d009"}
    assert {"d001", "d010"} <= kept  # an empty drop reason is no drop


def test_unigram_is_the_same_on_every_run_over_real_pages(shared_data, tmp_path):
    """Real pages bring many characters seen once: several single characters share the
    lowest score beside the trainer's added run, and trained pieces fall on its score
    grid further up. Three fresh processes still train byte-identical files."""
    import subprocess
    import sys

    from warcio.archiveiterator import ArchiveIterator

    from crawl2chat.stages.data.extract import html_to_text

    texts = []
    for name in ("sample-0000.warc.gz", "sample-0001.warc.gz"):
        with open(shared_data / "warc" / "dolma" / name, "rb") as fh:
            texts += [html_to_text(r.content_stream().read().decode("utf-8", "replace"))
                      for r in ArchiveIterator(fh) if r.rec_type == "response"]
    source = tmp_path / "pages.txt"
    source.write_text("\n".join(t for t in texts if t), encoding="utf-8")
    script = ("import sys\nfrom crawl2chat.stages.training.tokenizer import train_tokenizer\n"
              "train_tokenizer(sys.argv[1], sys.argv[2], vocab_size=1000, tokenizer_type='unigram')\n")
    for run in range(3):
        subprocess.run([sys.executable, "-c", script, str(source), str(tmp_path / f"run{run}")], check=True, timeout=300)
    assert len({(tmp_path / f"run{run}" / "tokenizer.json").read_bytes() for run in range(3)}) == 1
