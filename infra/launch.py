"""Starting training stages under ``accelerate launch`` and streaming their output.

The orchestration layer (a Prefect task, the CLI, a test) builds the command
with :func:`accelerate_command` (a one-process launch becomes the rank's own
command, :func:`simple_launch`) and runs it with :func:`run_streaming`, which
hands every output line to a callback (a logger, a progress parser) as it
arrives and keeps the whole log on disk; a failure raises with the tail of
that log, so the error that killed a distributed job is in the exception.

The accelerate configs in ``infra/accelerate/`` fix the distribution mode:
``cpu.yaml`` (one CPU process), ``cpu_ddp.yaml`` (DDP over gloo on one CPU
machine), ``gpu_ddp.yaml`` (DDP over NCCL), ``fsdp.yaml`` (FSDP2) and
``deepspeed.yaml`` (DeepSpeed ZeRO-2; needs the ``deepspeed`` package). The
process count given here overrides the one in the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from crawl2chat.stages.lifetime import (HAVE_PDEATHSIG, OWNER_ENV, descendants, die_with_parent_preexec,
                                       terminate_tree)
from crawl2chat.stages.start_gate import GO, START_GATE_ENV

CONFIG_DIR = Path(__file__).resolve().parent / "accelerate"


class LaunchError(RuntimeError):
    def __init__(self, cmd: list[str], returncode: int, tail: str, log_path: Path | None):
        self.cmd, self.returncode, self.tail, self.log_path = cmd, returncode, tail, log_path
        super().__init__(
            f"command exited with status {returncode}: {' '.join(cmd)}\n"
            f"log: {log_path}\n--- last lines ---\n{tail}")

    def __reduce__(self):
        # Ray (a node's launch on another machine) and Prefect (a task's failed state) carry
        # exceptions between processes by pickling; the default rebuilds from the message alone.
        return type(self), (self.cmd, self.returncode, self.tail, self.log_path)


def accelerate_config_path(name: str) -> Path:
    """``"cpu_ddp"`` or ``"cpu_ddp.yaml"`` -> the packaged config file."""
    p = CONFIG_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not p.exists():
        raise FileNotFoundError(f"no accelerate config {p}; have {sorted(x.name for x in CONFIG_DIR.glob('*.yaml'))}")
    return p


@dataclass(frozen=True)
class NodeLayout:
    """One machine's place in a job over several: ``nodes`` machines, this one ``rank``
    (0 hosts the rendezvous at ``main_ip``:``main_port``). ``num_processes`` stays the
    job's total, split evenly over the machines."""

    nodes: int
    rank: int
    main_ip: str
    main_port: int

    def args(self) -> list[str]:
        return ["--num_machines", str(self.nodes), "--machine_rank", str(self.rank),
                "--main_process_ip", self.main_ip, "--main_process_port", str(self.main_port)]


