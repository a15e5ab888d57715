"""Pretraining through the real ``accelerate launch``: resume after SIGKILL, NaN
rollback, 2-process DDP against one process, and the Hugging Face output."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from crawl2chat.stages.settings import SettingsError
from crawl2chat.infra.launch import LaunchError, NodeLayout, accelerate_command, run_streaming, simple_launch
from crawl2chat.stages.training.pretrain import TokenWindows, causal_lm_loss, prepare_data
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.stages.settings import load_settings, parse_overrides
from crawl2chat.stages.training.registry import STAGES
from crawl2chat.tasks.train import TRAINING_ALLOCATOR_ENV, StageFailed, launch_stage, launch_training
from crawl2chat.stages.training.trainer import (Trainer, all_finite, build_optimizer, build_scheduler,
                                               clip_by_global_norm, make_accelerator, read_metrics)
from crawl2chat.stages.training.settings import TrainConfig

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"

# Tiny model, 64-token windows: a step takes ~15-30 ms on one CPU core.
BASE = ["preset=tiny", "seq_len=64", "micro_batch_size=4", "lr=3e-3", "min_lr=3e-4", "warmup_steps=5",
        "eval_batches=4", "val_fraction=0.1", "clip_norm=1.0"]


def corpus_text(n_lines: int = 6000, seed: int = 0) -> str:
    words = ("the king queen night day sword crown river stone bright dark speak answer gentle noble "
             "fool heart blood honour tomorrow love death war peace lord lady").split()
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A corpus and a tokenizer every run reuses (``tokenizer=`` skips retraining)."""
    root = tmp_path_factory.mktemp("pretrain")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    cfg = PretrainConfig(vocab_size=320, val_fraction=0.1)
    tok_dir, _ = prepare_data(cfg, corpus, root / "prep")
    return {"root": root, "corpus": corpus, "tok": tok_dir}


def run_args(shared, name: str, *extra: str) -> tuple[Path, list[str]]:
    out = shared["root"] / name
    return out, [*BASE, f"tokenizer={shared['tok']}", *extra]


def train(shared, name: str, *extra: str, num_processes: int = 1, max_steps: int = 60) -> Path:
    out, overrides = run_args(shared, name, *extra)
    launch_training("pretrain", {"data": str(shared["corpus"])}, str(out), max_steps=max_steps, num_processes=num_processes, overrides=overrides)
    return out


def steps(out: Path) -> dict[int, dict]:
    """Last logged record per step (a resumed run re-logs the steps after its checkpoint)."""
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"}


@pytest.fixture(scope="module")
def reference(shared):
    """Uninterrupted single-process run: global batch 8 = 4 sequences x 2 accumulation steps."""
    return train(shared, "reference", "grad_accum=2", "checkpoint_every=20", "eval_every=30", max_steps=120)


