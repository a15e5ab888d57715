"""SIGKILL a training run's owner (the process running ``launch_training``, as the CLI
and the Prefect task do), the ``accelerate launch`` of a two-process run or a rank at seeded points of a
tiny pretraining, SFT, reward-model, DPO and PPO run; after each kill no process of the run is left,
and rerunning the same launch gives bitwise the weights of an uninterrupted run.
While a run is going, a second launch on its folder is refused naming the holder."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from crawl2chat.infra.fault_drill import (DPO_STEPS, PPO_STEPS, PRETRAIN_STEPS, REWARD_STEPS, SFT_STEPS, KillPoint,
                                          dpo_spec, kill_at, ppo_spec, pretrain_spec, rerun, reward_spec, same_weights,
                                          sft_spec)
from crawl2chat.infra.launch import accelerate_command
from crawl2chat.stages.locks import FolderBusy
from crawl2chat.stages.training.registry import STAGES
from crawl2chat.stages.training.stage import script_argv
from crawl2chat.stages.training.trainer import read_metrics
from crawl2chat.tasks.train import launch_training

_rng = random.Random(20251203)
PRETRAIN_POINTS = [KillPoint("owner", _rng.randint(12, 35)), KillPoint("rank", _rng.randint(12, 35)),
                   KillPoint("launcher", _rng.randint(10, 25), during_save=True)]
SFT_POINTS = [KillPoint("owner", _rng.randint(8, 25)), KillPoint("rank", _rng.randint(8, 25))]
# One seeded kill of each of the stages after SFT, past their first checkpoint.
LATER_POINTS = {"reward": KillPoint("rank", _rng.randint(12, 25)), "dpo": KillPoint("owner", _rng.randint(12, 25)),
                "ppo": KillPoint("owner", _rng.randint(5, 10))}


def _second_writers_refused(spec: dict):
    """Checks run while the owner trains: a second launch_training on the folder and a
    direct ``accelerate launch`` of the script are both refused, naming the owner's pid."""
    def check(owner: subprocess.Popen) -> None:
        with pytest.raises(FolderBusy) as busy:
            launch_training(spec["stage"], spec["inputs"], spec["out"], max_steps=spec["max_steps"],
                            overrides=spec["overrides"])
        assert busy.value.pid == owner.pid and f"process {owner.pid}" in str(busy.value)
        argv = script_argv(spec["inputs"], spec["out"], max_steps=spec["max_steps"], overrides=spec["overrides"])
        direct = subprocess.run(accelerate_command(STAGES[spec["stage"]].module, argv), capture_output=True,
                                text=True, timeout=300)
        # The script exits with status 4 (accelerate's launcher then reports 1) and writes nothing there.
        assert direct.returncode != 0 and "returned non-zero exit status 4" in direct.stderr, direct.stderr[-2000:]
        assert f"being written by process {owner.pid}" in direct.stderr
        assert not (Path(spec["out"]) / "failure.json").exists()
    return check


def _drill(spec: dict, point: KillPoint, reference, on_running=None) -> dict:
    result = kill_at(spec, point, on_running=on_running)
    assert result["killed"], f"{point}: the run ended before the kill point"
    assert result["orphans"] == [], f"{point}: processes left running: {result['orphans']}"
    assert result["owner_status"] != 0
    rerun(spec)
    resumes = [r for r in read_metrics(f"{spec['out']}/metrics.jsonl") if r.get("event") == "resume"]
    assert resumes, f"{point}: the rerun did not resume from a checkpoint"
    assert same_weights(f"{spec['out']}/model", reference / "model"), f"{point}: weights differ"
    return result


@pytest.mark.parametrize("point", PRETRAIN_POINTS, ids=str)
def test_pretrain_killed_then_rerun_is_exact(fault_root, corpus, request, point):
    """The launcher is killed in a run over two processes (DDP): a one-process run has none."""
    spec = pretrain_spec(corpus, fault_root / f"pretrain-{point}".replace("@", "-").replace(">", ""))
    if point.target == "launcher":
        spec["num_processes"] = 2
    reference = request.getfixturevalue("pretrain_ddp_reference" if point.target == "launcher" else "pretrain_reference")
    first = point is PRETRAIN_POINTS[0]
    _drill(spec, point, reference, on_running=_second_writers_refused(spec) if first else None)
    summary = json.loads((fault_root / spec["out"] / "metrics.json").read_text())
    assert summary["steps"] == PRETRAIN_STEPS