def accelerate_command(module: str, args: list[str], num_processes: int = 1,
                       accelerate_config: str | None = None, cpu: bool = True,
                       node: NodeLayout | None = None, cpu_share: int = 1) -> list[str]:
    """``python -m accelerate.commands.launch ... -m MODULE ARGS`` for this interpreter.

    Without an explicit ``accelerate_config`` the packaged one is chosen:
    ``cpu``/``cpu_ddp`` on CPU, ``gpu_ddp`` on GPUs (``fsdp`` and ``deepspeed`` must be asked for).
    ``accelerate_config`` may be a packaged name (``"fsdp"``) or a path. ``node``: this
    machine's part of a job over several (``num_processes`` is the total). ``cpu_share``:
    how many jobs share this machine's cores at the same time (on CPU each rank gets
    that share of the cores as its threads)."""
    if node is not None and num_processes % node.nodes:
        raise ValueError(f"num_processes={num_processes} must split evenly over {node.nodes} nodes")
    if accelerate_config is None:
        name = ("cpu" if num_processes == 1 else "cpu_ddp") if cpu else "gpu_ddp"
        config = accelerate_config_path(name)
    elif Path(accelerate_config).exists():
        config = Path(accelerate_config)
    else:
        config = accelerate_config_path(accelerate_config)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(num_processes)]
    distributed = distributed_type(config)
    if cpu and distributed == "FSDP":
        from crawl2chat.stages.settings import SettingsError

        # Accelerate runs CPU processes as MULTI_CPU and drops its FSDP plugin: plain DDP, no sharding.
        raise SettingsError(f"accelerate_config={accelerate_config} asks for FSDP, which Accelerate runs on GPUs "
                            "only (on CPU it would train plain DDP); on CPU shard with train.tp_size=2 and "
                            "train.dp_shard=true, or use accelerate_config=deepspeed")
    deepspeed = distributed == "DEEPSPEED"
    # One machine: a free local port for the rendezvous; several: the main machine's address.
    rendezvous = node.args() if node is not None else ["--main_process_port", str(_free_port())]
    if deepspeed:
        # DeepSpeed's launcher starts every rank itself (one included) and takes
        # neither --multi_gpu nor --cpu; without GPUs DeepSpeed picks its CPU
        # accelerator (gloo) on its own.
        cmd += rendezvous
    elif num_processes > 1 and distributed != "FSDP":
        cmd.append("--multi_gpu")  # CPU too: torch.distributed with gloo, ACCELERATE_USE_CPU from the config
        cmd += rendezvous
    elif node is not None:
        cmd += rendezvous
    elif num_processes == 1 and cpu:
        cmd.append("--cpu")
    if cpu:
        # Keep every rank on the CPU even where a GPU is visible (accelerate's
        # multi-process launcher does not export this from the config); not
        # under DeepSpeed, which accelerate switches off when it is set.
        # fp32: CPUs without bf16 units run bf16 autocast far slower than fp32.
        threads = max(1, (os.cpu_count() or 1) // (num_processes // (node.nodes if node else 1) * cpu_share))
        env = [] if deepspeed else ["env", "ACCELERATE_USE_CPU=true"]
        cmd = [*env, *cmd, "--mixed_precision", "no", "--num_cpu_threads_per_process", str(threads)]
    return cmd + ["-m", module, *args]


def simple_launch(cmd: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """What ``accelerate launch`` would start for ``cmd`` (one of :func:`accelerate_command`)
    when it uses its simple launcher: the rank's command line and the variables accelerate
    adds to its environment; None for launches through torchrun or DeepSpeed's launcher.

    For one process, accelerate's launcher only starts the script with a few variables
    set (precision, threads, dynamo, CPU) and waits for it, after importing torch to
    work them out: ~1.5-2.5 s on a small CPU before the rank starts, which imports torch
    again. This works them out with accelerate's own parser, config-file defaults and
    ``prepare_simple_launcher_cmd_env``, in the caller's process, which has torch
    imported already; the rank then runs as the caller's child, one link shorter."""
    env: dict[str, str] = {}
    rest = list(cmd)
    if rest[:1] == ["env"]:
        rest.pop(0)
        while rest and "=" in rest[0] and not rest[0].startswith("-"):
            key, _, value = rest.pop(0).partition("=")
            env[key] = value
    if rest[:3] != [sys.executable, "-m", "accelerate.commands.launch"]:
        return None
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import ComputeEnvironment
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(rest[3:]))
    # The branches of accelerate's ``launch_command`` that do not end in ``simple_launcher``.
    if not args.cpu and (args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.multi_gpu or args.tpu):
        return None
    if defaults is not None and defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER:
        return None
    rank_cmd, rank_env = prepare_simple_launcher_cmd_env(args)
    # The launcher copies its own environment, which ``env`` prefixed, and sets its variables over it.
    env.update({k: v for k, v in rank_env.items() if os.environ.get(k) != v})
    return rank_cmd, env


def distributed_type(config: str | os.PathLike) -> str:
    """The ``distributed_type`` an accelerate config file asks for (``NO``, ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED``...)."""
    import yaml

    data = yaml.safe_load(Path(config).read_text()) or {}
    return str(data.get("distributed_type", "NO")).upper()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_streaming(cmd: list[str], env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None,
                  on_line: Callable[[str], None] | None = None, tail_lines: int = 60, cwd: str | None = None,
                  grace_seconds: float = 10.0, meanwhile: Sequence[Callable[[], object]] = (),
                  prepare: Callable[[], object] | None = None) -> int:
    """Run ``cmd``, passing each output line (stdout and stderr merged) to ``on_line``
    and appending it to ``log_path``. Returns 0; raises :class:`LaunchError` with the
    last ``tail_lines`` lines otherwise. ``env`` is added to this process's environment.

    ``meanwhile``: work the caller does after the command anyway (importing what its
    evaluation loads), done on this thread once the command has started, while it
    starts up (its output waits in the pipe meanwhile). A failing item is skipped and
    left to the code that needs it, to report where it belongs.

    ``prepare``: work the command's input needs done first (a training stage's
    tokenizer and packing), done here while the command, started with
    ``CRAWL2CHAT_START_GATE``, imports its libraries and waits at its gate
    (:mod:`crawl2chat.stages.start_gate`); when it is done the command is told to go on.
    When it fails, the command is stopped and its error raised here.

    The command never outlives this process: it runs in a process group of its
    own, with a parent-death signal (SIGKILL, on Linux) tied to the calling
    thread, and its pid passed down as the owner of the job
    (:mod:`crawl2chat.stages.lifetime`); a rank that arms its own signal late finds
    the owner gone and exits. When this call is interrupted (Ctrl-C, SIGTERM
    turned into an exception, a cancelled task) the whole tree gets SIGTERM, then
    SIGKILL after ``grace_seconds``."""
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", OWNER_ENV: str(os.getpid()),
                **({START_GATE_ENV: "1"} if prepare is not None else {})}
    tail: deque[str] = deque(maxlen=tail_lines)
    log = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a", encoding="utf-8")
    try:
        # A new session: Ctrl-C in a terminal reaches this process only, which then
        # stops the job in order; the group id is the child's pid.
        proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if prepare is not None else None,
                                text=True, bufsize=1, errors="replace", start_new_session=True,
                                preexec_fn=die_with_parent_preexec() if HAVE_PDEATHSIG else None)
        try:
            if prepare is not None:
                prepare()
                try:
                    proc.stdin.write(GO + "\n")
                    proc.stdin.close()
                except OSError:  # it has already ended: its output and status below say why
                    pass
            for item in meanwhile:
                try:
                    item()
                except Exception:  # noqa: BLE001 - raised again where the work is really needed
                    pass
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if log:
                    log.write(line + "\n")
                    log.flush()
                if on_line:
                    on_line(line)
            rc = proc.wait()
        except BaseException:
            # Interrupted: take the launcher and every rank down with us, ranks that
            # left the process group included.
            tree = [p for p in (_as_process(proc.pid), *descendants(proc.pid)) if p is not None]
            terminate_tree(proc.pid, tree, grace=grace_seconds)
            proc.wait()
            raise
    finally:
        if log:
            log.close()
    if rc != 0:
        raise LaunchError(cmd, rc, "\n".join(tail), Path(log_path) if log_path else None)
    return rc


def _as_process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
