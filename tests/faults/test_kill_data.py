"""SIGKILL ``crawl2chat data`` inside a step's Ray job (its whole process group, as a
terminal does) and at the windows of the commit sequence (the process kills itself
exactly between two renames, see ``stages/fault_points.py``); after each kill no
process of the command is left (Ray's and Prefect's included), and rerunning the
same command gives the kept-id set and content digest of an uninterrupted build,
with no temporary folder left behind."""

from __future__ import annotations

import random

import pytest

from crawl2chat.infra.fault_drill import DATA_COMMIT_POINTS, data_result, drill_warc, run_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Seeded: the same points on every run: inside a step's job, and one window of the
# version's commit (benchmarks/bench_faults.py tries every step and every window).
POINTS = ["in:dedup", "at:" + random.Random(20261203).choice([p for p in DATA_COMMIT_POINTS if p.startswith("write:")])]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("data-faults").resolve()
    warc = drill_warc(root / "in" / "pages.warc.gz")
    run = run_data([str(warc)], root / "clean", root / "home")
    assert run["status"] == 0, run["output"]
    result = data_result(root / "clean")
    assert result["version"] == "v0001" and len(result["ids"]) == 50 and result["documents_dropped"] == 10
    return root, warc, result


@pytest.mark.parametrize("point", POINTS)
def test_data_killed_then_rerun_is_the_same_version(clean, point):
    root, warc, reference = clean
    out = root / point.replace(":", "-")
    killed = run_data([str(warc)], out, root / "home", kill_at=point)
    assert killed["killed"], f"{point}: the command ended before the kill point\n{killed['output']}"
    assert killed["orphans"] == [], f"{point}: processes left running: {killed['orphans']}"
    before = data_result(out)
    assert before["version"] is None or before["content_digest"] == reference["content_digest"]

    rerun = run_data([str(warc)], out, root / "home")
    assert rerun["status"] == 0, rerun["output"]
    assert rerun["orphans"] == []
    after = data_result(out)
    assert after["version"] == "v0001" and after["versions"] == ["v0001"]
    assert after["ids"] == reference["ids"]
    assert after["content_digest"] == reference["content_digest"]
    assert after["leftovers"] == [] and after["review"]