def test_reference_run_outputs_hf_model(reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = json.loads((reference / "metrics.json").read_text())
    for key in ("val_loss", "val_bpb", "tokens_per_second", "steps", "mfu"):
        assert math.isfinite(metrics[key]), key
    # The peak it is measured against is the higher of two measurements (start and end): a
    # peak measured while the machine was busy would give an MFU above 1.
    assert 0 < metrics["mfu"] <= 1 and metrics["peak_flops_per_device"] > 0
    assert metrics["steps"] == 120 and metrics["rollbacks"] == 0
    log = steps(reference)
    assert sorted(log) == list(range(1, 121))
    first, last = np.mean([log[s]["loss"] for s in range(1, 6)]), np.mean([log[s]["loss"] for s in range(110, 121)])
    assert last < first - 1.0, (first, last)  # it learns
    assert metrics["val_loss"] < math.log(metrics["vocab_size"]) - 1.0
    assert {"tokens_per_second", "mfu", "lr", "grad_norm"} <= set(log[120])
    # Only the newest checkpoints are kept, never a half-written one.
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step_00000080", "step_00000100"]

    model_dir = reference / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in model_dir.iterdir()}
    # Readable as the user's other files are (safetensors alone writes its file owner-only).
    from crawl2chat.stages.file_modes import umask_mode

    assert (model_dir / "model.safetensors").stat().st_mode & 0o777 == umask_mode()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    inputs = tok("the king", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8
    # The saved weights are the trained ones: the loaded model reproduces the validation loss.
    val = TokenWindows(reference / "data", PretrainConfig(seq_len=64, micro_batch_size=4, eval_batches=4))
    with torch.no_grad():
        losses = [causal_lm_loss(model, b)[0].item() for b in val.eval_batches(0, 1)]
    assert len(losses) == 4 and np.mean(losses) == pytest.approx(metrics["val_loss"], rel=1e-5)


def test_rerunning_a_finished_run_is_a_no_op(shared, reference):
    before = (reference / "metrics.jsonl").read_text()
    train(shared, "reference", "grad_accum=2", "checkpoint_every=20", "eval_every=30", max_steps=120)
    assert (reference / "metrics.jsonl").read_text() == before
    assert "already finished 120 steps" in (reference / "train.log").read_text()


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(shared, reference):
    out, overrides = run_args(shared, "killed", "grad_accum=2", "checkpoint_every=20", "eval_every=30")
    argv = ["--data", str(shared["corpus"]), "--out", str(out), "--max-steps", "120"]
    for o in overrides:
        argv += ["--set", o]
    prepare_data(load_settings(PretrainConfig, None, parse_overrides(overrides)), shared["corpus"], out)
    cmd = accelerate_command(STAGES["pretrain"].module, argv, num_processes=1, cpu=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and max(steps(out), default=0) < 45 and proc.poll() is None:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its training child
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = max(steps(out))
    assert 45 <= killed_at < 120
    assert not (out / "model").exists()

    # Same command again: resumes from the newest checkpoint and finishes.
    launch_training("pretrain", {"data": str(shared["corpus"])}, str(out), max_steps=120, overrides=overrides)
    resumes = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    last_ckpt = (killed_at // 20) * 20  # or the one before, when the kill hit a save in progress
    assert len(resumes) == 1 and resumes[0]["step"] in (last_ckpt, last_ckpt - 20)

    ref, got = load_file(reference / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)
    ref_log, got_log = steps(reference), steps(out)
    assert [got_log[s]["loss"] for s in range(1, 121)] == [ref_log[s]["loss"] for s in range(1, 121)]


@pytest.mark.slow
def test_two_process_ddp_matches_one_process(shared, reference):
    """Same global batch (2 processes x 4 sequences vs 1 process x 4 x 2 accumulation)."""
    out = train(shared, "ddp", "grad_accum=1", "checkpoint_every=20", "eval_every=30", num_processes=2, max_steps=120)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 120
    assert_follows_reference(out, reference)


def assert_follows_reference(out: Path, reference: Path) -> None:
    """The 120 steps' losses of ``out`` within float rounding of the reference run's
    (closer over the first 20, before the differences compound), and its validation loss."""
    ref_log, got_log = steps(reference), steps(out)
    ref_loss = np.array([ref_log[s]["loss"] for s in range(1, 121)])
    got_loss = np.array([got_log[s]["loss"] for s in range(1, 121)])
    np.testing.assert_allclose(got_loss[:20], ref_loss[:20], rtol=1e-4)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=2e-3)
    ref_metrics, metrics = (json.loads((p / "metrics.json").read_text()) for p in (reference, out))
    assert metrics["val_loss"] == pytest.approx(ref_metrics["val_loss"], rel=2e-3)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_compiled_step_matches_eager_and_rolls_back(shared, reference):
    """``compile=true``: the same losses as the eager reference, the same saved model format,
    and a rollback (weights reloaded under the compiled step) that goes on training."""
    kernels = shared["root"] / "inductor-cache"  # where these runs' compiled kernels are written

    def train_compiled(name: str, *extra: str, max_steps: int) -> Path:
        out, overrides = run_args(shared, name, "compile=true", *extra)
        launch_training("pretrain", {"data": str(shared["corpus"])}, str(out), max_steps=max_steps,
                        overrides=overrides, env={"TORCHINDUCTOR_CACHE_DIR": str(kernels)})
        return out

    out = train_compiled("compiled", "grad_accum=2", "checkpoint_every=20", "eval_every=30", max_steps=120)
    assert any(p.suffix == ".cpp" for p in kernels.rglob("*")), "nothing was compiled"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["compile"] is True and metrics["steps"] == 120
    start = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start")
    assert start["compile"] is True
    assert_follows_reference(out, reference)
    assert load_file(out / "model" / "model.safetensors").keys() == load_file(
        reference / "model" / "model.safetensors").keys()  # the module, not a compiled wrapper, was saved

    out = train_compiled("compiled-nan", "checkpoint_every=10", "eval_every=0", "inject_nan_at_batches=[15]",
                         max_steps=30)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 30 and metrics["rollbacks"] == 1 and math.isfinite(metrics["val_loss"])
    log = steps(out)
    assert log[30]["loss"] < log[1]["loss"] and all(math.isfinite(r["loss"]) for r in log.values())


def test_compile_is_refused_where_it_is_not_supported(shared, monkeypatch):
    with pytest.raises(ValidationError, match="compile=true is not supported with tp_size=2"):
        PretrainConfig(compile=True, tp_size=2)
    with pytest.raises(ValidationError, match="compile=true is not supported with pp_size=2"):
        PretrainConfig(compile=True, pp_size=2)
    # A CPU machine without the C++ compiler the kernels are built with: refused before training.
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(StageFailed) as err:
        train(shared, "no-compiler", "compile=true", max_steps=2)
    assert "compile=true on the CPU builds C++ kernels with no-such-compiler, which this machine lacks" \
        in err.value.message
    assert not (shared["root"] / "no-compiler" / "model").exists()

def test_injected_nan_rolls_back_and_finishes(shared):
    out = train(shared, "nan", "checkpoint_every=10", "eval_every=0", "inject_nan_at_batches=[15]",
                "rollback.lr_factor=0.5", max_steps=30)
    events = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "event"]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1
    rb = rollbacks[0]
    assert rb["step"] == 16 and rb["batch_index"] == 15 and rb["reason"] == "non-finite loss"
    assert rb["checkpoint"] == "step_00000010" and rb["resumed_step"] == 10 and rb["lr_scale"] == 0.5
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 30 and metrics["rollbacks"] == 1 and math.isfinite(metrics["val_loss"])
    # The batches from the checkpoint to the bad one are skipped, not replayed; the lr is halved.
    records = read_metrics(out / "metrics.jsonl")
    log = [r for r in records if r["type"] == "step"]
    after = [r for r in records[records.index(rb) + 1:] if r["type"] == "step"]
    assert after[0]["step"] == 11 and all(math.isfinite(r["loss"]) for r in log)
    cfg = PretrainConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5, max_steps=30)
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg)
    sched = build_scheduler(opt, cfg)
    for _ in range(10):
        opt.step()
        sched.step()
    assert after[0]["lr"] == pytest.approx(0.5 * sched.get_last_lr()[0])


