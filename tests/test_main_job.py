"""The README's first command, `crawl2chat run`, end to end on the embedded default:
the local pydoc site crawled on 127.0.0.1, the data stage in process (a small input), the
tokenizer and base model under a real `accelerate launch`, all in one Prefect
flow run with MLflow runs on SQLite."""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest


@pytest.mark.slow
def test_run_end_to_end_on_the_embedded_default(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    sets = [
        "data.crawl.max_pages=80",
        "pretrain.train.max_steps=80",
        # 80 pages: the default 5% held out can be two short pages, too few passages for the
        # multiple-choice tasks checked below (one CI-like run ended without them).
        "pretrain.train.val_fraction=0.15",
        "pretrain.train.warmup_steps=10",
        "pretrain.train.lr=3e-3",
        "pretrain.train.seq_len=128",
        "pretrain.train.eval_every=30",
        "pretrain.train.checkpoint_every=30",
        "pretrain.train.vocab_size=512",
        "demo_sets.examples=40",
        "sft.train.max_steps=10",
        "reward.train.max_steps=10",
        "ppo.train.max_steps=2",
    ]
    cmd = [sys.executable, "-m", "crawl2chat.cli", "run"] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    for stage in ("[data] crawl", "[data] extract", "[data] dedup", "[data] write"):
        assert stage in out
    for line in ("base model:", "SFT model:", "reward model:", "PPO policy:", "crawl2chat lineage", "Figures",
                 "unigram baseline", "win rate vs SFT", "Talk to it: crawl2chat chat"):
        assert line in out
    # The closing summary shows held-out reference questions answered by each model, side by side.
    assert out.count("\nQ: ") >= 1 and "  base: " in out and "  sft:  " in out and "  ppo:  " in out
    assert all(q.startswith("Q: What ") for q in out.splitlines() if q.startswith("Q: ")), out[-3000:]
    # The documentation site's banner was removed from the pages before training.
    assert "site template lines removed" in out and "Module Index : Topics : Keywords" not in out
    # Library notices stay in the log files, off the terminal.
    terminal = out + proc.stderr
    for notice in ("Removed shared tensor", "Setting accelerator to CPU", "View run", "Creating initial MLflow",
                   "core_worker.cc"):
        assert notice not in terminal, notice
    # The embedded crawl is a documentation site: its rule profile is recorded and explained.
    assert "rule profile 'docs'" in out
    assert "Rule profile `docs`" in (tmp_path / "runs" / "data" / "review.md").read_text()

    home = tmp_path / ".crawl2chat"
    shards = list((tmp_path / "runs" / "data" / "shards").glob("v0001-shard-*.parquet"))
    assert shards
    model_dir = tmp_path / "runs" / "pretrain" / "model"
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["crawl2chat"], output_format="list")
    parent = [r for r in runs if r.data.tags.get("crawl2chat.pipeline") == "pipeline"]
    assert len(parent) == 1
    children = {r.data.tags.get("crawl2chat.stage"): r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id}
    assert {"crawl", "extract", "langid", "quality", "dedup", "balance", "write", "review", "pretrain",
            "demo-sets", "sft", "reward", "ppo", "questions"} <= set(children)
    assert children["extract"].data.tags["crawl2chat.data_engine"] == "local" and "[in this process" in out
    pre = children["pretrain"]
    assert pre.data.tags["crawl2chat.data_digest"].startswith("sha256:")
    assert pre.data.tags["crawl2chat.input.data"] == children["write"].info.run_id
    model_dir_tag = pre.data.tags["crawl2chat.model_dir"]
    assert model_dir_tag == str(model_dir.resolve())
    # Each training stage ends with its evaluation, recorded in its own run.
    assert pre.data.metrics["eval.lm.bpb"] > 0
    # ... including multiple-choice tasks cut from held-out pages, shown in the closing figures.
    assert pre.data.metrics["eval.mc.n"] > 0 and 0 < pre.data.metrics["eval.mc.chance"] < 1
    assert "multiple choice on held-out pages n/a" not in out and "tasks)" in out
    # Every model of the chain answers reference questions about pages no set used, as multiple choice.
    assert "the page's answer picked among 4 (per byte): base " in out and "questions on pages no set used" in out
    # Pretraining's steps were sized to the default's minutes on this machine (all 80 fit).
    assert "[pretrain] 3 minutes of training steps at " in out and "all of them fit" in out
    assert pre.data.params["minutes"] == "3.0" and (tmp_path / "runs" / "pretrain" / "sizing.json").is_file()
    # The base model beats a unigram model of its training tokens on held-out pages.
    assert pre.data.metrics["val_bpb"] < pre.data.metrics["unigram_bpb"]
    assert "eval.policy.win_rate" in children["ppo"].data.metrics
    assert "crawl2chat.eval_error" not in children["sft"].data.tags
    history = mlflow.MlflowClient().get_metric_history(pre.info.run_id, "loss")
    assert len(history) >= 30
    client = mlflow.MlflowClient()
    for name in ("crawl2chat-base", "crawl2chat-sft", "crawl2chat-reward", "crawl2chat-policy"):
        assert client.get_model_version_by_alias(name, "current")
    # The policy's lineage reaches back to the data version through SFT, RM and the base model.
    ppo = children["ppo"]
    assert ppo.data.tags["crawl2chat.input.sft"] == children["sft"].info.run_id
    assert ppo.data.tags["crawl2chat.input.reward"] == children["reward"].info.run_id
    assert children["sft"].data.tags["crawl2chat.input.base"] == pre.info.run_id
    # SFT and the reward model both start from the base model alone: on CPU they train
    # side by side, each on its share of the cores, both under the pipeline run.
    sft, rm = children["sft"].info, children["reward"].info
    assert sft.start_time < rm.end_time and rm.start_time < sft.end_time
    assert children["sft"].data.params["cpu_share"] == children["reward"].data.params["cpu_share"] == "2"
    assert rm.start_time > pre.info.end_time and children["ppo"].info.start_time > max(sft.end_time, rm.end_time)
    lineage = subprocess.run([sys.executable, "-m", "crawl2chat.cli", "lineage", ppo.data.tags["crawl2chat.model_dir"]],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert lineage.returncode == 0, lineage.stderr
    upstream = lineage.stdout.partition("this:")[0]
    for stage in ("sft", "reward", "pretrain", "write"):
        assert children[stage].info.run_id in upstream

    # Re-triggered with the same settings: no re-crawl, the dataset is up to date,
    # and every training stage is reused from its keyed run folder.
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "[data] crawl    already done" in again.stdout
    assert "is up to date at v0001" in again.stdout
    for stage in ("pretrain", "sft", "reward", "ppo"):
        assert f"[{stage}] already trained on these inputs" in again.stdout, stage
    assert client.get_model_version_by_alias("crawl2chat-policy", "current").run_id == ppo.info.run_id
    # A model's run names the dataset version and the registered model versions it was built from.
    assert pre.data.tags["crawl2chat.data_version"] == "v0001"
    assert children["sft"].data.tags["crawl2chat.input_model.base"].startswith("models:/crawl2chat-base/")
