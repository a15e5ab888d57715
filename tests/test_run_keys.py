"""Training runs keyed by their inputs and settings: a re-triggered flow reuses a
finished run, changed data starts a new run folder beside the old one."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import mlflow
import pytest

from crawl2chat.stages.settings import load_config
from crawl2chat.stages.training.trainer import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SETTINGS = {"preset": "tiny", "vocab_size": 300, "seq_len": 64, "micro_batch_size": 4, "max_steps": 6,
            "warmup_steps": 1, "eval_every": 6, "eval_batches": 2, "checkpoint_every": 6, "val_fraction": 0.1}


def corpus(seed: int) -> str:
    rng = random.Random(seed)
    words = "the a river town market walked bridge light water boats bread farm valley garden news".split()
    return "\n".join(" ".join(rng.choice(words) for _ in range(12)).capitalize() + "." for _ in range(600))


def test_same_inputs_reuse_the_run_and_changed_data_starts_a_new_one(prefect_api, tmp_path, capsys):
    from crawl2chat.flows.pipeline import pretrain_flow

    data = tmp_path / "corpus.txt"
    data.write_text(corpus(1))
    overrides = {"home": str(tmp_path / "home"), "pretrain.out": str(tmp_path / "pretrain"),
                 **{f"pretrain.train.{k}": v for k, v in SETTINGS.items()}}
    cfg = load_config(overrides=overrides)

    first = pretrain_flow(cfg, str(data))
    again = pretrain_flow(cfg, str(data))
    assert "already trained on these inputs" in capsys.readouterr().out
    assert again["run_id"] == first["run_id"] and again["model_dir"] == first["model_dir"]

    data.write_text(corpus(2))
    changed = pretrain_flow(cfg, str(data))
    assert changed["model_dir"] != first["model_dir"] and changed["run_id"] != first["run_id"]

    out = tmp_path / "pretrain"
    keys = sorted(p.name for p in out.iterdir() if not p.is_symlink() and (p / "run.json").exists())
    assert len(keys) == 2
    # OUT/model follows the newest finished run; the old run folder stays whole.
    assert str((out / "model").resolve()) == changed["model_dir"]
    first_run = json.loads((out / keys[0] / "run.json").read_text())
    assert first_run["stage"] == "pretrain" and first_run["key"] in keys
    assert all((out / key / "model" / "model.safetensors").exists() for key in keys)

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`crawl2chat.stage` = 'pretrain'")
    assert {r.data.tags["crawl2chat.run_key"] for r in runs} == set(keys)
    digests = {d.dataset.digest for r in runs for d in r.inputs.dataset_inputs}
    assert len(digests) == 2  # the corpus before and after the change, by content


def _kill_training(out_marker: str) -> int:
    """SIGKILL the training processes of one run folder (found by their command line)."""
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "crawl2chat.stages.training.pretrain" in cmdline and out_marker in cmdline and int(proc.name) != os.getpid():
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def test_a_killed_training_process_is_retried_and_resumes(prefect_api, tmp_path):
    from crawl2chat.flows.pipeline import pretrain_flow

    data = tmp_path / "corpus.txt"
    data.write_text(corpus(3))
    out = tmp_path / "retried"
    settings = {**SETTINGS, "max_steps": 150, "checkpoint_every": 10, "eval_every": 150}
    cfg = load_config(overrides={"home": str(tmp_path / "home"), "pretrain.out": str(out),
                                 **{f"pretrain.train.{k}": v for k, v in settings.items()}})
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(pretrain_flow(cfg, str(data))))
    runner.start()
    killed, deadline = 0, time.time() + 600
    while not killed and runner.is_alive() and time.time() < deadline:
        if any(int(c.name[5:]) > 0 for c in out.glob("*/checkpoints/step_????????")):
            killed = _kill_training(str(out))
        time.sleep(0.05)
    runner.join(600)
    assert killed, "the run finished before it could be killed; give it more steps"
    assert result.get("steps") == 150
    run_dir = Path(result["model_dir"]).parent
    events = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("type") == "event"]
    assert any(e["event"] == "resume" and e["step"] > 0 for e in events), events
