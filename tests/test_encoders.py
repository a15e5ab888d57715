"""The encoder objectives: masking and span statistics on large samples, batches as pure
functions of their index, and real ``accelerate launch`` runs of ``mlm`` and ``span``
that learn, resume exactly, and save folders the ``transformers`` Auto classes load."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from crawl2chat.stages.training.masking import (IGNORE_INDEX, corrupt_spans, mask_tokens, random_spans_noise_mask,
                                                span_counts, word_boundaries, word_ids)
from crawl2chat.stages.training.trainer import read_metrics

NOUNS = "king queen knight lady lord fool squire monk".split()
OBJ = dict(zip(NOUNS, "sword crown shield ring horse bell spear book".split()))
PLACE = dict(zip(NOUNS, "castle palace tower garden river market stable abbey".split()))
VERB = dict(zip(NOUNS, "holds wears carries keeps rides rings throws reads".split()))

# Tiny model, 64-token rows, a constant learning rate after warmup (so a resumed run's
# steps can be compared one for one with an uninterrupted run's).
TINY = ["preset=tiny", "seq_len=64", "micro_batch_size=8", "lr=3e-3", "min_lr=3e-4", "warmup_steps=5",
        "schedule=constant", "eval_every=0", "eval_batches=4", "val_fraction=0.1", "vocab_size=200",
        "rollback.spike_factor=0"]


def corpus_text(n: int = 3000, seed: int = 0) -> str:
    """Sentences whose words depend on each other: the noun decides the verb, object and place."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a = rng.choice(NOUNS)
        lines.append(f"the {a} {VERB[a]} the {OBJ[a]} in the {PLACE[a]} .")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("encoders") / "corpus.txt"
    p.write_text(corpus_text())
    return p


# ---------------------------------------------------------------- masking statistics


def _row_setup(vocab: int = 1000, n_special: int = 10):
    special = np.zeros(vocab, dtype=bool)
    special[:n_special] = True
    return special, np.flatnonzero(~special)


def test_token_masking_selects_15_percent_then_80_10_10():
    special, ordinary = _row_setup()
    rng0 = np.random.default_rng(0)
    sel = masked = randomised = kept = ordinary_total = 0
    for r in range(3000):
        ids = rng0.choice(ordinary, size=123)
        ids[0], ids[-1], ids[50] = 1, 2, 0  # cls, sep, a document separator: never selected
        inputs, labels = mask_tokens(ids, np.random.default_rng([7, r]), special, mask_id=3, random_ids=ordinary)
        chosen = labels != IGNORE_INDEX
        assert not chosen[[0, 50, 122]].any()
        assert (labels[chosen] == ids[chosen]).all() and (inputs[~chosen] == ids[~chosen]).all()
        assert chosen.sum() == 18  # exactly 15% of the 120 ordinary tokens, every row
        sel += chosen.sum()
        masked += (inputs[chosen] == 3).sum()
        kept += (inputs[chosen] == ids[chosen]).sum()
        randomised += ((inputs[chosen] != 3) & (inputs[chosen] != ids[chosen])).sum()
        assert not special[inputs[chosen & (inputs != 3)]].any()  # random replacements are ordinary tokens
        ordinary_total += 120
    assert sel / ordinary_total == pytest.approx(0.15, abs=0.001)
    # 54,000 selected tokens: the shares are within a few standard errors (~0.0017, 0.0013).
    assert masked / sel == pytest.approx(0.8, abs=0.008)
    assert randomised / sel == pytest.approx(0.1, abs=0.006)
    assert kept / sel == pytest.approx(0.1, abs=0.006)


