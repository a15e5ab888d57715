"""DeepSpeed ZeRO-2 through the real ``accelerate launch`` on the CPU (gloo): one and
two processes against a plain single-process run at the same global batch,
resume from a DeepSpeed checkpoint, NaN rollback, and the Hugging Face output.
Skipped where the ``deepspeed`` package is not installed."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crawl2chat.infra.launch import accelerate_command, accelerate_config_path, distributed_type
from crawl2chat.stages.training.pretrain import TokenWindows, causal_lm_loss, prepare_data
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.stages.training.trainer import read_metrics
from crawl2chat.tasks.train import launch_training
from test_pretrain import BASE, corpus_text, steps

# Constant learning rate after warmup: a run stopped early and resumed with a
# larger max_steps then follows the same schedule as an uninterrupted one.
# Global batch 16 sequences in every layout.
COMMON = [*BASE, "schedule=constant", "checkpoint_every=10", "eval_every=0"]
STEPS = 40


def test_deepspeed_config_gets_deepspeeds_launcher(tmp_path):
    for n in (1, 2):
        cmd = accelerate_command("m", [], num_processes=n, accelerate_config="deepspeed", cpu=True)
        # Neither --cpu nor ACCELERATE_USE_CPU: either would switch DeepSpeed off.
        assert "--multi_gpu" not in cmd and "--cpu" not in cmd and not any("ACCELERATE_USE_CPU" in c for c in cmd)
        assert "--main_process_port" in cmd and cmd[cmd.index("--config_file") + 1].endswith("deepspeed.yaml")
    # The mode is read from the file, not guessed from its name.
    assert distributed_type(accelerate_config_path("deepspeed")) == "DEEPSPEED"
    renamed = tmp_path / "sharded.yaml"
    renamed.write_text(accelerate_config_path("fsdp").read_text())
    assert "--multi_gpu" not in accelerate_command("m", [], num_processes=8, accelerate_config=str(renamed), cpu=False)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    pytest.importorskip("deepspeed")
    if shutil.which("g++") is None:
        pytest.skip("DeepSpeed builds its CPU communication extension with g++, which this machine lacks")
    root = tmp_path_factory.mktemp("deepspeed")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    tok_dir, _ = prepare_data(PretrainConfig(vocab_size=320, val_fraction=0.1), corpus, root / "prep")
    return {"root": root, "corpus": corpus, "tok": tok_dir}


def train(shared, name: str, *extra: str, num_processes: int = 1, deepspeed: bool | str = True,
          max_steps: int = STEPS):
    out = shared["root"] / name
    config = deepspeed if isinstance(deepspeed, str) else "deepspeed" if deepspeed else None
    launch_training("pretrain", {"data": str(shared["corpus"])}, str(out), max_steps=max_steps, num_processes=num_processes,
           accelerate_config=config,
           overrides=[*COMMON, f"tokenizer={shared['tok']}", *extra])
    return out


@pytest.fixture(scope="module")
def plain(shared):
    """No DeepSpeed: one process, 4 sequences x 4 accumulation steps."""
    return train(shared, "plain", "grad_accum=4", deepspeed=False)


def losses(out) -> np.ndarray:
    log = steps(out)
    assert sorted(log) == list(range(1, STEPS + 1))
    return np.array([log[s]["loss"] for s in range(1, STEPS + 1)])


def assert_matches_plain(out, plain) -> dict:
    got, ref = losses(out), losses(plain)
    assert got[-5:].mean() < got[:5].mean() - 1.0, got  # it learns
    np.testing.assert_allclose(got[:20], ref[:20], rtol=1e-4)
    np.testing.assert_allclose(got, ref, rtol=2e-3)
    metrics = json.loads((out / "metrics.json").read_text())
    ref_metrics = json.loads((plain / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["rollbacks"] == 0
    assert metrics["val_loss"] == pytest.approx(ref_metrics["val_loss"], rel=2e-3)
    return metrics


@pytest.mark.slow
def test_one_process_matches_plain_and_saves_hf_model(shared, plain):
    """Accumulation inside the engine (4 micro-batches per step), clipping at 1.0."""
    from transformers import AutoModelForCausalLM

    out = train(shared, "ds1", "grad_accum=4")
    metrics = assert_matches_plain(out, plain)
    assert metrics["world_size"] == 1
    # The gradient norm DeepSpeed reports is the one before clipping, as torch's.
    ds_norms = [steps(out)[s]["grad_norm"] for s in range(1, STEPS + 1)]
    ref_norms = [steps(plain)[s]["grad_norm"] for s in range(1, STEPS + 1)]
    np.testing.assert_allclose(ds_norms, ref_norms, rtol=2e-3)
    assert max(ref_norms) > 1.0  # so clipping was in play
    assert (out / "checkpoints" / "step_00000030" / "pytorch_model").is_dir()  # DeepSpeed's checkpoint layout

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    ref, got = load_file(plain / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    # accelerate clones DeepSpeed's tensors one by one for saving, which unties the
    # output head from the embedding: it is saved as an equal copy of its own.
    assert set(got) - set(ref) <= {"lm_head.weight"} and set(ref) <= set(got)
    if "lm_head.weight" in got:
        assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-3, atol=1e-4, msg=k)
    val = TokenWindows(out / "data", PretrainConfig(seq_len=64, micro_batch_size=4, eval_batches=4))
    with torch.no_grad():
        val_losses = [causal_lm_loss(model, b)[0].item() for b in val.eval_batches(0, 1)]
    assert np.mean(val_losses) == pytest.approx(metrics["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_two_processes_resumed_match_plain(shared, plain):
    """ZeRO-2 over 2 processes x 2 accumulation steps, stopped at step 25 and resumed
    from its step-20 checkpoint (sharded optimizer state) up to step 40."""
    train(shared, "ds2", "grad_accum=2", num_processes=2, max_steps=25)
    shards = sorted(p.name for p in (shared["root"] / "ds2" / "checkpoints" / "step_00000020" / "pytorch_model").iterdir())
    assert [p for p in shards if "optim_states" in p] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                           "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    out = train(shared, "ds2", "grad_accum=2", num_processes=2)
    resumes = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [20]
    assert assert_matches_plain(out, plain)["world_size"] == 2


def test_nan_rolls_back_under_deepspeed(shared):
    """The engine has already stepped when the trainer sees the NaN; reloading the
    checkpoint undoes it all the same."""
    out = train(shared, "nan", "grad_accum=1", "inject_nan_at_batches=[15]", "rollback.lr_factor=0.5",
                num_processes=2, max_steps=30)
    records = read_metrics(out / "metrics.jsonl")
    rollbacks = [r for r in records if r.get("event") == "rollback"]
    assert len(rollbacks) == 1
    rb = rollbacks[0]
    assert rb["step"] == 16 and rb["reason"] == "non-finite loss" and rb["resumed_step"] == 10
    after = [r for r in records[records.index(rb) + 1:] if r["type"] == "step"]
    before = {r["step"]: r for r in records[:records.index(rb)] if r["type"] == "step"}
    assert after[0]["step"] == 11 and after[0]["lr"] == pytest.approx(0.5 * before[11]["lr"])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 30 and metrics["rollbacks"] == 1 and math.isfinite(metrics["val_loss"])
    assert all(math.isfinite(r["loss"]) for r in records if r["type"] == "step")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["deepspeed_zero3", "deepspeed_zero3_offload"])
def test_zero3_two_processes_match_plain(shared, plain, config):
    """ZeRO-3 (parameters sharded too; and with optimizer and parameters offloaded to
    host memory) over 2 processes x 2 accumulation steps follows the plain run, and
    its gathered model loads in one process with the plain run's weights."""
    from transformers import AutoModelForCausalLM

    assert distributed_type(accelerate_config_path(config)) == "DEEPSPEED"
    out = train(shared, config, "grad_accum=2", num_processes=2, deepspeed=config)
    assert assert_matches_plain(out, plain)["world_size"] == 2
    AutoModelForCausalLM.from_pretrained(out / "model")
    ref, got = load_file(plain / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-3, atol=1e-4, msg=k)


def test_compile_is_refused_under_deepspeed(shared):
    from crawl2chat.tasks.train import StageFailed

    with pytest.raises(StageFailed) as err:
        train(shared, "compiled", "compile=true", max_steps=2)
    assert "compile=true runs over the plain or DDP accelerate configs, not DEEPSPEED" in err.value.message
    assert not (shared["root"] / "compiled" / "model").exists()
