"""Rollback state on disk: the Trainer in this process, on a tiny model.

A crash after a rollback and before the next checkpoint resumes with the lowered
learning rate and past the bad batch (bitwise the uninterrupted run);
``max_rollbacks`` counts failures in a row; a checkpoint that keeps failing is left
behind; damaged files are named."""

from __future__ import annotations

import json

import pytest
import torch

from crawl2chat.infra.fault_drill import PRETRAIN
from crawl2chat.stages.checksums import CHECKSUMS, folder_damage, write_checksums
from crawl2chat.stages.settings import load_settings, parse_overrides
from crawl2chat.stages.training.models import build_model, model_config
from crawl2chat.stages.training.pretrain import TokenWindows, causal_lm_loss, prepare_data
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.stages.training.trainer import ROLLBACK_FILE, Trainer, make_accelerator, read_metrics


class Crash(RuntimeError):
    pass


def run(corpus, out, overrides: dict, crash_at: int | None = None) -> Trainer:
    """Train to the end, or raise Crash when batch ``crash_at`` is first drawn."""
    cfg = load_settings(PretrainConfig, None, {**parse_overrides(PRETRAIN), "tokenizer": corpus["tokenizer"],
                                              "rollback": {"spike_factor": 0}, **overrides})
    if not (out / "data").exists():
        prepare_data(cfg, corpus["text"], out)
    acc = make_accelerator(cfg)
    windows = TokenWindows(out / "data", cfg)
    model = build_model(model_config("tiny", vocab_size=320, seq_len=cfg.seq_len))

    def batch_fn(index, micro, rank, world):
        if index == crash_at:
            raise Crash(f"killed at batch {index}")
        return windows.batch(index, micro, rank, world)

    trainer = Trainer(cfg, acc, model, out, batch_fn=batch_fn, loss_fn=causal_lm_loss)
    try:
        trainer.summary = trainer.fit()
    finally:
        trainer.metrics.close()
    return trainer


def events(out, name):
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == name]


def test_rollback_survives_a_crash_before_the_next_checkpoint(corpus, tmp_path):
    nan = {"max_steps": 30, "inject_nan_at_batches": [15], "rollback": {"lr_factor": 0.5, "spike_factor": 0}}
    reference = run(corpus, tmp_path / "ref", nan)
    assert reference.summary["rollbacks"] == 1

    out = tmp_path / "crashed"
    with pytest.raises(Crash):
        run(corpus, out, nan, crash_at=18)  # rolled back at batch 15, then killed before step 20's checkpoint
    record = json.loads((out / "checkpoints" / ROLLBACK_FILE).read_text())
    assert (record["checkpoint"], record["batch_index"], record["lr_scale"], record["rollbacks"]) == (
        "step_00000010", 16, 0.5, 1)
    resumed = run(corpus, out, nan)
    resume = events(out, "resume")[-1]
    assert (resume["checkpoint"], resume["lr_scale"], resume["batch_index"]) == ("step_00000010", 0.5, 16)
    assert resumed.summary["rollbacks"] == 1 and len(events(out, "rollback")) == 1  # batch 15 not replayed
    ref_sd, got_sd = reference.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd)


def test_max_rollbacks_counts_failures_in_a_row(corpus, tmp_path):
    """Three failures, each followed by progress past it, with max_rollbacks=1."""
    trainer = run(corpus, tmp_path, {"max_steps": 40, "inject_nan_at_batches": [5, 17, 33],
                                     "rollback": {"max_rollbacks": 1, "spike_factor": 0}})
    rollbacks = events(tmp_path, "rollback")
    assert trainer.summary["steps"] == 40 and trainer.summary["rollbacks"] == 3
    assert [r["consecutive_rollbacks"] for r in rollbacks] == [1, 1, 1]


def test_a_checkpoint_that_keeps_failing_is_left_behind(corpus, tmp_path):
    """Batches 21 and 22 fail: the first rollback goes to step 20, the second (in a row)
    past it to step 10, discarding step 20."""
    trainer = run(corpus, tmp_path, {"max_steps": 30, "keep_checkpoints": 3, "inject_nan_at_batches": [21, 22]})
    first, second = events(tmp_path, "rollback")
    assert (first["checkpoint"], first["consecutive_rollbacks"], first["discarded"]) == ("step_00000020", 1, [])
    assert (second["checkpoint"], second["consecutive_rollbacks"], second["discarded"]) == (
        "step_00000010", 2, ["step_00000020"])
    assert second["resumed_step"] == 10 and trainer.state.batch_index == 23 + 20
    assert trainer.summary["steps"] == 30 and trainer.summary["rollbacks"] == 2
    record = json.loads((tmp_path / "checkpoints" / ROLLBACK_FILE).read_text())
    assert record["discard"] == [] and record["lr_scale"] == pytest.approx(0.25)


def test_damage_is_named(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text("{}")
    write_checksums(tmp_path)
    assert folder_damage(tmp_path) is None
    (tmp_path / "a.bin").write_bytes(b"x" * 50)
    assert folder_damage(tmp_path) == f"{tmp_path / 'a.bin'} has 50 bytes, 100 were written"
    (tmp_path / "a.bin").write_bytes(b"y" * 100)
    assert folder_damage(tmp_path) == f"{tmp_path / 'a.bin'} does not match its sha256"
    (tmp_path / "a.bin").unlink()
    assert folder_damage(tmp_path) == f"{tmp_path / 'a.bin'} is missing"
    (tmp_path / CHECKSUMS).write_text("{trunc")
    assert "is unreadable" in folder_damage(tmp_path)