def test_repeated_nans_fail_with_clear_message(shared):
    with pytest.raises(StageFailed) as err:
        train(shared, "diverge", "checkpoint_every=10", "eval_every=0", "inject_nan_at_batches=[3,4,5]",
              "rollback.max_rollbacks=2", max_steps=20)
    assert err.value.kind == "diverged" and "after 2 rollbacks in a row" in err.value.message
    assert "TrainingDiverged" in err.value.__cause__.tail
    events = [r["event"] for r in read_metrics(shared["root"] / "diverge" / "metrics.jsonl") if r["type"] == "event"]
    assert events.count("rollback") == 2 and events[-1] == "diverged"


def test_loss_spike_rolls_back_in_process(shared, tmp_path):
    """The Trainer on its own: a loss 100x the recent mean at batch 12 is a spike."""
    from crawl2chat.stages.training.models import build_model, model_config

    cfg = load_settings(PretrainConfig, None, {**parse_overrides(BASE), "max_steps": 20, "checkpoint_every": 8,
                                             "eval_every": 0, "rollback": {"spike_window": 5, "spike_factor": 3.0}})
    prepare_data(cfg.model_copy(update={"tokenizer": str(shared["tok"])}), shared["corpus"], tmp_path)
    acc = make_accelerator(cfg)
    windows = TokenWindows(tmp_path / "data", cfg)
    model = build_model(model_config("tiny", vocab_size=320, seq_len=cfg.seq_len))

    def loss_fn(m, batch):
        loss, n = causal_lm_loss(m, batch)
        return (loss * 100 if batch.get("spike") is not None else loss), n

    def batch_fn(index, micro, rank, world):
        b = windows.batch(index, micro, rank, world)
        return {**b, "spike": torch.ones(1)} if index == 12 else b

    trainer = Trainer(cfg, acc, model, tmp_path, batch_fn=batch_fn, loss_fn=loss_fn)
    summary = trainer.fit()
    assert summary["steps"] == 20 and summary["rollbacks"] == 1
    rb = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "rollback"][0]
    assert rb["reason"].startswith("loss spike") and rb["resumed_step"] == 8 and rb["batch_index"] == 12
    assert trainer.state.batch_index == 13 + (20 - 8)  # data resumed after the spike


