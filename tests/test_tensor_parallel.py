"""Tensor parallelism (``tp_size``) through the real ``accelerate launch`` on the CPU
(gloo): a 2-process tensor-parallel run against a 1-process run of the same global
batch, its Hugging Face folder loaded in one process, and resume from a
tensor-parallel checkpoint against the uninterrupted tensor-parallel run, 4 processes
as two tensor-parallel groups with data parallelism between them; and the refusals of
a tp_size the layout or the model cannot be split by."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crawl2chat.stages.training.models import model_config
from crawl2chat.stages.training.parallel import LAYER_PLAN, check_tp_size
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.stages.training.trainer import read_metrics
from parallel_reference import STEPS, assert_same_weights, load_and_score_like, train
from test_pretrain import steps

# The reference (tests/parallel_reference.py): tiny preset, 20 steps, 4 sequences a step in one
# process, constant learning rate after warmup; every layout here sees the same global batch.
TP = ("tp_size=2", "micro_batch_size=2", "grad_accum=2", "eval_batches=8")
RTOL = 1e-4  # losses of the 2-process TP run against the 1-process run
WEIGHT_ATOL = 1e-4  # trained weights, TP against 1 process (sums split over ranks round differently)


@pytest.fixture(scope="module")
def shared(parallel_reference):
    return parallel_reference


@pytest.fixture(scope="module")
def runs(shared):
    # The TP run accumulates two micro-batches of 2 where the 1-process run takes one of 4: the same rows.
    return {"single": shared["single"], "tp": train(shared, "tp", *TP, num_processes=2)}


def test_tp_matches_one_process_and_saves_a_whole_model(runs):
    single, tp = runs["single"], runs["tp"]
    metrics = json.loads((tp / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["tp_size"] == 2 and metrics["steps"] == STEPS
    # One data stream: the tokens of a step are the global batch once, not once per rank.
    assert metrics["tokens"] == json.loads((single / "metrics.json").read_text())["tokens"]
    ref = np.array([steps(single)[s]["loss"] for s in range(1, STEPS + 1)])
    got = np.array([steps(tp)[s]["loss"] for s in range(1, STEPS + 1)])
    print(f"TP vs 1 process over {STEPS} steps: max abs diff {np.abs(got - ref).max():.3g}, "
          f"max rel diff {(np.abs(got - ref) / np.abs(ref)).max():.3g}")
    np.testing.assert_allclose(got, ref, rtol=RTOL)
    gn_ref = np.array([steps(single)[s]["grad_norm"] for s in range(1, STEPS + 1)])
    gn_tp = np.array([steps(tp)[s]["grad_norm"] for s in range(1, STEPS + 1)])
    np.testing.assert_allclose(gn_tp, gn_ref, rtol=1e-3)  # clipping saw the whole gradient
    assert metrics["val_loss"] == pytest.approx(json.loads((single / "metrics.json").read_text())["val_loss"],
                                                rel=RTOL)

    # The folder holds whole tensors, loads in one process, and matches the 1-process weights.
    have = assert_same_weights(tp, single, WEIGHT_ATOL)
    model = load_and_score_like(tp, single)
    for k, v in model.state_dict().items():
        if k in have:
            assert torch.equal(v, have[k]), k


def test_tp_resume_matches_uninterrupted(shared, runs):
    # Stopped after step 12 (checkpoint at 10), then the same command to 20: resumes from step 10.
    out = train(shared, "tp_resumed", *TP, num_processes=2, max_steps=12)
    ckpt = out / "checkpoints" / "step_00000010"
    assert sorted(p.name for p in ckpt.glob("rank*_state.*")) == [
        "rank0_state.json", "rank0_state.safetensors", "rank1_state.json", "rank1_state.safetensors"]
    assert json.loads((ckpt / "parallel_layout.json").read_text()) == {"tp_size": 2, "pp_size": 1, "dp_shard": False, "num_processes": 2}
    assert not (ckpt / "model.safetensors").exists()
    # Replicated parameters (embeddings, norms) got the same gradients on both ranks: equal
    # bitwise after 10 steps; sharded ones hold different halves of the same shape.
    r0, r1 = load_file(ckpt / "rank0_state.safetensors"), load_file(ckpt / "rank1_state.safetensors")
    assert r0.keys() == r1.keys()
    sharded = [k for k in r0 if k.startswith("model.") and any(f".{n}." in k for n in LAYER_PLAN)]
    replicated = [k for k in r0 if k.startswith("model.") and k not in sharded]
    assert len(sharded) == 2 * 7 and {"model.model.embed_tokens.weight", "model.model.norm.weight"} <= set(replicated)
    for k in replicated:
        assert torch.equal(r0[k], r1[k]), k
    for k in sharded:
        assert r0[k].shape == r1[k].shape and not torch.equal(r0[k], r1[k]), k
    train(shared, "tp_resumed", *TP, num_processes=2, max_steps=STEPS)
    resumes = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [10]
    full, got = steps(runs["tp"]), steps(out)
    assert [got[s]["loss"] for s in range(1, STEPS + 1)] == [full[s]["loss"] for s in range(1, STEPS + 1)]
    a, b = load_file(runs["tp"] / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_tp_size_is_refused_where_it_cannot_split():
    with pytest.raises(ValueError, match=r"tp_size=3 must divide the number of processes \(2\)"):
        check_tp_size(3, 2)
    check_tp_size(2, 4)  # 2 tensor-parallel groups of 2, data-parallel between them
    tiny = model_config("tiny", vocab_size=64, seq_len=16)  # 4 heads, 4 kv heads, 192 intermediate
    check_tp_size(4, 4, tiny)
    with pytest.raises(ValueError, match=r"num_attention_heads=4, num_key_value_heads=4"):
        check_tp_size(8, 8, tiny)
    with pytest.raises(ValueError, match=r"intermediate_size=192"):
        check_tp_size(5, 5, model_config("tiny", vocab_size=64, seq_len=16, num_attention_heads=5,
                                         num_key_value_heads=5, hidden_size=80))
    with pytest.raises(ValueError, match="tp_size"):
        PretrainConfig(tp_size=0)


@pytest.mark.slow
def test_tp_groups_with_data_parallel_between_them_match_one_process(shared, runs):
    """4 processes, tp_size=2: two tensor-parallel groups, each drawing its half of the
    global batch (2 + 2 rows = the 1-process run's 4), gradients averaged between them;
    the sharded layers recompute their activations in the backward pass."""
    out = train(shared, "tp_dp", "tp_size=2", "micro_batch_size=2", "eval_batches=8", "grad_checkpointing=true",
                num_processes=4)
    start = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start")
    assert start["grad_checkpointing"] is True
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["tp_size"] == 2
    assert metrics["tokens"] == json.loads((runs["single"] / "metrics.json").read_text())["tokens"]
    ref = np.array([steps(runs["single"])[s]["loss"] for s in range(1, STEPS + 1)])
    got = np.array([steps(out)[s]["loss"] for s in range(1, STEPS + 1)])
    print(f"TP x DP vs 1 process over {STEPS} steps: max abs diff {np.abs(got - ref).max():.3g}, "
          f"max rel diff {(np.abs(got - ref) / np.abs(ref)).max():.3g}")
    np.testing.assert_allclose(got, ref, rtol=RTOL)
    assert metrics["val_loss"] == pytest.approx(json.loads((runs["single"] / "metrics.json").read_text())["val_loss"],
                                                rel=RTOL)
    assert_same_weights(out, runs["single"], WEIGHT_ATOL)


@pytest.mark.slow
def test_fsdp_by_tp_matches_one_process_and_resumes(shared, runs):
    """4 processes, tp_size=2 with dp_shard: tensor parallelism within each pair, FSDP
    (fully_shard) across the pairs on the 2-D mesh. Stopped at step 6 and resumed from
    its step-4 checkpoint, 12 steps match the 1-process run; each rank's checkpoint
    part holds a quarter of a tensor-parallel weight and half of a replicated one."""
    fsdp_tp = ("tp_size=2", "dp_shard=true", "micro_batch_size=2", "eval_batches=8", "checkpoint_every=4")
    out = train(shared, "fsdp_tp", *fsdp_tp, num_processes=4, max_steps=6)
    ckpt = out / "checkpoints" / "step_00000004"
    assert json.loads((ckpt / "parallel_layout.json").read_text()) == {
        "tp_size": 2, "pp_size": 1, "dp_shard": True, "num_processes": 4}
    part = load_file(ckpt / "rank0_state.safetensors")
    whole = load_file(runs["single"] / "model" / "model.safetensors")
    up = "model.layers.0.mlp.up_proj.weight"
    assert part[f"model.{up}"].numel() * 4 == whole[up].numel()
    assert part["model.model.embed_tokens.weight"].numel() * 2 == whole["model.embed_tokens.weight"].numel()
    n = 12
    train(shared, "fsdp_tp", *fsdp_tp, num_processes=4, max_steps=n)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"] == [4]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["tp_size"] == 2 and metrics["steps"] == n
    # The schedule is constant after warmup: the 1-process run's first 12 steps are the reference.
    ref = np.array([steps(runs["single"])[s]["loss"] for s in range(1, n + 1)])
    got = np.array([steps(out)[s]["loss"] for s in range(1, n + 1)])
    print(f"FSDP x TP vs 1 process over {n} steps (resumed at 4): max abs diff {np.abs(got - ref).max():.3g}, "
          f"max rel diff {(np.abs(got - ref) / np.abs(ref)).max():.3g}")
    np.testing.assert_allclose(got, ref, rtol=RTOL)
    gn_ref = np.array([steps(runs["single"])[s]["grad_norm"] for s in range(1, n + 1)])
    np.testing.assert_allclose([steps(out)[s]["grad_norm"] for s in range(1, n + 1)], gn_ref, rtol=1e-3)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")  # gathered whole
    assert model.model.layers[0].mlp.up_proj.weight.shape == whole[up].shape


def test_dp_shard_needs_tensor_parallelism():
    with pytest.raises(ValueError, match="dp_shard .* needs tp_size > 1"):
        PretrainConfig(dp_shard=True)
