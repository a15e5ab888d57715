"""Faults survived: kill each training stage at seeded points, rerun, compare.

For the data stage (``crawl2chat data`` on a 60-page WARC), a clean build is
timed first; then the command is SIGKILLed inside each step's Ray job (its
process group, from outside) and at every window of the commit sequences (a
step's folder written / renamed into place; the version's files staged, moved
into ``shards/``, the version folder renamed before the manifest), rerun, and
compared with the clean build: same kept ids and content digest, no temporary
folder left, no process of the command alive.

For each training stage (tiny models, tens of steps, launched as ``crawl2chat
<stage>`` launches them), a clean run is timed first; then, at each seeded kill
point (the owning process and the training rank at a random step, and the owner
while a checkpoint is being written), the
run is started, SIGKILLed there, checked for leftover processes, rerun to the
end and compared with the clean run's weights, bitwise. A kill point is
*survived* when nothing was left running and the rerun's weights equal the
clean run's. Pretraining is drilled a second time over two processes (DDP), whose
``accelerate launch`` process is a kill point of its own (a one-process run has
no launcher: its owner starts the rank).

    python benchmarks/bench_faults.py [--out DIR] [--seed 7] [--stages data,pretrain,sft,reward,dpo,ppo]

Prints a table and one JSON document, also written to OUT/bench_faults.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from crawl2chat.infra.fault_drill import (DATA_COMMIT_POINTS, DATA_STEPS, DPO_STEPS, PPO_STEPS, PRETRAIN_STEPS,
                                          REWARD_STEPS, SFT_STEPS, data_result, dpo_spec, drill_warc, kill_at,
                                          ppo_spec, pretrain_spec, rerun, reward_spec, run_data, same_weights,
                                          seeded_points, sft_spec, tiny_inputs)


def drill_stage(stage: str, make_spec, clean_out: Path, root: Path, seed: int, max_steps: int,
                checkpoint_every: int = 10) -> dict:
    t0 = time.monotonic()
    rerun(make_spec(clean_out))
    clean_seconds = time.monotonic() - t0
    rows = []
    several = make_spec(clean_out).get("num_processes", 1) > 1
    for i, point in enumerate(seeded_points(seed, max_steps, checkpoint_every, launcher=several)):
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


def drill_data(root: Path) -> dict:
    """Every data kill point: inside each step's job, and each commit window."""
    warc = drill_warc(root / "data-in" / "pages.warc.gz")
    home = root / "data-home"
    clean = run_data([str(warc)], root / "data-clean", home)
    if clean["status"] != 0:
        raise RuntimeError(f"the clean data build failed:\n{clean['output']}")
    reference = data_result(root / "data-clean")
    rows = []
    for i, point in enumerate([f"in:{s}" for s in DATA_STEPS] + [f"at:{p}" for p in DATA_COMMIT_POINTS]):
        out = root / f"data-kill-{i}"
        killed = run_data([str(warc)], out, home, kill_at=point)
        row = {"point": point, "killed": killed["killed"], "orphans": len(killed["orphans"]),
               "run_until_kill_seconds": round(killed["seconds"], 2)}
        again = run_data([str(warc)], out, home)
        result = data_result(out)
        row.update(rerun_seconds=round(again["seconds"], 2), rerun_status=again["status"],
                   same_ids=result["ids"] == reference["ids"],
                   same_digest=result["content_digest"] == reference["content_digest"],
                   leftovers=len(result["leftovers"]))
        row["survived"] = bool(row["killed"] and not row["orphans"] and again["status"] == 0 and row["same_ids"]
                               and row["same_digest"] and not row["leftovers"])
        rows.append(row)
    tried = [r for r in rows if r["killed"]]
    return {"stage": "data", "clean_seconds": round(clean["seconds"], 2), "kill_points": rows, "tried": len(tried),
            "survived": sum(r["survived"] for r in tried),
            "mean_rerun_seconds": round(sum(r["rerun_seconds"] for r in tried) / max(1, len(tried)), 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="working folder (default: a temporary one, removed afterwards)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--stages", default="data,pretrain,sft,reward,dpo,ppo")
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="bench-faults-")).resolve()
    stages = [s for s in args.stages.split(",") if s]
    try:
        inputs = tiny_inputs(root)
        results = [drill_data(root)] if "data" in stages else []
        clean_pretrain, clean_sft, clean_reward = root / "pretrain-clean", root / "sft-clean", root / "reward-clean"
        later = {"reward", "dpo", "ppo"} & set(stages)
        if "pretrain" in stages:
            results.append(drill_stage("pretrain", lambda out: pretrain_spec(inputs, out), clean_pretrain, root,
                                       args.seed, PRETRAIN_STEPS))
            results.append(drill_stage("pretrain-ddp", lambda out: {**pretrain_spec(inputs, out), "num_processes": 2},
                                       root / "pretrain-ddp-clean", root, args.seed + 5, PRETRAIN_STEPS))
        elif "sft" in stages or later:
            rerun(pretrain_spec(inputs, clean_pretrain))
        sft = clean_sft / "model"
        if "sft" in stages:
            results.append(drill_stage("sft", lambda out: sft_spec(inputs, clean_pretrain / "model", out), clean_sft,
                                       root, args.seed + 1, SFT_STEPS))
        elif later:
            rerun(sft_spec(inputs, clean_pretrain / "model", clean_sft))
        if "reward" in stages:
            results.append(drill_stage("reward", lambda out: reward_spec(inputs, sft, out), clean_reward, root,
                                       args.seed + 2, REWARD_STEPS))
        elif "ppo" in stages:
            rerun(reward_spec(inputs, sft, clean_reward))
        if "dpo" in stages:
            results.append(drill_stage("dpo", lambda out: dpo_spec(inputs, sft, out), root / "dpo-clean", root,
                                       args.seed + 3, DPO_STEPS))
        if "ppo" in stages:
            results.append(drill_stage("ppo", lambda out: ppo_spec(inputs, sft, clean_reward / "model", out),
                                       root / "ppo-clean", root, args.seed + 4, PPO_STEPS, checkpoint_every=4))
        print(f"{'stage':9} {'kill point':28} {'killed at':>9} {'orphans':>7} {'rerun s':>8} {'same':>5}")
        for res in results:
            for r in res["kill_points"]:
                same = r.get("same_weights", r.get("same_digest", r.get("error", "-")))
                print(f"{res['stage']:9} {r['point']:28} {r.get('killed_at_step', '-'):>9} {r.get('orphans', '-'):>7} "
                      f"{r.get('rerun_seconds', '-'):>8} {str(same):>5}")
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
