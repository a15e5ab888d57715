"""Fault drills: kill a training run at a chosen point, rerun it, compare.

A drill starts the run's *owner* (``python -m crawl2chat.infra.fault_drill
SPEC_JSON``, which calls ``launch_training`` as ``crawl2chat <stage>`` and the
Prefect task do) in a session of its own, waits until the run reaches the kill
point, SIGKILLs one process of the tree, checks that no process of the run is
left, reruns the same launch to the end and returns how long each part took.
The fault tests (``tests/faults``) and ``benchmarks/bench_faults.py`` use it.

Kill targets: ``owner`` (its whole process group, as a terminal or a process
supervisor kills a command), ``launcher`` (the ``accelerate launch`` process)
and ``rank`` (the training process). Kill points: ``step`` (once
``metrics.jsonl`` shows that many optimizer steps) or ``save`` (while a
checkpoint is being written: a ``step_*.tmp`` folder exists after that step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

TARGETS = ("owner", "launcher", "rank")


@dataclass
class KillPoint:
    target: str  # owner | launcher | rank
    step: int  # kill once this many steps are logged (for "save": the first save after it)
    during_save: bool = False

    def __str__(self) -> str:
        return f"{self.target}@{'save>' if self.during_save else ''}{self.step}"


def run_processes(folder: str | os.PathLike) -> list[tuple[int, str]]:
    """Live processes (other than this one) whose command line names ``folder``."""
    needle = str(Path(folder).resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if needle in cmd and state != "Z":
            found.append((int(entry), cmd))
    return found


def wait_until_gone(folder: str | os.PathLike, timeout: float = 30.0) -> list[tuple[int, str]]:
    """Wait for every process naming ``folder`` to exit; returns those still alive at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = run_processes(folder)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def logged_steps(out: str | os.PathLike) -> int:
    """The highest optimizer step in ``OUT/metrics.jsonl`` (0 when none)."""
    best = 0
    try:
        text = (Path(out) / "metrics.jsonl").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if rec.get("type") == "step":
            best = max(best, int(rec["step"]))
    return best


def target_pid(target: str, owner: subprocess.Popen, out: str | os.PathLike, module: str) -> int | None:
    if target == "owner":
        return owner.pid
    for pid, cmd in run_processes(out):
        launcher = "accelerate.commands.launch" in cmd
        if target == "launcher" and launcher:
            return pid
        if target == "rank" and not launcher and f"-m {module}" in cmd:
            return pid
    return None


