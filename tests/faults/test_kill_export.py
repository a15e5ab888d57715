"""SIGKILL ``crawl2chat export`` after the new export is built and before it is swapped
into place, over an earlier export of another model: the earlier export is left
whole (checksums intact), the rerun replaces it with the same files an uninterrupted
export writes, and no temporary folder is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from crawl2chat.infra.fault_drill import same_weights
from crawl2chat.stages.checksums import folder_damage


def export(model, out, cwd, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"CRAWL2CHAT_KILL_AT": kill_at} if kill_at else {})}
    return subprocess.run([sys.executable, "-m", "crawl2chat.cli", "export", "--model", str(model), "--out", str(out)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_export_killed_before_the_swap_keeps_the_previous_export(fault_root, pretrain_reference, sft_reference,
                                                                   tmp_path):
    clean = tmp_path / "clean"
    assert export(sft_reference / "model", clean, tmp_path).returncode == 0
    out = tmp_path / "exported"
    assert export(pretrain_reference / "model", out, tmp_path).returncode == 0  # the previous export

    killed = export(sft_reference / "model", out, tmp_path, kill_at="export:built")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert folder_damage(out) is None
    assert same_weights(out, pretrain_reference / "model")  # still the previous export, whole

    again = export(sft_reference / "model", out, tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert same_weights(out, clean) and folder_damage(out) is None
    for name in ("generation_config.json", "tokenizer_config.json", "config.json"):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert json.loads((out / "export_report.json").read_text())["out"] == str(out.resolve())
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