def test_global_batch_is_independent_of_layout(shared, tmp_path):
    prepare_data(PretrainConfig(tokenizer=str(shared["tok"]), val_fraction=0.1), shared["corpus"], tmp_path)
    one = TokenWindows(tmp_path / "data", PretrainConfig(seq_len=16, micro_batch_size=2, grad_accum=4))
    four = TokenWindows(tmp_path / "data", PretrainConfig(seq_len=16, micro_batch_size=2, grad_accum=1))
    rows_one = torch.cat([one.batch(7, m, 0, 1)["tokens"] for m in range(4)])
    rows_four = torch.cat([four.batch(7, 0, r, 4)["tokens"] for r in range(4)])
    assert rows_one.shape == (8, 17) and torch.equal(rows_one, rows_four)
    assert not torch.equal(one.batch(8, 0, 0, 1)["tokens"], one.batch(7, 0, 0, 1)["tokens"])
    # Validation windows are split across ranks without overlap or loss.
    val_one = torch.cat([b["tokens"] for b in one.eval_batches(0, 1)])
    val_two = torch.cat([b["tokens"] for r in range(2) for b in four.eval_batches(r, 2)])
    assert sorted(map(tuple, val_one.tolist())) == sorted(map(tuple, val_two.tolist()))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "polynomial", "step", "wsd", "constant"])
def test_schedules_warm_up_then_decay_to_min(schedule):
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, schedule=schedule, step_every=30,
                      step_gamma=0.5)
    opt = build_optimizer(torch.nn.Linear(4, 4), cfg)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] < lrs[9] <= 1.0 and max(lrs) == pytest.approx(1.0, abs=0.11)
    if schedule == "constant":
        assert lrs[-1] == pytest.approx(1.0)
    else:
        assert lrs[-1] < 0.6 and min(lrs[10:]) >= 0.1 - 1e-9
        assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))  # never rises after warmup
    if schedule == "wsd":
        assert lrs[50] == pytest.approx(1.0)  # stable phase


