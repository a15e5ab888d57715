"""Checkpoints cannot run code: every file in one loads with ``torch.load(weights_only=True)``
(or is safetensors / JSON), the registered state is JSON, and a checkpoint carrying
a pickle of the registered state is refused without unpickling it."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS

from crawl2chat.infra.fault_drill import PRETRAIN
from crawl2chat.stages.settings import load_settings, parse_overrides
from crawl2chat.stages.training.models import build_model, model_config
from crawl2chat.stages.training.pretrain import TokenWindows, causal_lm_loss, prepare_data
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.stages.training.trainer import Trainer, make_accelerator

ROOT = Path(__file__).resolve().parents[2]


def _trainer(corpus, out: Path, max_steps: int) -> Trainer:
    cfg = load_settings(PretrainConfig, None, {**parse_overrides(PRETRAIN), "tokenizer": corpus["tokenizer"],
                                              "max_steps": max_steps})
    if not (out / "data").exists():
        prepare_data(cfg, corpus["text"], out)
    windows = TokenWindows(out / "data", cfg)
    model = build_model(model_config("tiny", vocab_size=320, seq_len=cfg.seq_len))
    return Trainer(cfg, make_accelerator(cfg), model, out, batch_fn=windows.batch, loss_fn=causal_lm_loss)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_checkpoint_files_load_without_running_code(corpus, tmp_path):
    trainer = _trainer(corpus, tmp_path, max_steps=12)  # checkpoints at steps 0 and 10
    try:
        trainer.fit()
    finally:
        trainer.metrics.close()
    ckpt = tmp_path / "checkpoints" / "step_00000010"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "custom_state_0.json" in names and "custom_state_1.json" in names, names
    assert not [n for n in names if n.startswith("custom_checkpoint_")], names
    state = json.loads((ckpt / "custom_state_1.json").read_text())
    assert state["step"] == 10 and state["batch_index"] == 10
    assert json.loads((ckpt / "custom_state_0.json").read_text())["last_epoch"] == 10  # the schedule
    pickles = [p for p in ckpt.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert pickles  # optimizer and RNG states
    with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):  # numpy arrays of the RNG states, nothing more
        for path in pickles:
            torch.load(path, map_location="cpu", weights_only=True)

    # The same checkpoint resumes into a new trainer (state from JSON) ...
    again = _trainer(corpus, tmp_path, max_steps=12)
    try:
        assert again.resume() and again.state.step == 10
        # ... and one carrying a pickle of the registered state is refused, the pickle never run.
        planted = tmp_path / "planted"
        shutil.copytree(ckpt, planted)
        marker = tmp_path / "code-ran"
        torch.save(_RunsCode(marker), planted / "custom_checkpoint_1.pkl")
        with pytest.raises(ValueError, match=r"holds pickled state \(custom_checkpoint_1\.pkl\)"):
            again.acc.load_state(str(planted))
        assert not marker.exists()
    finally:
        again.metrics.close()


def test_nothing_in_the_project_unpickles_with_weights_only_false():
    pattern = re.compile(r"weights_only\s*=\s*False")
    found = []
    for folder in ("crawl2chat", "stages", "tasks", "flows", "infra", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            found += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line)]
    assert not found, found
