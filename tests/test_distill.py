"""Knowledge distillation: the soft-target loss (zero against itself, the plain loss at
alpha 0), and `crawl2chat distill` end to end: a small pretrained teacher distilled
into a smaller student that learns, with the teacher's and the no-teacher student's
bits per byte beside it, recorded in MLflow with the teacher as its lineage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.test_encoders import corpus_text

TEACHER = ["preset=cpu-small", "seq_len=64", "micro_batch_size=8", "lr=3e-3", "min_lr=3e-4", "warmup_steps=5",
           "eval_every=0", "eval_batches=4", "val_fraction=0.1", "vocab_size=300", "checkpoint_every=0"]


def test_soft_target_loss_against_itself_and_at_alpha_zero():
    from crawl2chat.stages.training.distill import DistillLoss
    from crawl2chat.stages.training.models import build_model, model_config
    from crawl2chat.stages.training.pretrain import causal_lm_loss

    torch.manual_seed(0)
    model = build_model(model_config("tiny", vocab_size=50, seq_len=16, pad_token_id=0, eos_token_id=1))
    batch = {"tokens": torch.randint(2, 50, (4, 17))}
    model.train()
    hard, n = causal_lm_loss(model, batch)
    # The model as its own teacher: the soft term is zero, only (1 - alpha) x the hard loss is left.
    own, _ = DistillLoss(model, alpha=0.75, temperature=2.0)(model, batch)
    assert own.item() == pytest.approx(0.25 * hard.item(), rel=1e-5)
    other = build_model(model_config("tiny", vocab_size=50, seq_len=16, pad_token_id=0, eos_token_id=1))
    assert DistillLoss(other, alpha=0.0, temperature=2.0)(model, batch)[0].item() == pytest.approx(hard.item())
    assert DistillLoss(other, alpha=1.0, temperature=2.0)(model, batch)[0].item() > 0
    model.eval()  # evaluation scores the plain next-token loss whatever alpha is
    assert DistillLoss(other, alpha=1.0, temperature=2.0)(model, batch)[0].item() == pytest.approx(
        causal_lm_loss(model, batch)[0].item())


@pytest.mark.slow
def test_distill_command_learns_and_reports_teacher_and_baseline(tmp_path):
    import mlflow

    from crawl2chat.tasks.train import launch_training

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text())
    teacher_run = tmp_path / "teacher"
    launch_training("pretrain", {"data": str(corpus)}, str(teacher_run), max_steps=60, overrides=TEACHER)
    teacher = teacher_run / "model"

    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    sets = [f"distill.train.{s}" for s in ("seq_len=64", "micro_batch_size=8", "lr=3e-3", "warmup_steps=5",
                                           "eval_every=0", "eval_batches=4", "checkpoint_every=20")]
    cmd = [sys.executable, "-m", "crawl2chat.cli", "distill", "--teacher", str(teacher), "--data", str(corpus),
           "--out", str(tmp_path / "runs"), "--max-steps", "40", "--preset", "tiny",
           "--set", f"home={tmp_path / 'home'}"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "distill model:" in proc.stdout and "same student without the teacher" in proc.stdout

    run_dir = next(p for p in (tmp_path / "runs").iterdir() if (p / "metrics.json").exists())
    m = json.loads((run_dir / "metrics.json").read_text())
    index = json.loads((run_dir / "data" / "index.json").read_text())
    tokens_per_byte = index["val"]["tokens"] / index["val"]["bytes"]
    untrained_bpb = math.log(300) * tokens_per_byte / math.log(2)  # a uniform guess over the vocabulary
    assert m["steps"] == 40 and m["val_bpb"] < 0.7 * untrained_bpb
    assert m["teacher_val_bpb"] < untrained_bpb and math.isfinite(m["without_teacher_val_bpb"])
    assert m["params"] < m["teacher_params"] and m["alpha"] == 0.5
    # The teacher's held-out split and tokenizer are the student's.
    assert json.loads((run_dir / "model" / "held_out_split.json").read_text()) == json.loads(
        (teacher / "held_out_split.json").read_text())
    assert (run_dir / "without_teacher" / "model" / "config.json").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert len(AutoTokenizer.from_pretrained(run_dir / "model")) == len(AutoTokenizer.from_pretrained(teacher))

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["crawl2chat"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("crawl2chat.stage") == "distill"]
    assert run.data.metrics["teacher_val_bpb"] == pytest.approx(m["teacher_val_bpb"])
    # The teacher is an input of the run (the folder here: it came from outside this tracking store).
    assert any(str(teacher) in v for v in {**run.data.params, **run.data.tags}.values()), run.data.params
