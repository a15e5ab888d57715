"""A dataset version damaged after it was written: a shard truncated or altered, the
manifest unreadable, a step folder's file cut. Readers (the training stages) name the
file in one sentence and a training script exits with status 2; the next build of the
folder rebuilds the damaged version from its step folders, running a damaged step
again, and ends on the same content; an unreadable ``manifest.json`` is restored from
the committed version's copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from crawl2chat.stages.data import pipeline as steps
from crawl2chat.stages.data.versions import (DamagedDataError, committed_versions, plan_version, read_manifest,
                                             shard_files)
from crawl2chat.stages.settings import load_config

pytestmark = pytest.mark.timeout(600)


def build(out: Path, files: list[str]) -> tuple[dict, list[steps.StepResult]]:
    """One build of the data folder, as the data flow runs it (without Prefect)."""
    from crawl2chat.flows.data import build_settings

    cfg = load_config(overrides={"data.out": str(out), "data.dedup.num_shards": 2})
    d = cfg.data
    plan = plan_version(out, files, build_settings(d), d.refresh)
    if plan.up_to_date:
        return plan.up_to_date, []
    extracted = steps.extract_step(plan.files, plan.work_dir, d.extract)
    identified = steps.langid_step(extracted, plan.work_dir, d.langid)
    filtered = steps.quality_step(identified, plan.work_dir, d.quality)
    deduped = steps.dedup_step(filtered, plan.work_dir, d.dedup)
    balanced = steps.balance_step(deduped, plan.work_dir, d.balance)
    results = [extracted, identified, filtered, deduped, balanced]
    return steps.write_dataset(results, str(out), d.shard_bytes, cfg.model_dump(mode="json"), plan), results


@pytest.fixture(scope="module")
def dataset(ray_local, tmp_path_factory):
    from test_data_pipeline import write_warc

    root = tmp_path_factory.mktemp("damaged")
    write_warc(root / "in" / "a.warc.gz", range(6))
    files = [str(root / "in" / "a.warc.gz")]
    manifest, _ = build(root / "data", files)
    assert manifest["version"] == "v0001" and manifest["documents_kept"] == 6
    return root / "data", files, manifest


def fresh_copy(dataset, tmp_path) -> Path:
    src, _, _ = dataset
    out = tmp_path / "data"
    shutil.copytree(src, out)
    return out


def cut(path: Path, fraction: float = 0.7) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_shard_is_named_and_the_training_script_exits_2(dataset, tmp_path):
    out = fresh_copy(dataset, tmp_path)
    [shard] = shard_files(out)
    size = shard.stat().st_size
    flip_byte(shard)  # same size, other content
    with pytest.raises(DamagedDataError, match="does not match the sha256") as altered:
        shard_files(out)
    assert str(shard) in str(altered.value)
    cut(shard)
    with pytest.raises(DamagedDataError) as truncated:
        shard_files(out)
    assert str(truncated.value) == (f"{shard} has {int(size * 0.7)} bytes, {size} were written "
                                    "(dataset version v0001)")

    # The pretraining script reading it: one sentence, failure kind bad_input, status 2.
    run = tmp_path / "pretrain"
    proc = subprocess.run(
        [sys.executable, "-m", "crawl2chat.stages.training.pretrain", "--data", str(out), "--out", str(run),
         "--max-steps", "2", "--set", "vocab_size=300"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-3000:]
    failure = json.loads((run / "failure.json").read_text())
    assert failure["kind"] == "bad_input" and failure["message"] == str(truncated.value)
    assert proc.stderr.strip().splitlines()[-1] == f"error: {truncated.value}"


def test_unreadable_manifest_is_named_then_restored_by_the_next_build(dataset, tmp_path):
    _, files, original = dataset
    out = fresh_copy(dataset, tmp_path)
    (out / "manifest.json").write_text('{"version": "v0001", "shards": [')  # cut while copied
    with pytest.raises(DamagedDataError, match=r"manifest.json is unreadable \(JSONDecodeError") as unreadable:
        shard_files(out)
    assert str(out / "manifest.json") in str(unreadable.value)

    # The data command ends on that sentence with status 2.
    from crawl2chat.cli import _guarded

    def read():
        shard_files(out)

    with pytest.raises(typer.Exit) as exit_:
        _guarded(read)
    assert exit_.value.exit_code == 2

    # The next build checks the committed version's shards and restores the manifest from it.
    manifest, results = build(out, files)
    assert results == [] and manifest["content_digest"] == original["content_digest"]
    assert read_manifest(out) == read_manifest(out, "v0001") and shard_files(out)


def test_damaged_version_is_rebuilt_from_its_steps_and_a_damaged_step_runs_again(dataset, tmp_path):
    _, files, original = dataset
    out = fresh_copy(dataset, tmp_path)
    [shard] = shard_files(out)
    cut(shard)
    step_file = sorted((out / "work" / "v0001" / "quality").glob("*.parquet"))[0]
    flip_byte(step_file)

    manifest, results = build(out, files)
    assert manifest["version"] == "v0001" and committed_versions(out) == ["v0001"]
    ran = {r.name for r in results if not r.skipped}
    assert ran == {"quality"}, ran  # the damaged step runs again; the others are checked and reused
    assert manifest["documents_kept"] == original["documents_kept"]
    assert manifest["content_digest"] == original["content_digest"]
    assert shard_files(out) == [shard]


def test_refresh_does_not_extend_a_damaged_version(dataset, tmp_path):
    from crawl2chat.flows.data import build_settings

    _, files, _ = dataset
    out = fresh_copy(dataset, tmp_path)
    [shard] = shard_files(out)
    cut(shard, 0.5)
    d = load_config(overrides={"data.out": str(out), "data.refresh": True}).data
    with pytest.raises(DamagedDataError, match="a refresh cannot extend a damaged version") as refused:
        plan_version(out, files, build_settings(d), True)
    assert str(refused.value).startswith(f"{shard} has ")