def test_whole_word_masking_takes_whole_words():
    # A WordPiece-like vocabulary: even ids start words, odd ids are "##" continuations.
    vocab = [f"<s{i}>" for i in range(10)] + [("w" if i % 2 == 0 else "##c") + str(i) for i in range(10, 1000)]
    starts, ends_space = word_boundaries(vocab, "wordpiece")
    special, ordinary = _row_setup()
    rng0 = np.random.default_rng(1)
    sel = masked = total = 0
    for r in range(2000):
        ids = rng0.choice(ordinary, size=128)
        ids[0], ids[-1] = 1, 2
        words = word_ids(ids, special, starts, ends_space)
        inputs, labels = mask_tokens(ids, np.random.default_rng([3, r]), special, 3, ordinary, words=words)
        chosen = labels != IGNORE_INDEX
        same_word = (words[1:] == words[:-1]) & (words[1:] >= 0)  # a word's tokens are contiguous
        assert (chosen[1:] == chosen[:-1])[same_word].all()  # all of a word's tokens, or none of them
        assert chosen.sum() <= round(0.15 * 126)
        sel, masked, total = sel + chosen.sum(), masked + (inputs[chosen] == 3).sum(), total + 126
    assert 0.14 < sel / total <= 19 / 126  # whole words fill the 15% target (19 of 126) or just under
    assert masked / sel == pytest.approx(0.8, abs=0.01)  # the 80/10/10 split applies per token here too


def test_word_boundaries_of_each_family():
    ids = np.arange(7)
    special = np.array([True] + [False] * 6)
    expected = [-1, 0, 0, 1, 1, 2, 3]  # after a whitespace token, the next token begins a word
    cases = {
        "wordpiece": ["<s>", "play", "##ing", "now", "##s", ".", "go"],
        "unigram": ["<s>", "▁play", "ing", "▁now", "s", "▁", "go"],
        "bpe": ["<s>", "play", "ing", "Ġnow", "s", "Ċ", "again"],
    }
    for family, tokens in cases.items():
        starts, ends_space = word_boundaries(tokens, family)
        assert word_ids(ids, special, starts, ends_space).tolist() == expected, family


def test_span_corruption_density_mean_length_and_sentinels():
    L, rows = 128, 3000
    noise_expected, spans_expected = span_counts(L, 0.15, 3.0)
    assert (noise_expected, spans_expected) == (19, 6)
    lengths, noise_total = [], 0
    sentinels = list(range(900, 1000))
    for r in range(rows):
        rng = np.random.default_rng([5, r])
        mask = random_spans_noise_mask(L, 0.15, 3.0, rng)
        assert not mask[0]  # T5 starts with kept tokens
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]]))
        lengths += (ends - starts + 1).tolist()
        noise_total += mask.sum()
        assert len(starts) == spans_expected  # spans never touch: kept tokens between any two
        ids = rng.integers(10, 900, size=L)
        inputs, targets = corrupt_spans(ids, mask, sentinels, eos_id=1)
        assert len(inputs) == L - noise_expected + spans_expected + 1 and inputs[-1] == 1
        assert len(targets) == noise_expected + spans_expected + 1 and targets[-1] == 1
        # Each sentinel k stands where span k was, and the target gives span k after sentinel k: the
        # original row is recovered from the two.
        tgt_spans = np.split(targets[:-1], np.flatnonzero(targets[:-1] >= 900))[1:]
        assert [s[0] for s in tgt_spans] == sentinels[:spans_expected]
        rebuilt = []
        for t in inputs[:-1]:
            rebuilt.extend(tgt_spans[t - 900][1:].tolist() if t >= 900 else [t])
        assert rebuilt == ids.tolist()
    assert noise_total / (rows * L) == pytest.approx(0.15, abs=0.002)
    assert np.mean(lengths) == pytest.approx(3.0, abs=0.2)  # 19 noise tokens in 6 spans: 3.17
    counts = np.bincount(lengths)
    assert counts[1] > 0 and counts[2] > 0 and counts[3] > 0 and len(counts) > 8  # lengths vary around the mean


# ---------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    from crawl2chat.stages.training.encoders import prepare_data
    from crawl2chat.stages.training.settings import MLMConfig, SpanConfig

    root = tmp_path_factory.mktemp("prepared")
    mlm_cfg = MLMConfig(vocab_size=70, val_fraction=0.1)  # small enough that WordPiece splits words
    span_cfg = SpanConfig(vocab_size=200, val_fraction=0.1, num_sentinels=20)
    return {"mlm": prepare_data(mlm_cfg, corpus, root / "mlm", "mlm"),
            "span": prepare_data(span_cfg, corpus, root / "span", "span")}