def start_owner(spec: dict, log: str | os.PathLike | None = None) -> subprocess.Popen:
    """The owner process of the launch ``spec`` (stage, inputs, out, max_steps, overrides)."""
    sink = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen([sys.executable, "-m", "crawl2chat.infra.fault_drill", json.dumps(spec)],
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log:
            sink.close()


def kill_at(spec: dict, point: KillPoint, timeout: float = 600.0, on_running=None) -> dict:
    """Start the owner of ``spec`` and SIGKILL ``point.target`` at ``point``; returns what
    happened (``killed``: False when the run ended first; ``orphans``: processes naming
    the run folder 30 s after the kill). ``on_running(owner)`` is called once the run
    is training (the two-writer checks use it)."""
    from crawl2chat.stages.training.registry import STAGES

    out = Path(spec["out"])
    module = STAGES[spec["stage"]].module
    owner = start_owner(spec, out.parent / f"{out.name}.owner.log")
    t0 = time.monotonic()
    killed, called = False, False
    try:
        while time.monotonic() - t0 < timeout and owner.poll() is None:
            steps = logged_steps(out)
            if steps >= 1 and on_running and not called:
                called = True
                on_running(owner)
                continue
            ready = steps >= point.step
            if ready and point.during_save:
                ready = any(p.name.endswith(".tmp") for p in (out / "checkpoints").glob("step_*.tmp"))
            if ready:
                pid = target_pid(point.target, owner, out, module)
                if pid is not None:
                    if point.target == "owner":
                        os.killpg(pid, signal.SIGKILL)  # the command and whatever shares its group
                    else:
                        os.kill(pid, signal.SIGKILL)
                    killed = True
                    break
            time.sleep(0.005 if point.during_save else 0.02)
        owner.wait(timeout=120)
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
    orphans = wait_until_gone(out)
    return {"point": str(point), "killed": killed, "killed_at_step": logged_steps(out),
            "owner_status": owner.returncode, "orphans": orphans, "seconds": time.monotonic() - t0}


def rerun(spec: dict) -> float:
    """The same launch again, in this process, to the end; returns its wall time."""
    from crawl2chat.tasks.train import launch_training

    t0 = time.monotonic()
    launch_training(spec["stage"], spec["inputs"], spec["out"], max_steps=spec["max_steps"],
                    overrides=spec["overrides"])
    return time.monotonic() - t0


def same_weights(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two model folders hold bitwise-equal tensors."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ---------------------------------------------------------------- the tiny runs drilled by the tests and the benchmark

WORDS = ("the king queen night day sword crown river stone bright dark speak answer gentle noble "
         "fool heart blood honour tomorrow love death war peace lord lady").split()

# A tiny model, 32-token windows, a checkpoint every 10 of 40 steps.
PRETRAIN = ["preset=tiny", "seq_len=32", "micro_batch_size=4", "lr=3e-3", "min_lr=3e-4", "warmup_steps=5",
            "eval_batches=2", "val_fraction=0.1", "eval_every=0", "checkpoint_every=10", "keep_checkpoints=2"]
PRETRAIN_STEPS = 40
SFT = ["seq_len=64", "micro_batch_size=4", "lr=1e-3", "min_lr=1e-4", "warmup_steps=2", "eval_every=0",
       "eval_batches=2", "checkpoint_every=10", "keep_checkpoints=2"]
SFT_STEPS = 30


def text_lines(n_lines: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


def tiny_inputs(root: str | os.PathLike) -> dict:
    """A small corpus with its tokenizer and a small SFT set under ``root``."""
    import random

    from crawl2chat.stages.training.pretrain import prepare_data
    from crawl2chat.stages.training.settings import PretrainConfig

    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    text = root / "corpus.txt"
    text.write_text(text_lines(3000, 0))
    tok_dir, _ = prepare_data(PretrainConfig(vocab_size=300, val_fraction=0.1), text, root / "prep")
    rng = random.Random(1)
    rows = []
    for _ in range(120):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
        rows.append({"prompt": prompt, "response": " ".join(reversed(prompt.split()))})
    sft_data = root / "sft.jsonl"
    sft_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"text": str(text), "tokenizer": str(tok_dir), "sft": str(sft_data)}


def pretrain_spec(inputs: dict, out: str | os.PathLike) -> dict:
    return {"stage": "pretrain", "inputs": {"data": inputs["text"]}, "out": str(out), "max_steps": PRETRAIN_STEPS,
            "overrides": [*PRETRAIN, f"tokenizer={inputs['tokenizer']}"]}


def sft_spec(inputs: dict, base: str | os.PathLike, out: str | os.PathLike) -> dict:
    return {"stage": "sft", "inputs": {"base": str(base), "data": inputs["sft"]}, "out": str(out),
            "max_steps": SFT_STEPS, "overrides": SFT}


def seeded_points(seed: int, max_steps: int, checkpoint_every: int) -> list[KillPoint]:
    """One kill of each target at a seeded step, and one of the owner during a save."""
    import random

    rng = random.Random(seed)
    lo, hi = checkpoint_every + 2, max_steps - 5
    return [KillPoint("owner", rng.randint(lo, hi)), KillPoint("rank", rng.randint(lo, hi)),
            KillPoint("launcher", rng.randint(lo, hi)),
            KillPoint("owner", rng.randint(checkpoint_every, max_steps - checkpoint_every - 1), during_save=True)]


if __name__ == "__main__":
    from crawl2chat.tasks.train import launch_training

    _spec = json.loads(sys.argv[1])
    launch_training(_spec["stage"], _spec["inputs"], _spec["out"], max_steps=_spec["max_steps"],
                    overrides=_spec["overrides"])
