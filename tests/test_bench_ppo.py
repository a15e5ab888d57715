"""The PPO benchmark's pairing: each side's i-th run makes a pair, ratios in run order."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ppo.py"


def test_pairs_are_the_ith_run_of_each_side():
    spec = importlib.util.spec_from_file_location("bench_ppo_under_test", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    try:
        spec.loader.exec_module(bench)
        tries = {"ours": [{"episodes_per_second": 16.0}, {"episodes_per_second": 13.0}, {"episodes_per_second": 15.0}],
                 "trl": [{"episodes_per_second": 8.0}, {"episodes_per_second": 6.5}, {"episodes_per_second": 7.5}]}
        assert bench.pair_ratios(tries) == [2.0, 2.0, 2.0]
        tries["trl"].reverse()
        assert bench.pair_ratios(tries) == [16.0 / 7.5, 2.0, 15.0 / 8.0]
    finally:
        sys.modules.pop(spec.name, None)