def test_one_process_run_has_no_launcher_to_kill(fault_root, corpus):
    with pytest.raises(ValueError, match="a one-process run has no launcher process"):
        kill_at(pretrain_spec(corpus, fault_root / "pretrain-no-launcher"), KillPoint("launcher", 5))


@pytest.mark.parametrize("point", SFT_POINTS, ids=str)
def test_sft_killed_then_rerun_is_exact(fault_root, corpus, pretrain_reference, sft_reference, point):
    spec = sft_spec(corpus, pretrain_reference / "model",
                    fault_root / f"sft-{point}".replace("@", "-").replace(">", ""))
    first = point is SFT_POINTS[0]
    _drill(spec, point, sft_reference, on_running=_second_writers_refused(spec) if first else None)
    assert json.loads((fault_root / spec["out"] / "metrics.json").read_text())["steps"] == SFT_STEPS


@pytest.mark.parametrize("stage", sorted(LATER_POINTS))
def test_later_stage_killed_then_rerun_is_exact(fault_root, corpus, sft_reference, reward_reference, stage):
    """The reward model, DPO and PPO (rollouts, RNG and KL coefficient included) resume bitwise too."""
    sft, point = sft_reference / "model", LATER_POINTS[stage]
    make = {"reward": lambda out: reward_spec(corpus, sft, out), "dpo": lambda out: dpo_spec(corpus, sft, out),
            "ppo": lambda out: ppo_spec(corpus, sft, reward_reference / "model", out)}[stage]
    reference = reward_reference if stage == "reward" else fault_root / f"{stage}-reference"
    if stage != "reward":
        rerun(make(reference))
    _drill(make(fault_root / f"{stage}-{point}".replace("@", "-")), point, reference)
    steps = {"reward": REWARD_STEPS, "dpo": DPO_STEPS, "ppo": PPO_STEPS}[stage]
    assert json.loads((fault_root / f"{stage}-{point}".replace("@", "-") / "metrics.json").read_text())["steps"] == steps


def test_damaged_checkpoint_is_passed_over(fault_root, corpus, pretrain_reference):
    """A run killed at step 35 has checkpoints 20 and 30; 30's weights are truncated.
    The rerun names the file, resumes from 20 and still ends bitwise on the reference."""
    spec = pretrain_spec(corpus, fault_root / "pretrain-damaged-ckpt")
    result = kill_at(spec, KillPoint("owner", 35))
    assert result["killed"] and result["orphans"] == []
    ckpts = sorted(p.name for p in (fault_root / spec["out"] / "checkpoints").glob("step_*"))
    assert ckpts[-1] == "step_00000030", ckpts
    weights = fault_root / spec["out"] / "checkpoints" / "step_00000030" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    rerun(spec)
    log = (fault_root / spec["out"] / "train.log").read_text()
    assert f"checkpoint step_00000030 is damaged ({weights} has" in log
    resumes = [r for r in read_metrics(f"{spec['out']}/metrics.jsonl") if r.get("event") == "resume"]
    assert resumes[-1]["checkpoint"] == "step_00000020"
    assert same_weights(f"{spec['out']}/model", pretrain_reference / "model")


def test_damaged_final_model_is_trained_again(fault_root, corpus, pretrain_reference):
    """A finished run whose saved safetensors was altered is not taken as finished: the
    rerun names the file, trains the last steps again and writes the same weights."""
    spec = pretrain_spec(corpus, fault_root / "pretrain-damaged-model")
    out = fault_root / spec["out"]
    shutil.copytree(pretrain_reference, out, symlinks=True)
    weights = out / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    rerun(spec)
    assert f"{weights} does not match its sha256" in (out / "train.log").read_text()
    assert same_weights(out / "model", pretrain_reference / "model")
