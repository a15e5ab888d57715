"""Fault drills: kill a training run at a chosen point, rerun it, compare.

A drill starts the run's *owner* (``python -m crawl2chat.infra.fault_drill
SPEC_JSON``, which calls ``launch_training`` as ``crawl2chat <stage>`` and the
Prefect task do) in a session of its own, waits until the run reaches the kill
point, SIGKILLs one process of the tree, checks that no process of the run is
left, reruns the same launch to the end and returns how long each part took.
The fault tests (``tests/faults``) and ``benchmarks/bench_faults.py`` use it.

Kill targets: ``owner`` (its whole process group, as a terminal or a process
supervisor kills a command), ``launcher`` (the ``accelerate launch`` process,
which only a run of several processes has: the owner starts a one-process run
itself) and ``rank`` (a training process). A spec's optional
``num_processes`` sets how many ranks the run has (one by default). Kill points: ``step`` (once
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
from contextlib import contextmanager
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


@contextmanager
def paused(pid: int):
    """SIGSTOP ``pid`` and its descendants for the duration of the block, then SIGCONT them."""
    import psutil

    from crawl2chat.stages.lifetime import descendants

    try:
        procs = [psutil.Process(pid)] + descendants(pid)
    except psutil.Error:
        procs = []
    for proc in procs:
        try:
            proc.suspend()
        except psutil.Error:
            pass
    try:
        yield
    finally:
        for proc in procs:
            try:
                proc.resume()
            except psutil.Error:
                pass


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
    if point.target == "launcher" and spec.get("num_processes", 1) == 1:
        raise ValueError(f"{point}: a one-process run has no launcher process (its owner starts the rank); "
                         "give the spec num_processes >= 2")
    owner = start_owner(spec, out.parent / f"{out.name}.owner.log")
    t0 = time.monotonic()
    killed, called = False, False
    try:
        while time.monotonic() - t0 < timeout and owner.poll() is None:
            steps = logged_steps(out)
            if steps >= 1 and on_running and not called:
                called = True
                with paused(owner.pid):  # the run stays where it is while the checks take their time
                    on_running(owner)
                continue
            if steps >= spec["max_steps"]:
                break  # finished training before the kill point: ``killed`` stays False
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
                    overrides=spec["overrides"], num_processes=spec.get("num_processes", 1))
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
PAIRS = ["seq_len=64", "micro_batch_size=4", "lr=1e-3", "min_lr=1e-4", "warmup_steps=2", "eval_every=0",
         "eval_batches=2", "checkpoint_every=10", "keep_checkpoints=2"]
REWARD_STEPS = DPO_STEPS = 30
# PPO counts rollouts: 4 prompts each, 8-token answers, a checkpoint every 4 of 12.
PPO = ["rollout_batch_size=4", "micro_batch_size=4", "ppo_epochs=2", "max_new_tokens=8", "lr=1e-4",
       "checkpoint_every=4", "keep_checkpoints=2", "log_every=1"]
PPO_STEPS = 12


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
    # Preferences: the reversed prompt is preferred to a shuffled one; the prompts alone for PPO.
    pairs = []
    for r in rows:
        shuffled = r["prompt"].split()
        rng.shuffle(shuffled)
        pairs.append({"prompt": r["prompt"], "chosen": r["response"], "rejected": " ".join(shuffled + ["fool"])})
    prefs = root / "prefs.jsonl"
    prefs.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    return {"text": str(text), "tokenizer": str(tok_dir), "sft": str(sft_data), "prefs": str(prefs),
            "prompts": str(prompts)}


def pretrain_spec(inputs: dict, out: str | os.PathLike) -> dict:
    return {"stage": "pretrain", "inputs": {"data": inputs["text"]}, "out": str(out), "max_steps": PRETRAIN_STEPS,
            "overrides": [*PRETRAIN, f"tokenizer={inputs['tokenizer']}"]}


def sft_spec(inputs: dict, base: str | os.PathLike, out: str | os.PathLike) -> dict:
    return {"stage": "sft", "inputs": {"base": str(base), "data": inputs["sft"]}, "out": str(out),
            "max_steps": SFT_STEPS, "overrides": SFT}


def reward_spec(inputs: dict, base: str | os.PathLike, out: str | os.PathLike) -> dict:
    return {"stage": "reward", "inputs": {"base": str(base), "data": inputs["prefs"]}, "out": str(out),
            "max_steps": REWARD_STEPS, "overrides": PAIRS}


def dpo_spec(inputs: dict, policy: str | os.PathLike, out: str | os.PathLike) -> dict:
    return {"stage": "dpo", "inputs": {"policy": str(policy), "data": inputs["prefs"]}, "out": str(out),
            "max_steps": DPO_STEPS, "overrides": PAIRS}


def ppo_spec(inputs: dict, policy: str | os.PathLike, reward: str | os.PathLike, out: str | os.PathLike) -> dict:
    return {"stage": "ppo", "inputs": {"policy": str(policy), "reward": str(reward), "prompts": inputs["prompts"]},
            "out": str(out), "max_steps": PPO_STEPS, "overrides": PPO}


def seeded_points(seed: int, max_steps: int, checkpoint_every: int, launcher: bool = False) -> list[KillPoint]:
    """One kill of the owner and of the rank at a seeded step, one of the owner during a
    save, and with ``launcher`` (a run of several processes) one of the launcher."""
    import random

    rng = random.Random(seed)
    lo, hi = checkpoint_every + 2, max_steps - 5
    points = [KillPoint("owner", rng.randint(lo, hi)), KillPoint("rank", rng.randint(lo, hi))]
    launcher_step = rng.randint(lo, hi)  # drawn either way: a seed gives the same other points with or without it
    if launcher:
        points.append(KillPoint("launcher", launcher_step))
    points.append(KillPoint("owner", rng.randint(checkpoint_every, max_steps - checkpoint_every - 1),
                            during_save=True))
    return points



# ---------------------------------------------------------------- the data stage

# Where a data build is killed: inside a step's Ray job (``in:STEP``, from outside,
# once the step's temporary folder appears) or at a named point of a commit
# sequence (``at:POINT``, the process kills itself there; see
# ``stages/fault_points.py``).
DATA_STEPS = ("extract", "langid", "quality", "dedup", "balance")
DATA_COMMIT_POINTS = (*(f"step:{s}:{w}" for s in DATA_STEPS for w in ("written", "committed")),
                      "write:staged", "write:files_moved", "write:version_renamed")
DATA_SETTINGS = ["data.dedup.num_shards=4", "data.shard_bytes=20000"]
DATA_TAG = "CRAWL2CHAT_DATA_DRILL"  # marks the command and every process it starts (Ray's included)

PROSE = ("the river town market people walked along old stone bridge morning light fell across water boats "
         "carried fish bread and wine from farms in the valley children played near gardens while their parents "
         "talked about weather prices harvest news letters from cities far away each season brought travellers "
         "who told stories of mountains forests roads and long winters that shaped the life of every family").split()


def drill_warc(path: str | os.PathLike, pages: int = 60, seed: int = 0) -> Path:
    """A gzipped WARC of ``pages`` English prose pages, every fifth one a near copy of
    its predecessor (so dedup has work), with fixed record ids and dates."""
    import io
    import random
    import uuid

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bodies: list[str] = []
    for n in range(pages):
        rng = random.Random(seed * 100_000 + (n - 1 if n % 5 == 4 else n))
        paragraphs = [" ".join(" ".join(rng.choice(PROSE) for _ in range(rng.randint(9, 15))).capitalize() + "."
                               for _ in range(4)) for _ in range(5)]
        if n % 5 == 4:
            paragraphs[-1] = f"Updated edition {n}."
        bodies.append(f"<html><head><title>page {n}</title></head><body>"
                      + "".join(f"<p>{p}</p>" for p in paragraphs) + "</body></html>")
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        for n, html in enumerate(bodies):
            body = html.encode()
            http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record(
                f"http://town.example.org/page{n}", "response", payload=io.BytesIO(body), length=len(body),
                http_headers=http, warc_headers_dict={"WARC-Record-ID": f"<urn:uuid:{uuid.UUID(int=n + 1)}>",
                                                      "WARC-Date": "2024-05-01T00:00:00Z"}))
    return path


def data_command(inputs: list[str], out: str | os.PathLike) -> list[str]:
    """``crawl2chat data`` on ``inputs`` into ``out``, as a user types it."""
    cmd = [sys.executable, "-m", "crawl2chat.cli", "data", "--out", str(out)]
    for path in inputs:
        cmd += ["--input", str(path)]
    for setting in DATA_SETTINGS:
        cmd += ["--set", setting]
    return cmd


def tagged_processes(tag: str) -> list[tuple[int, str]]:
    """Live processes whose environment carries ``DATA_TAG=tag``, with their command lines."""
    needle = f"{DATA_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in env and state != "Z":
            found.append((int(entry), cmd.strip()[:300]))
    return found


def run_data(inputs: list[str], out: str | os.PathLike, home: str | os.PathLike, kill_at: str | None = None,
             timeout: float = 600.0) -> dict:
    """Run ``crawl2chat data`` (working folder ``home``, so its MLflow store and Prefect
    state stay there), SIGKILLing it at ``kill_at`` (``in:STEP`` or ``at:POINT``) when
    given; returns the exit status, whether the kill happened, the processes of the
    command still alive 30 s later, the wall time and the end of its output."""
    import secrets

    out, home = Path(out).resolve(), Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(6)
    env = {**os.environ, DATA_TAG: tag}
    if kill_at and kill_at.startswith("at:"):
        env["CRAWL2CHAT_KILL_AT"] = kill_at[3:]
    log = home / f"data-{tag}.log"
    t0 = time.monotonic()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(data_command(inputs, out), cwd=home, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    killed = False
    try:
        if kill_at and kill_at.startswith("in:"):
            step = kill_at[3:]
            while proc.poll() is None and time.monotonic() - t0 < timeout:
                if any((out / "work").glob(f"v*/.{step}.tmp-*")) or any((out / "work").glob(f".{step}.tmp-*")):
                    os.killpg(proc.pid, signal.SIGKILL)  # the command's whole group, as a terminal kills it
                    killed = True
                    break
                time.sleep(0.01)
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if kill_at and kill_at.startswith("at:"):
        killed = proc.returncode == -signal.SIGKILL
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while (left := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"status": proc.returncode, "killed": killed, "orphans": left, "seconds": seconds,
            "output": log.read_text(errors="replace")[-3000:]}


def data_result(out: str | os.PathLike) -> dict:
    """What a data build produced: its version, content digest and kept document ids,
    and any temporary folder left behind."""
    import pyarrow.parquet as pq

    from crawl2chat.stages.data.versions import read_manifest, shard_files

    out = Path(out)
    manifest = read_manifest(str(out)) or {}
    ids = sorted(pq.read_table(shard_files(out), columns=["id"])["id"].to_pylist()) if manifest else []
    leftovers = sorted(str(p.relative_to(out)) for p in out.rglob("*") if ".tmp-" in p.name)
    return {"version": manifest.get("version"), "versions": manifest.get("versions"),
            "content_digest": manifest.get("content_digest"), "ids": ids,
            "documents_dropped": manifest.get("documents_dropped"), "leftovers": leftovers,
            "review": (out / "review.md").exists()}

if __name__ == "__main__":
    from crawl2chat.tasks.train import launch_training

    _spec = json.loads(sys.argv[1])
    launch_training(_spec["stage"], _spec["inputs"], _spec["out"], max_steps=_spec["max_steps"],
                    overrides=_spec["overrides"], num_processes=_spec.get("num_processes", 1))
