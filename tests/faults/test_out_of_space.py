"""Running out of room: a training run whose checkpoint cannot be written, and a data
build whose version cannot be written, under a real file size limit (RLIMIT_FSIZE with
SIGXFSZ ignored, so the write fails with EFBIG as a full disk fails with ENOSPC). The
failure is reported as ``exhausted`` with what ran out and where, is not retried, and
the outputs that were already there (a finished model, the current dataset version)
stay intact and usable."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from prefect.states import Failed

from crawl2chat.infra.fault_drill import PRETRAIN_STEPS, pretrain_spec
from crawl2chat.stages.checksums import folder_damage
from crawl2chat.stages.data.pipeline import NothingUsableError
from crawl2chat.stages.data.versions import iter_documents, read_manifest, shard_damage
from crawl2chat.stages.training.failures import EXHAUSTED
from crawl2chat.tasks.data import retry_unless_lasting
from crawl2chat.tasks.train import StageFailed, retry_transient

pytestmark = pytest.mark.timeout(600)


def file_size_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_checkpoint_over_the_file_size_limit_is_not_retried_and_keeps_the_model(corpus, pretrain_reference,
                                                                                 tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pretrain_reference, out)
    # Training on past the finished run: its next checkpoint is the first large write.
    spec = {**pretrain_spec(corpus, out), "max_steps": PRETRAIN_STEPS + 10}
    weights = (out / "model" / "model.safetensors").stat().st_size
    appended = max(p.stat().st_size for p in out.iterdir() if p.is_file())  # metrics.jsonl, train.log, ...
    limit = appended + 32 * 1024
    assert limit < weights, (limit, weights)
    model_before = {p.name: p.read_bytes() for p in (out / "model").iterdir()}
    checkpoints_before = sorted(p.name for p in (out / "checkpoints").iterdir())

    proc = subprocess.run([sys.executable, "-m", "crawl2chat.infra.fault_drill", json.dumps(spec)],
                          capture_output=True, text=True, timeout=500, preexec_fn=file_size_limit(limit))
    assert proc.returncode != 0
    failure = json.loads((out / "failure.json").read_text())
    assert failure["kind"] == EXHAUSTED, (failure, proc.stderr[-3000:])
    assert failure["message"].startswith("over the file size limit writing under ") and "(EFBIG: File too large)" in \
        failure["message"]
    assert f"writing under {out} " in failure["message"]
    # The launch reports it as permanent: the Prefect task's retry condition says no.
    error = StageFailed("pretrain", failure["kind"], failure["message"], out / "train.log")
    assert error.permanent and retry_transient(None, None, Failed(data=error)) is False
    log = (out / "train.log").read_text()
    assert log.count("over the file size limit writing") >= 1
    # The finished model is untouched, loads and matches its checksums; no half checkpoint is taken for one.
    assert {p.name: p.read_bytes() for p in (out / "model").iterdir()} == model_before
    assert folder_damage(out / "model") is None
    # The completed checkpoints are the same; the one cut short stays a ``.tmp`` folder no resume reads.
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.endswith(".tmp")) == \
        checkpoints_before
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model")


DATA_BUILD = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from crawl2chat.flows.data import build_settings
    from crawl2chat.infra.ray_runtime import ensure_ray
    from crawl2chat.stages.data import pipeline as steps
    from crawl2chat.stages.data.versions import plan_version
    from crawl2chat.stages.settings import load_config

    out, limit, files = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    ensure_ray(num_cpus=2)
    cfg = load_config(overrides={"data.out": str(out), "data.dedup.num_shards": 2, "data.refresh": True})
    d = cfg.data

    def build(files, commit=True):
        plan = plan_version(out, files, build_settings(d), True)
        work = plan.work_dir
        e = steps.extract_step(plan.files, work, d.extract)
        l = steps.langid_step(e, work, d.langid)
        q = steps.quality_step(l, work, d.quality)
        dd = steps.dedup_step(q, work, d.dedup, plan.previous_index, plan.previous_shards)
        b = steps.balance_step(dd, work, d.balance, (plan.base or {}).get("balance_groups"))
        return lambda: steps.write_dataset([e, l, q, dd, b], str(out), d.shard_bytes, cfg.model_dump(mode="json"),
                                           plan)

    build(files[:1])()                      # v0001
    write = build(files)                    # v0002's steps
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        write()
    except BaseException as e:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        from crawl2chat.stages.resources import exhaustion
        from crawl2chat.tasks.data import retry_unless_lasting
        from prefect.states import Failed
        print("EXHAUSTION:", exhaustion(e))
        print("RETRY:", retry_unless_lasting(None, None, Failed(data=e)))
        raise
""")


@pytest.mark.slow
def test_data_version_over_the_file_size_limit_keeps_the_current_version(tmp_path):
    from test_data_pipeline import write_warc

    write_warc(tmp_path / "in" / "a.warc.gz", range(4))
    write_warc(tmp_path / "in" / "b.warc.gz", range(4, 8))
    out = tmp_path / "data"
    proc = subprocess.run([sys.executable, "-c", DATA_BUILD, str(out), "1024", str(tmp_path / "in" / "a.warc.gz"),
                           str(tmp_path / "in" / "b.warc.gz")], capture_output=True, text=True, timeout=500)
    assert proc.returncode != 0, proc.stdout[-2000:]
    [sentence] = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("EXHAUSTION:")]
    assert sentence.startswith(f"over the file size limit writing {out}/"), proc.stderr[-3000:]
    assert "RETRY: False" in proc.stdout  # the data step is not tried again
    # v0001 is still the current version, whole and readable; v0002 left nothing a manifest names.
    manifest = read_manifest(out)
    assert manifest["version"] == "v0001" and shard_damage(out, manifest) is None
    assert len(list(iter_documents(out, ["id", "text"]))) == manifest["documents_kept"] == 4
    assert not (out / "versions" / "v0002").exists()
    assert not list((out / "shards").glob("v0002-*"))
    assert retry_unless_lasting(None, None, Failed(data=OSError(28, "No space left on device"))) is False
    assert retry_unless_lasting(None, None, Failed(data=ConnectionError("peer gone"))) is True
    for lasting in (NothingUsableError("Every document was dropped."), FileNotFoundError(2, "gone", "x.warc.gz")):
        assert retry_unless_lasting(None, None, Failed(data=lasting)) is False
