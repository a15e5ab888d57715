"""Pipeline parallelism (``pp_size``) through the real ``accelerate launch`` on the CPU
(gloo): a 2-stage pipeline (1F1B, and GPipe) against a 1-process run of the same global
batch over 20 steps, its gathered Hugging Face folder loaded in one process, resume
from a pipeline checkpoint against the uninterrupted pipeline run, and the refusals of
a pp_size the layout or the model cannot be split by."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crawl2chat.stages.training.models import model_config
from crawl2chat.stages.training.pipeline import check_pp_size, stage_layers
from crawl2chat.stages.training.settings import PretrainConfig, SFTConfig
from crawl2chat.stages.training.trainer import read_metrics
from parallel_reference import STEPS, assert_same_weights, load_and_score_like, train
from test_pretrain import steps

# The reference (tests/parallel_reference.py): tiny preset, 20 steps, 4 sequences a step in one
# process, constant learning rate after warmup; every layout here sees the same global batch.
PP = ("pp_size=2", "micro_batch_size=2", "grad_accum=2", "eval_batches=8")
RTOL = 1e-4  # losses of the pipeline run against the 1-process run
WEIGHT_ATOL = 1e-4  # trained weights, pipeline against 1 process


@pytest.fixture(scope="module")
def shared(parallel_reference):
    return parallel_reference


@pytest.fixture(scope="module")
def runs(shared):
    return {"single": shared["single"], "pp": train(shared, "pp", *PP, num_processes=2)}


def losses(out) -> np.ndarray:
    return np.array([steps(out)[s]["loss"] for s in range(1, STEPS + 1)])


def assert_matches_single(out, single) -> dict:
    metrics = json.loads((out / "metrics.json").read_text())
    ref_metrics = json.loads((single / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["tokens"] == ref_metrics["tokens"]
    ref, got = losses(single), losses(out)
    print(f"{out.name} vs 1 process over {STEPS} steps: max abs diff {np.abs(got - ref).max():.3g}, "
          f"max rel diff {(np.abs(got - ref) / np.abs(ref)).max():.3g}")
    np.testing.assert_allclose(got, ref, rtol=RTOL)
    gn_ref = np.array([steps(single)[s]["grad_norm"] for s in range(1, STEPS + 1)])
    gn = np.array([steps(out)[s]["grad_norm"] for s in range(1, STEPS + 1)])
    np.testing.assert_allclose(gn, gn_ref, rtol=1e-3)  # clipping saw every stage's gradient, the tied matrix once
    assert metrics["val_loss"] == pytest.approx(ref_metrics["val_loss"], rel=RTOL)
    assert_same_weights(out, single, WEIGHT_ATOL)
    return metrics


def test_pipeline_matches_one_process_and_saves_a_whole_model(runs):
    single, pp = runs["single"], runs["pp"]
    metrics = assert_matches_single(pp, single)
    assert metrics["world_size"] == 2 and metrics["pp_size"] == 2 and metrics["params"] == \
        json.loads((single / "metrics.json").read_text())["params"]

    # The folder holds the whole model (both stages), loads in one process, and scores as the 1-process one.
    assert load_and_score_like(pp, single).config.num_hidden_layers == 2


def test_pipeline_resume_matches_uninterrupted(shared, runs):
    # Stopped after step 12 (checkpoint at 10), then the same command to 20: resumes from step 10.
    out = train(shared, "pp_resumed", *PP, num_processes=2, max_steps=12)
    ckpt = out / "checkpoints" / "step_00000010"
    assert json.loads((ckpt / "parallel_layout.json").read_text()) == {"tp_size": 1, "pp_size": 2, "dp_shard": False, "num_processes": 2}
    assert not (ckpt / "model.safetensors").exists()
    # Each rank wrote its own stage: the first the embedding and layer 0, the last layer 1,
    # the final norm and the output head (the tied embedding's copy), with their optimizer state.
    r0, r1 = load_file(ckpt / "rank0_state.safetensors"), load_file(ckpt / "rank1_state.safetensors")
    m0 = {k for k in r0 if k.startswith("model.")}
    m1 = {k for k in r1 if k.startswith("model.")}
    assert "model.model.embed_tokens.weight" in m0 and all(".layers.0." in k for k in m0 - {"model.model.embed_tokens.weight"})
    assert {"model.model.norm.weight", "model.lm_head.weight"} <= m1 and not any(".layers.0." in k for k in m1)
    # The tied matrix took the same steps on both stages.
    assert torch.equal(r0["model.model.embed_tokens.weight"], r1["model.lm_head.weight"])
    assert any(k.startswith("optim.") for k in r0) and any(k.startswith("optim.") for k in r1)

    train(shared, "pp_resumed", *PP, num_processes=2, max_steps=STEPS)
    resumes = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [10]
    full, got = steps(runs["pp"]), steps(out)
    assert [got[s]["loss"] for s in range(1, STEPS + 1)] == [full[s]["loss"] for s in range(1, STEPS + 1)]
    a, b = load_file(runs["pp"] / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_gpipe_schedule_matches_one_process(shared, runs):
    """GPipe over four one-row micro-batches, each stage recomputing its layers'
    activations in the backward pass: the same 4 rows, the same losses."""
    out = train(shared, "pp_gpipe", "pp_size=2", "pp_schedule=gpipe", "micro_batch_size=1", "grad_accum=4",
                "eval_batches=16", "grad_checkpointing=true", num_processes=2)
    start = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start")
    assert start["grad_checkpointing"] is True and start["pp_size"] == 2
    assert_matches_single(out, runs["single"])


def test_pp_size_is_refused_where_it_cannot_split():
    with pytest.raises(ValueError, match=r"pp_size=3 must divide the number of processes \(2\)"):
        check_pp_size(3, 2)
    check_pp_size(2, 4)  # 2 pipelines of 2 stages, data-parallel between them
    tiny = model_config("tiny", vocab_size=64, seq_len=16)  # 2 layers
    check_pp_size(2, 2, tiny)
    with pytest.raises(ValueError, match=r"pp_size=4 is more stages than the model's 2 layers"):
        check_pp_size(4, 4, tiny)
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="pp_size"):
        PretrainConfig(pp_size=0)
    with pytest.raises(ValueError, match="pp_schedule"):
        PretrainConfig(pp_schedule="interleaved")
    with pytest.raises(ValueError, match="pp_size"):  # pipeline parallelism is pretraining's
        SFTConfig(pp_size=2)


def test_tensor_and_pipeline_together_are_refused():
    with pytest.raises(ValueError, match="tp_size=2 and pp_size=2 together are not supported"):
        PretrainConfig(tp_size=2, pp_size=2)