def test_batches_are_pure_functions_of_the_index_and_layout_free(prepared):
    import torch

    from crawl2chat.stages.training.mlm import setup as mlm_setup
    from crawl2chat.stages.training.settings import MLMConfig
    from crawl2chat.stages.training.tokenizer import load_tokenizer

    tok_dir, data_dir = prepared["mlm"]
    tok = load_tokenizer(tok_dir)

    def windows(**kw):
        return mlm_setup(MLMConfig(preset="tiny", seq_len=32, **kw), tok, tok_dir, data_dir)[1]

    one = windows(micro_batch_size=4, grad_accum=2)
    two = windows(micro_batch_size=4, grad_accum=1)
    a = one.batch(17, 0, 0, 1)
    assert all(torch.equal(a[k], one.batch(17, 0, 0, 1)[k]) for k in a)  # same index, same batch
    assert not torch.equal(a["input_ids"], one.batch(18, 0, 0, 1)["input_ids"])
    # 1 process x 2 micro-batches and 2 processes x 1 micro-batch see the same global batch.
    single = torch.cat([one.batch(17, m, 0, 1)["input_ids"] for m in range(2)])
    ddp = torch.cat([two.batch(17, 0, r, 2)["input_ids"] for r in range(2)])
    assert torch.equal(single, ddp)
    assert (a["input_ids"][:, 0] == tok.cls_token_id).all() and (a["input_ids"][:, -1] == tok.sep_token_id).all()
    # Held-out rows are masked the same way at every evaluation.
    e1, e2 = list(one.eval_batches(0, 1)), list(one.eval_batches(0, 1))
    assert all(torch.equal(x["labels"], y["labels"]) for x, y in zip(e1, e2))


def test_whole_word_masking_setting_takes_effect_in_the_stage(prepared):
    from crawl2chat.stages.training.mlm import setup as mlm_setup
    from crawl2chat.stages.training.settings import MLMConfig
    from crawl2chat.stages.training.tokenizer import load_tokenizer

    tok_dir, data_dir = prepared["mlm"]
    tok = load_tokenizer(tok_dir)
    cont = np.array([t.startswith("##") for t in tok.convert_ids_to_tokens(list(range(len(tok))))])
    assert cont.any()  # the WordPiece vocabulary splits some words

    def lone_continuations(wwm: bool) -> int:
        """Selected '##' tokens whose word head was not selected."""
        w = mlm_setup(MLMConfig(preset="tiny", seq_len=64, micro_batch_size=8, whole_word_masking=wwm), tok,
                      tok_dir, data_dir)[1]
        n = 0
        for i in range(30):
            b = w.batch(i, 0, 0, 1)
            ids = np.where(b["labels"].numpy() != IGNORE_INDEX, b["labels"].numpy(), b["input_ids"].numpy())
            sel = b["labels"].numpy() != IGNORE_INDEX
            n += int((sel[:, 2:] & cont[ids[:, 2:]] & ~sel[:, 1:-1]).sum())
        return n

    assert lone_continuations(False) > 0 and lone_continuations(True) == 0


# ---------------------------------------------------------------- the stages under accelerate


