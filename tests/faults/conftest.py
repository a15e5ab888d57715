"""Fixtures of the fault tests: a tiny corpus and tokenizer, tiny SFT data, and
uninterrupted reference runs of pretraining and SFT to compare killed runs against."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from crawl2chat.infra.fault_drill import rerun

from fault_runs import WORDS, pretrain_spec, sft_spec, text_lines


@pytest.fixture(scope="session")
def fault_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults").resolve()


@pytest.fixture(scope="session")
def corpus(fault_root) -> dict:
    from crawl2chat.stages.training.pretrain import prepare_data
    from crawl2chat.stages.training.settings import PretrainConfig

    text = fault_root / "corpus.txt"
    text.write_text(text_lines(3000, 0))
    tok_dir, _ = prepare_data(PretrainConfig(vocab_size=300, val_fraction=0.1), text, fault_root / "prep")
    rows = []
    rng = random.Random(1)
    for _ in range(120):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
        rows.append({"prompt": prompt, "response": " ".join(reversed(prompt.split()))})
    sft_data = fault_root / "sft.jsonl"
    sft_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"text": str(text), "tokenizer": str(tok_dir), "sft": str(sft_data)}


@pytest.fixture(scope="session")
def pretrain_reference(fault_root, corpus) -> Path:
    """The uninterrupted pretraining run."""
    out = fault_root / "pretrain-reference"
    rerun(pretrain_spec(corpus, out))
    return out


@pytest.fixture(scope="session")
def sft_reference(fault_root, corpus, pretrain_reference) -> Path:
    """The uninterrupted SFT run on the reference base model."""
    out = fault_root / "sft-reference"
    rerun(sft_spec(corpus, pretrain_reference / "model", out))
    return out
