"""The data flow through its real orchestration: the CLI, a Prefect flow run, MLflow runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from crawl2chat.stages.settings import load_config

CLI = [sys.executable, "-m", "crawl2chat.cli"]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")}
    env["PREFECT_HOME"] = str(home / "prefect")
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
    return env


def test_bad_config_field_is_named(tmp_path):
    proc = subprocess.run(
        CLI + ["data", "--out", str(tmp_path), "--set", "data.dedup.num_bands=0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "data.dedup.num_bands" in proc.stderr

    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  dedupe: {}\n")
    proc = subprocess.run(CLI + ["data", "--config", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "data.dedupe" in proc.stderr


def test_a_missing_input_ends_in_one_sentence_with_the_trace_in_the_log(tmp_path):
    """The flow run fails inside Prefect: its traceback goes to HOME/logs/flow-runs.log,
    not the terminal, whose only line names the missing file and the trace's place."""
    missing = tmp_path / "nowhere" / "crawl.warc.gz"
    proc = subprocess.run(CLI + ["data", "--input", str(missing), "--out", str(tmp_path / "out")], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    terminal = (proc.stdout + proc.stderr).strip().splitlines()
    assert terminal == [f"error: input path does not exist: '{missing}' (trace: .crawl2chat/logs/flow-runs.log)"]
    trace = (tmp_path / ".crawl2chat" / "logs" / "flow-runs.log").read_text()
    assert "Traceback (most recent call last)" in trace and "FileNotFoundError" in trace


@pytest.mark.slow
def test_a_build_that_keeps_nothing_commits_nothing(shared_data, tmp_path):
    """A file that is not a WARC file beside a good one is named in the summary. A build whose
    only input is that file fails in one sentence naming the file and its error; the folder's current version stays current (a reader of manifest.json still
    finds its documents) and the failed build's manifest waits under failed/."""
    import json

    good = shared_data / "warc" / "dolma" / "sample-0000.warc.gz"
    bad = tmp_path / "random.warc.gz"
    bad.write_bytes(bytes(range(256)) * 20)
    out = tmp_path / "out"
    # Two files after one --input, as an unquoted glob expands: the second is an input too.
    first = subprocess.run(CLI + ["data", "--input", str(good), str(bad), "--out", str(out)], cwd=tmp_path,
                           env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    # The good file's documents are kept; the summary names the file it could not read.
    assert "  unreadable: 1 of 2 input files, see manifest.json (random.warc.gz: ArchiveLoadFailed" in first.stdout
    before = json.loads((out / "manifest.json").read_text())
    assert before["version"] == "v0001" and before["documents_kept"] > 0

    proc = subprocess.run(CLI + ["data", "--input", str(bad), "--out", str(out)], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    terminal = (proc.stdout + proc.stderr).strip().splitlines()
    assert not any("Finished in state" in line or "Traceback" in line for line in terminal), terminal
    assert terminal[-1].startswith("error: No document could be read from the input (random.warc.gz: ")
    assert "nothing was committed (v0001 stays the current version)" in terminal[-1]
    assert json.loads((out / "manifest.json").read_text()) == before
    assert sorted(p.name for p in (out / "versions").iterdir()) == ["v0001"]
    failed = sorted((out / "failed").iterdir())
    assert len(failed) == 1 and str(failed[0]) in terminal[-1]
    record = json.loads((failed[0] / "manifest.json").read_text())
    assert record["documents_kept"] == 0 and [f["ok"] for f in record["unreadable_files"]] == [False]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "ray"])
def test_cli_runs_the_flow_and_records_every_step(shared_data, tmp_path, engine):
    """The default (``auto``: two small files, built in the flow's process) and Ray Data."""
    home = tmp_path / "home"
    out = tmp_path / "out"
    proc = subprocess.run(
        CLI + ["data", "--input", str(shared_data / "warc" / "dolma"), "--out", str(out), "--set", f"home={home}",
               "--set", f"data.engine={engine}"],
        capture_output=True, text=True, timeout=900, env=_env(tmp_path), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "v0001: " in proc.stdout and " documents (" in proc.stdout
    used = "local" if engine == "auto" else "ray"
    assert ("[in this process (input up to data.local_max_mb, " if used == "local" else "[on Ray]") in proc.stdout
    # Not a terminal: each step's progress comes as plain lines (documents, rate), never redrawn,
    # and Ray's notices stay in its log files.
    for step in ("extract", "langid", "quality", "dedup", "balance"):
        assert re.search(rf"^\[data\] {step} +documents \d+", proc.stdout, re.M), (step, proc.stdout[-3000:])
    assert re.search(r"^\[data\] langid +documents (\d+)/\1  \[#{20}\]  [\d,.]+ documents/s", proc.stdout, re.M)
    assert "\r" not in proc.stdout
    assert "PYTHON worker processes" not in proc.stdout + proc.stderr
    assert "Token authentication is" not in proc.stdout + proc.stderr
    assert (out / "manifest.json").exists() and (out / "review.md").exists()

    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["crawl2chat"], output_format="list")
    parents = [r for r in runs if r.data.tags.get("crawl2chat.pipeline") == "data"]
    assert len(parents) == 1
    children = {r.data.tags.get("crawl2chat.stage"): r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert {"extract", "langid", "quality", "dedup", "balance", "write", "review"} <= set(children)
    assert {children[s].data.tags["crawl2chat.data_engine"] for s in ("extract", "dedup", "balance")} == {used}
    assert children["write"].data.metrics["documents_kept"] > 0
    assert children["extract"].data.metrics["documents_in"] > 0
    # Each run reads as an experiment record, with its plots beside it.
    client = mlflow.MlflowClient()
    write_id = children["write"].info.run_id
    artifacts = {a.path for a in client.list_artifacts(write_id)} | {a.path for a in client.list_artifacts(write_id, "plots")}
    assert {"record.md", "manifest.json", "plots/drop_reasons.png"} <= artifacts
    assert "**Goal.**" in children["write"].data.tags["mlflow.note.content"]
    dedup_plots = {a.path for a in client.list_artifacts(children["dedup"].info.run_id, "plots")}
    assert "plots/dedup_drop_reasons.png" in dedup_plots or children["dedup"].data.metrics["documents_dropped"] == 0


@pytest.mark.slow
def test_flow_with_nothing_usable_fails_plainly(shared_data, prefect_api, ray_local, tmp_path):
    from crawl2chat.flows.data import data_flow
    from crawl2chat.stages.data.pipeline import NothingUsableError

    cfg = load_config(overrides={
        "home": str(tmp_path / "home"),
        "data.out": str(tmp_path / "out"),
        "data.inputs": [str(shared_data / "warc" / "warcio" / "example-bad.warc.gz.bad")],
    })
    with pytest.raises(NothingUsableError):
        data_flow(cfg)