def _steps(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"}


def test_mlm_learns_resumes_exactly_and_loads_as_masked_lm(corpus, tmp_path):
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from crawl2chat.tasks.train import launch_training

    out = tmp_path / "mlm"
    sets = TINY + ["checkpoint_every=20"]
    launch_training("mlm", {"data": str(corpus)}, str(out), max_steps=60, overrides=sets)
    m = json.loads((out / "metrics.json").read_text())
    chance = 1 / m["vocab_size"]
    assert m["steps"] == 60 and m["tokenizer_type"] == "wordpiece" and m["whole_word_masking"] is False
    # Held-out figures against the same model untrained (evaluated before its first step).
    assert m["val_loss"] < m["initial_val_loss"] - 1.5, m
    assert m["val_masked_accuracy"] > 20 * chance and m["val_masked_accuracy"] > m["initial_val_masked_accuracy"] + 0.2
    first = _steps(out)

    model = AutoModelForMaskedLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert type(model).__name__ == "BertForMaskedLM" and tok.mask_token == "<|mask|>"
    # The held-out split goes with the model (an evaluation, or contrastive learning from it, keeps it).
    from crawl2chat.stages.training.heldout import read_split

    split = read_split(out / "model")
    assert split is not None and split.val_fraction == m["split_val_fraction"] and m["split"]
    enc = tok(f"the king holds the sword in {tok.mask_token} castle .", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    pos = int((enc["input_ids"][0] == tok.mask_token_id).nonzero()[0])
    assert tok.convert_ids_to_tokens(int(logits[0, pos].argmax())) == "the"

    # A longer run on the same folder resumes from the newest checkpoint (step 40) and
    # repeats steps 41..60 exactly: same batches, same masks, same dropout.
    launch_training("mlm", {"data": str(corpus)}, str(out), max_steps=70, overrides=sets)
    resumes = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 40
    again = _steps(out)
    assert json.loads((out / "metrics.json").read_text())["steps"] == 70
    for s in range(41, 61):
        assert again[s]["loss"] == pytest.approx(first[s]["loss"], rel=1e-6, abs=1e-7), s


def test_span_corruption_learns_and_loads_as_seq2seq(corpus, tmp_path):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from crawl2chat.tasks.train import launch_training

    out = tmp_path / "span"
    launch_training("span", {"data": str(corpus)}, str(out), max_steps=60,
                    overrides=TINY + ["num_sentinels=20", "checkpoint_every=0"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 60 and m["tokenizer_type"] == "unigram"
    assert (m["noise_tokens_per_row"], m["spans_per_row"]) == span_counts(64, 0.15, 3.0) == (10, 3)
    assert m["val_loss"] < m["initial_val_loss"] - 1.5, m
    assert m["val_token_accuracy"] > 20 / m["vocab_size"]
    assert math.isfinite(m["final_train_loss"])

    model = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert type(model).__name__ == "T5ForConditionalGeneration"
    enc = tok("the king holds the <extra_id_0> in the castle .", return_tensors="pt")
    assert enc["input_ids"][0, -1] == tok.eos_token_id
    gen = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert gen.shape[1] > 1
    # The saved weights are the trained ones: the loaded model gives the held-out loss again.
    from crawl2chat.stages.training.encoders import LabelledLoss
    from crawl2chat.stages.training.settings import SpanConfig
    from crawl2chat.stages.training.span import setup, span_logits

    cfg = SpanConfig(preset="tiny", seq_len=64, micro_batch_size=8, eval_batches=4, num_sentinels=20)
    windows = setup(cfg, tok, out / "model", out / "data")[1]
    loss = LabelledLoss(span_logits, "acc")
    model.eval()
    with torch.no_grad():
        parts = [loss(model, b) for b in windows.eval_batches(0, 1)]
    total = sum(l.item() * n for l, n in parts) / sum(n for _, n in parts)
    assert total == pytest.approx(m["val_loss"], rel=1e-4)


def test_commands_show_an_example():
    from typer.testing import CliRunner

    from crawl2chat.cli import app

    for name in ("mlm", "span"):
        r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"})
        assert r.exit_code == 0 and f"crawl2chat {name} --data runs/data" in r.output, r.output


@pytest.mark.slow
def test_span_command_records_the_run_in_mlflow(corpus, tmp_path):
    """`crawl2chat span` end to end: the single-stage Prefect flow, the launch, the
    MLflow run with its metrics, the tokenizer artifact and the registered model."""
    import os
    import subprocess
    import sys

    import mlflow

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    sets = [f"span.train.{s}" for s in TINY + ["num_sentinels=20", "checkpoint_every=0"]]
    cmd = [sys.executable, "-m", "crawl2chat.cli", "span", "--data", str(corpus), "--out", str(tmp_path / "runs"),
           "--max-steps", "20", "--set", f"home={tmp_path / 'home'}"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "span model:" in proc.stdout and "untrained" in proc.stdout
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["crawl2chat"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("crawl2chat.stage") == "span"]
    assert run.data.metrics["val_loss"] < run.data.metrics["initial_val_loss"]
    assert run.data.tags["crawl2chat.tokenizer"].endswith("tokenizer")
    assert mlflow.MlflowClient().get_model_version_by_alias("crawl2chat-span", "current")
