"""Fixtures of the fault tests: a tiny corpus and tokenizer, tiny SFT data, and
uninterrupted reference runs of pretraining, SFT and the reward model to compare killed runs against."""

from __future__ import annotations

from pathlib import Path

import pytest

from crawl2chat.infra.fault_drill import pretrain_spec, rerun, reward_spec, sft_spec, tiny_inputs


@pytest.fixture(scope="session")
def fault_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults").resolve()


@pytest.fixture(scope="session")
def corpus(fault_root) -> dict:
    return tiny_inputs(fault_root)


@pytest.fixture(scope="session")
def pretrain_reference(fault_root, corpus) -> Path:
    """The uninterrupted pretraining run."""
    out = fault_root / "pretrain-reference"
    rerun(pretrain_spec(corpus, out))
    return out


@pytest.fixture(scope="session")
def pretrain_ddp_reference(fault_root, corpus) -> Path:
    """The uninterrupted pretraining run over two processes (DDP through ``accelerate launch``)."""
    out = fault_root / "pretrain-ddp-reference"
    rerun({**pretrain_spec(corpus, out), "num_processes": 2})
    return out


@pytest.fixture(scope="session")
def sft_reference(fault_root, corpus, pretrain_reference) -> Path:
    """The uninterrupted SFT run on the reference base model."""
    out = fault_root / "sft-reference"
    rerun(sft_spec(corpus, pretrain_reference / "model", out))
    return out


@pytest.fixture(scope="session")
def reward_reference(fault_root, corpus, sft_reference) -> Path:
    """The uninterrupted reward-model run on the reference SFT model."""
    out = fault_root / "reward-reference"
    rerun(reward_spec(corpus, sft_reference / "model", out))
    return out