def test_lion_and_weight_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, TrainConfig(optimizer="lion", weight_decay=0.2))
    assert type(opt).__name__ == "Lion"
    decays = {p.dim(): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decays == {2: 0.2, 1: 0.0}


@pytest.mark.parametrize("scale", [1e-4, 1.0])
def test_clipping_matches_torch_bit_for_bit(scale):
    """Below the limit the gradients are left as they were; above it they are torch's
    clipped ones, to the bit; the norm returned is torch's."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    grads = [torch.randn(64, 32) * scale, torch.randn(32) * scale, torch.randn(7, 3) * scale]
    ours = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for a, b, g in zip(ours, ref, grads):
        a.grad, b.grad = g.clone(), g.clone()
    unused = torch.nn.Parameter(torch.zeros(3))  # no gradient: not counted
    norm = clip_by_global_norm(Accelerator(cpu=True), ours + [unused], 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert float(norm) == float(expected) and (float(norm) > 1.0) == (scale == 1.0)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, ref))
    if scale < 1:
        assert all(torch.equal(a.grad, g) for a, g in zip(ours, grads))


def test_all_finite_is_exact_where_the_norm_overflows():
    ts = [torch.zeros(5), torch.ones(3)]
    assert all_finite(ts) and all_finite([])
    ts[1][1] = 3e38  # finite, but its square overflows the norm: read one by one
    assert all_finite(ts)
    for bad in (float("nan"), float("inf"), -float("inf")):
        ts[0][2] = bad
        assert not all_finite(ts)


def test_config_from_yaml_with_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("preset: cpu\nlr: 0.0006\nrollback:\n  max_rollbacks: 5\n")
    cfg = load_settings(PretrainConfig, p, parse_overrides(["lr=1e-3", "rollback.lr_factor=0.25"]))
    assert (cfg.preset, cfg.lr, cfg.rollback.max_rollbacks, cfg.rollback.lr_factor) == ("cpu", 1e-3, 5, 0.25)
    with pytest.raises(ValueError):
        load_settings(PretrainConfig, None, {"learning_rate": 1e-3})  # unknown field


def test_accelerate_command_and_streaming_failure(tmp_path):
    single = accelerate_command("m", ["--x"], num_processes=1, cpu=True)
    assert single[:2] == ["env", "ACCELERATE_USE_CPU=true"] and "--cpu" in single
    assert single[-3:] == ["-m", "m", "--x"] and single[single.index("--config_file") + 1].endswith("cpu.yaml")
    ddp = accelerate_command("m", [], num_processes=2, cpu=True)
    assert "--multi_gpu" in ddp and ddp[ddp.index("--config_file") + 1].endswith("cpu_ddp.yaml")
    fsdp = accelerate_command("m", [], num_processes=8, accelerate_config="fsdp", cpu=False)
    assert "--multi_gpu" not in fsdp and fsdp[fsdp.index("--config_file") + 1].endswith("fsdp.yaml")
    # On CPU, Accelerate would drop FSDP and train plain DDP: refused, not ignored.
    with pytest.raises(SettingsError, match="accelerate_config=fsdp asks for FSDP"):
        accelerate_command("m", [], num_processes=2, accelerate_config="fsdp", cpu=True)
    # One machine of several: its rank and the main machine's rendezvous, the total process count.
    for config in (None, "fsdp"):
        multi = accelerate_command("m", [], num_processes=16, accelerate_config=config, cpu=False,
                                   node=NodeLayout(nodes=2, rank=1, main_ip="127.0.0.1", main_port=29555))
        flags = {multi[i]: multi[i + 1] for i in range(len(multi) - 1) if multi[i].startswith("--")}
        assert (flags["--num_machines"], flags["--machine_rank"], flags["--main_process_ip"],
                flags["--main_process_port"], flags["--num_processes"]) == ("2", "1", "127.0.0.1", "29555", "16")
    with pytest.raises(ValueError, match="num_processes=3 must split evenly over 2 nodes"):
        accelerate_command("m", [], num_processes=3, node=NodeLayout(2, 0, "127.0.0.1", 29555))

    lines = []
    script = "import sys\nfor i in range(100): print('line', i)\nsys.exit('boom')"
    with pytest.raises(LaunchError) as err:
        run_streaming(["python3", "-c", script], log_path=tmp_path / "log.txt", on_line=lines.append, tail_lines=5)
    assert lines[:2] == ["line 0", "line 1"] and "boom" in err.value.tail and "line 0" not in err.value.tail
    assert err.value.returncode == 1 and (tmp_path / "log.txt").read_text().count("\n") == 101
    assert run_streaming(["python3", "-c", "print('ok')"], on_line=lines.append) == 0 and lines[-1] == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the thresholds are set for training on the CPU")
def test_training_processes_start_with_fixed_allocator_thresholds(tmp_path, monkeypatch):
    """What the launched process really sees: the thresholds, unless this environment sets its own."""
    (tmp_path / "envprobe.py").write_text("import json, os, sys\n"
                                          "json.dump({k: v for k, v in os.environ.items() if k.startswith('MALLOC_')},"
                                          " open(sys.argv[1], 'w'))\n")
    for name in TRAINING_ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    launch_stage("envprobe", [str(tmp_path / "a.json")], tmp_path / "a", env={"PYTHONPATH": str(tmp_path)})
    assert json.loads((tmp_path / "a.json").read_text()) == TRAINING_ALLOCATOR_ENV
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    launch_stage("envprobe", [str(tmp_path / "b.json")], tmp_path / "b", env={"PYTHONPATH": str(tmp_path)})
    assert json.loads((tmp_path / "b.json").read_text())["MALLOC_TRIM_THRESHOLD_"] == "0"


def test_work_done_while_the_launched_command_starts(tmp_path):
    """``meanwhile`` runs once the command has started, past a failing item, and the
    command's output still arrives whole."""
    started = tmp_path / "started"
    script = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(0.3); print('a'); print('b')"
    seen, lines = [], []

    def wait_for_start():
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(started.exists())

    assert run_streaming(["python3", "-c", script], on_line=lines.append, meanwhile=[lambda: 1 / 0, wait_for_start]) == 0
    assert seen == [True] and lines == ["a", "b"]
    # The training stages import what their evaluation loads while the ranks start up.
    from crawl2chat.tasks.train import _evaluation_imports

    assert len(_evaluation_imports("pretrain")) == 3
    assert _evaluation_imports(next(name for name, spec in STAGES.items() if spec.evaluation is None)) == []


def test_one_process_starts_as_accelerate_launch_would_start_it(tmp_path):
    """A one-process stage starts without accelerate's launcher process: the rank gets the
    same command line and the same environment as under the real ``accelerate launch``."""
    (tmp_path / "probe.py").write_text("import json, os, sys\n"
                                       "json.dump({'env': dict(os.environ), 'argv': sys.argv[1:]}, open(sys.argv[1], 'w'))\n")
    env = {"PYTHONPATH": str(tmp_path)}
    run_streaming(accelerate_command("probe", [str(tmp_path / "cli.json"), "--x"]), env=env)
    launch_stage("probe", [str(tmp_path / "direct.json"), "--x"], tmp_path / "direct", env=env)
    cli, direct = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("cli", "direct"))
    assert cli["argv"][1:] == direct["argv"][1:] == ["--x"]
    for name in TRAINING_ALLOCATOR_ENV:  # launch_stage's own additions, not the launcher's
        direct["env"].pop(name, None), cli["env"].pop(name, None)
    for name in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        direct["env"].pop(name, None), cli["env"].pop(name, None)
    assert direct["env"] == cli["env"] and direct["env"]["ACCELERATE_MIXED_PRECISION"] == "no"
    rank_cmd, rank_env = simple_launch(accelerate_command("m", ["--x"], num_processes=1, cpu=True))
    assert rank_cmd[-3:] == ["-m", "m", "--x"] and "accelerate.commands.launch" not in rank_cmd
    assert rank_env["ACCELERATE_USE_CPU"] == "True"
    # Several processes go through accelerate's own launcher (torchrun, DeepSpeed's).
    assert simple_launch(accelerate_command("m", [], num_processes=2, cpu=True)) is None
    assert simple_launch(accelerate_command("m", [], num_processes=2, accelerate_config="fsdp", cpu=False)) is None


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="Tiny Shakespeare not available")
def test_tiny_shakespeare_learns(tmp_path):
    out = tmp_path / "shakespeare"
    launch_training("pretrain", {"data": str(SHAKESPEARE)}, str(out), max_steps=150,
           overrides=["preset=tiny", "vocab_size=512", "seq_len=64", "micro_batch_size=12", "lr=3e-3", "warmup_steps=10",
                      "eval_every=0", "checkpoint_every=0", "eval_batches=8", "val_fraction=0.1"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["val_bpb"] < 3.6  # a uniform guess over 512 tokens is ~4.9 bits per byte


def test_grad_checkpointing_gives_the_same_gradients():
    from crawl2chat.stages.training.models import build_model, flops_per_token, is_checkpointing, model_config, num_params

    conf = model_config("tiny", vocab_size=300, seq_len=32)
    torch.manual_seed(0)
    plain = build_model(conf)
    ckpt = build_model(model_config("tiny", vocab_size=300, seq_len=32), grad_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    assert is_checkpointing(ckpt) and not is_checkpointing(plain)
    batch = {"tokens": torch.randint(0, 300, (2, 33))}
    for m in (plain, ckpt):
        m.train()
        causal_lm_loss(m, batch)[0].backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    # Training FLOPs per token are at least 6 x the non-embedding parameters.
    assert flops_per_token(conf, 32) >= 6 * num_params(plain, non_embedding=True)
