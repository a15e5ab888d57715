"""Each data step reports the documents its job (Ray Data or in-process) has processed while it runs,
and in a log (no terminal) those counts become plain progress lines."""

from __future__ import annotations

import io
import re

import pytest

from crawl2chat.infra.progress import StepProgress
from crawl2chat.stages.data import pipeline as steps
from crawl2chat.stages.settings import load_config


@pytest.mark.parametrize("engine", ["ray", "local"])
def test_steps_count_documents_and_show_them_in_a_log(shared_data, ray_local, tmp_path, engine):
    cfg = load_config(overrides={"data.out": str(tmp_path / "out")}).data
    files = [str(p) for p in sorted((shared_data / "warc" / "dolma").glob("*.warc.gz"))]
    work = str(tmp_path / "work")

    counts: dict[str, list[dict]] = {}

    def recorder(name: str):
        counts[name] = []
        return counts[name].append

    extracted = steps.extract_step(files, work, cfg.extract, recorder("extract"), engine)
    log = io.StringIO()
    progress = StepProgress("data", extracted.kept, stream=log, every=0.0, unit="documents", label="langid")

    def on_count(c: dict) -> None:
        recorder_list.append(c)
        progress({"step": c.get("documents", 0)})

    recorder_list = counts.setdefault("langid", [])
    identified = steps.langid_step(extracted, work, cfg.langid, on_count, engine)
    progress.finish({"step": extracted.kept})
    deduped = steps.dedup_step(identified, work, cfg.dedup, on_count=recorder("dedup"), engine_name=engine)

    # The tally starts empty, only grows, and ends at every document the step read.
    for name, total in (("extract", extracted.rows_in), ("langid", extracted.kept), ("dedup", identified.kept)):
        seen = [c.get("documents", 0) for c in counts[name]]
        assert counts[name][0] == {} and seen == sorted(seen), (name, seen)
        assert seen[-1] == total, (name, seen, total)
    assert counts["extract"][-1]["files"] == len(files)
    assert deduped.rows_in == identified.kept

    lines = log.getvalue().splitlines()
    assert lines[0] == f"[data] langid   documents 0/{extracted.kept}  [....................]"
    assert re.fullmatch(rf"\[data\] langid   documents {extracted.kept}/{extracted.kept}  \[#{{20}}\]  "
                        r"[\d,.]+ documents/s  0s left", lines[-1]), lines[-1]
    assert "\r" not in log.getvalue()

    # A step already done runs no job: no count at all.
    again: list[dict] = []
    assert steps.langid_step(extracted, work, cfg.langid, again.append, engine).skipped and again == []
