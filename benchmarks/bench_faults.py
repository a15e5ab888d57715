"""Faults survived: kill each training stage at seeded points, rerun, compare.

For pretraining and SFT (tiny models, tens of steps, through the real
``accelerate launch``), a clean run is timed first; then, at each seeded kill
point (the owning process, the ``accelerate launch`` process and the training
rank at a random step, and the owner while a checkpoint is being written), the
run is started, SIGKILLed there, checked for leftover processes, rerun to the
end and compared with the clean run's weights, bitwise. A kill point is
*survived* when nothing was left running and the rerun's weights equal the
clean run's.

    python benchmarks/bench_faults.py [--out DIR] [--seed 7] [--stages pretrain,sft]

Prints a table and one JSON document, also written to OUT/bench_faults.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from crawl2chat.infra.fault_drill import (PRETRAIN_STEPS, SFT_STEPS, kill_at, pretrain_spec, rerun, same_weights,
                                          seeded_points, sft_spec, tiny_inputs)


def drill_stage(stage: str, make_spec, clean_out: Path, root: Path, seed: int, max_steps: int) -> dict:
    t0 = time.monotonic()
    rerun(make_spec(clean_out))
    clean_seconds = time.monotonic() - t0
    rows = []
    for i, point in enumerate(seeded_points(seed, max_steps, 10)):
        spec = make_spec(root / f"{stage}-kill-{i}")
        row = {"point": str(point)}
        try:
            killed = kill_at(spec, point)
            row.update(killed=killed["killed"], killed_at_step=killed["killed_at_step"],
                       orphans=len(killed["orphans"]), run_until_kill_seconds=round(killed["seconds"], 2))
            row["rerun_seconds"] = round(rerun(spec), 2)
            row["same_weights"] = same_weights(Path(spec["out"]) / "model", clean_out / "model")
        except Exception as e:  # noqa: BLE001 - a failed drill is a result, not the end of the benchmark
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        row["survived"] = bool(row.get("killed") and row.get("orphans") == 0 and row.get("same_weights"))
        rows.append(row)
    tried = [r for r in rows if r.get("killed")]
    return {"stage": stage, "clean_seconds": round(clean_seconds, 2), "kill_points": rows,
            "tried": len(tried), "survived": sum(r["survived"] for r in tried),
            "mean_rerun_seconds": round(sum(r["rerun_seconds"] for r in tried if "rerun_seconds" in r)
                                        / max(1, sum("rerun_seconds" in r for r in tried)), 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="working folder (default: a temporary one, removed afterwards)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--stages", default="pretrain,sft")
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="bench-faults-")).resolve()
    stages = [s for s in args.stages.split(",") if s]
    try:
        inputs = tiny_inputs(root)
        results = []
        clean_pretrain = root / "pretrain-clean"
        if "pretrain" in stages or "sft" in stages:
            pre = drill_stage("pretrain", lambda out: pretrain_spec(inputs, out), clean_pretrain, root, args.seed,
                              PRETRAIN_STEPS) if "pretrain" in stages else None
            if pre:
                results.append(pre)
            elif not (clean_pretrain / "model").exists():
                rerun(pretrain_spec(inputs, clean_pretrain))
        if "sft" in stages:
            results.append(drill_stage("sft", lambda out: sft_spec(inputs, clean_pretrain / "model", out),
                                       root / "sft-clean", root, args.seed + 1, SFT_STEPS))
        print(f"{'stage':9} {'kill point':16} {'killed at':>9} {'orphans':>7} {'rerun s':>8} {'bitwise':>7}")
        for res in results:
            for r in res["kill_points"]:
                print(f"{res['stage']:9} {r['point']:16} {r.get('killed_at_step', '-'):>9} {r.get('orphans', '-'):>7} "
                      f"{r.get('rerun_seconds', '-'):>8} {str(r.get('same_weights', r.get('error', '-'))):>7}")
            print(f"{res['stage']}: {res['survived']}/{res['tried']} kill points survived; rerun after a kill "
                  f"{res['mean_rerun_seconds']} s vs clean run {res['clean_seconds']} s")
        report = {"seed": args.seed, "stages": results}
        print(json.dumps(report, indent=2))
        if args.out:
            (root / "bench_faults.json").write_text(json.dumps(report, indent=2) + "\n")
        return report
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
