"""Training machinery shared by every model stage (pretraining, SFT, RM, DPO).

A stage supplies a model, a ``batch_fn`` that returns the micro-batch for a
(global batch index, micro step, rank, world size), and a ``loss_fn``; the
:class:`Trainer` here owns everything else:

* the optimizer (AdamW or Lion, weight decay on matrices only) and the
  learning-rate schedule (warmup + cosine / linear / polynomial / step /
  warmup-stable-decay / constant);
* gradient accumulation, clipping by global norm, mixed precision chosen from
  the hardware (fp32 on CPU, bf16 on GPUs that have it, else fp16);
* DDP, FSDP or DeepSpeed ZeRO, as the accelerate config chooses; under
  DeepSpeed the engine does the accumulation, clipping and optimizer step, and
  the trainer writes its own micro-batch size, accumulation steps and clipping
  norm into the DeepSpeed config so the two agree;
* checkpoints with ``accelerator.save_state``: model, optimizer, scheduler,
  RNG states and the :class:`TrainState` (step, data position, learning-rate
  scale, rollback count, recent losses), so a resumed run continues exactly
  where it stopped; nothing in a checkpoint is loaded in a way that can run code
  (:class:`JsonStateAccelerator`: the schedule and the trainer's state as JSON);
* rollback: a non-finite loss or gradient norm, or a loss spike beyond
  ``spike_factor`` x the recent mean, reloads the last good checkpoint, skips
  the batches since it up to and including the offending one, scales the
  learning rate by ``lr_factor`` and records the event, in
  ``OUT/checkpoints/rollback.json`` at once (a run killed before its next
  checkpoint resumes with the lowered rate, past the bad batch); failures in a
  row go further back each time, past a checkpoint that keeps failing, and after
  ``max_rollbacks`` of them in a row the run fails with :class:`TrainingDiverged`;
* metrics as JSON lines in ``OUT/metrics.jsonl`` (rank 0 only), which the
  orchestration layer tails into MLflow. This module imports neither Prefect
  nor MLflow.

Data position: batches are addressed by a global index, and a stage's
``batch_fn`` must be a pure function of that index (pretraining draws random
windows from a generator seeded with ``(seed, index)``). Saving the index is
then all a checkpoint needs to resume the data stream, and skipping batches
after a rollback is advancing it.

Checkpoints are written to ``OUT/checkpoints/step_XXXXXXXX.tmp``, listed with
their sizes and sha256 in ``checksums.json`` and renamed when every rank has
finished, so a run killed mid-save never leaves a half-written checkpoint that a
resume would pick, and one damaged later (truncated, altered) is found before it
is loaded: the resume names the file and falls back to the previous checkpoint. Directories are named by
step explicitly instead of through accelerate's automatic naming, whose
counter ``load_state`` does not restore (the next save would collide).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from crawl2chat.stages.checksums import folder_damage, write_checksums
from crawl2chat.stages.training.models import is_checkpointing
from crawl2chat.stages.training.settings import LoopConfig, TrainConfig

CHECKPOINT_RE = re.compile(r"^step_(\d{8})$")
ROLLBACK_FILE = "rollback.json"  # in OUT/checkpoints: the newest rollback, written when it happens


# ---------------------------------------------------------------- configuration


# ---------------------------------------------------------------- hardware


def resolve_mixed_precision(choice: str) -> str:
    """``auto``: bf16 where the GPU has bf16 units, fp16 on older GPUs, fp32 on CPU
    (CPUs without bf16 units run autocast bf16 matmuls far slower than fp32)."""
    on_gpu = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    if choice == "fp16" and not on_gpu:  # Accelerate would train in fp32 and call it fp16
        raise ValueError("train.mixed_precision=fp16 needs a CUDA GPU; on a CPU choose bf16 or no")
    if choice != "auto":
        return choice
    if on_gpu:
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


def measure_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       n: int | None = None, seconds: float = 0.5) -> float:
    """Sustained dense matmul FLOP/s on this device with the current thread count:
    the denominator of model-FLOPs utilisation when no spec-sheet figure is given."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        sync()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return 2.0 * n**3 * iters / dt


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by this process, or its peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------- optimizer and schedule


def build_optimizer(model: torch.nn.Module, cfg: LoopConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW or Lion; weight decay on matrices, none on norms, biases and gains.

    ``fused``: torch's fused AdamW kernel, one pass over every parameter instead of
    a loop of small ops per parameter (on this project's CPU presets a step takes
    12 ms instead of 46 ms for 3.2M parameters; the weights agree to ~5e-7). For
    plain tensors that the optimizer updates itself (:func:`can_fuse`)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "lion":
        from lion_pytorch import Lion

        return Lion(groups, lr=cfg.lr, betas=cfg.betas)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, fused=fused or None)


def can_fuse(acc, model: torch.nn.Module) -> bool:
    """Whether the fused AdamW kernel takes this model's parameters under ``acc``: one
    process or DDP over plain CPU/CUDA float tensors. DeepSpeed and FSDP manage the
    optimizer's parameters themselves, and tensor/pipeline-parallel shards keep the
    per-parameter loop."""
    from accelerate.utils import DistributedType

    if acc.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return False
    if getattr(acc, "tp_mesh", None) is not None or getattr(acc, "pp_mesh", None) is not None:
        return False
    return all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda") and p.is_floating_point()
               for p in model.parameters())


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite. First the norm of them all, which an
    inf or NaN anywhere makes non-finite (~0.7 ms over a PPO run's 3.2M weights at the CPU
    bench shape, against ~6 ms for an ``isfinite`` per tensor); only when that is not finite
    (which overflow alone can make it) are the tensors read one by one."""
    if not tensors or bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors))):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def clip_by_global_norm(acc, parameters, max_norm: float):
    """Clip the gradients to ``max_norm`` by their global norm; returns the norm before
    clipping, as ``acc.clip_grad_norm_`` does (which does the work under DDP, FSDP,
    DeepSpeed, XLA and fp16 loss scaling).

    In one process without a loss scaler, the gradients are multiplied only when the norm
    is over ``max_norm``: torch's clipping multiplies them on every step by a coefficient
    clamped to 1 (so as never to read the norm back from a GPU), a pass over every gradient
    that leaves them as they were when nothing is clipped; measured ~1 ms of a ~28 ms PPO
    update step at the 1.6M-parameter CPU shape. The coefficient is torch's own, so the
    gradients are the same bits either way."""
    from accelerate.utils import DistributedType

    if acc.distributed_type != DistributedType.NO or acc.scaler is not None:
        return acc.clip_grad_norm_(parameters, max_norm)
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if float(max_norm / (norm + 1e-6)) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class _StepDecay:
    """Linear warmup, then x gamma every ``every`` steps (a picklable LambdaLR multiplier)."""

    def __init__(self, warmup: int, every: int, gamma: float, floor: float):
        self.warmup, self.every, self.gamma, self.floor = warmup, every, gamma, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return max(self.floor, self.gamma ** ((step - self.warmup) // self.every))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: LoopConfig):
    from transformers import get_scheduler

    kw = dict(num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps)
    min_ratio = cfg.min_lr / cfg.lr
    if cfg.schedule == "cosine":
        return get_scheduler("cosine_with_min_lr", optimizer, **kw, scheduler_specific_kwargs={"min_lr": cfg.min_lr})
    if cfg.schedule == "linear":
        return get_scheduler("polynomial", optimizer, **kw, scheduler_specific_kwargs={"lr_end": cfg.min_lr, "power": 1.0})
    if cfg.schedule == "polynomial":
        return get_scheduler("polynomial", optimizer, **kw,
                             scheduler_specific_kwargs={"lr_end": cfg.min_lr, "power": cfg.poly_power})
    if cfg.schedule == "wsd":
        decay = max(1, int(cfg.max_steps * cfg.decay_fraction))
        return get_scheduler("warmup_stable_decay", optimizer, **kw,
                             scheduler_specific_kwargs={"num_decay_steps": decay, "min_lr_ratio": min_ratio})
    if cfg.schedule == "step":
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, _StepDecay(max(1, cfg.warmup_steps), cfg.step_every, cfg.step_gamma, min_ratio))
    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=cfg.warmup_steps)


# ---------------------------------------------------------------- state, checkpoints, metrics


@dataclass
class TrainState:
    """What a checkpoint needs beyond model/optimizer/scheduler/RNG."""

    step: int = 0  # optimizer steps completed
    batch_index: int = 0  # next global batch to draw: the data position
    tokens_seen: int = 0
    lr_scale: float = 1.0  # product of rollback lr factors so far
    rollbacks: int = 0
    recent_losses: list[float] = field(default_factory=list)
    consecutive_rollbacks: int = 0  # rollbacks since training last got past a failed step
    failed_step: int = 0  # the furthest step that failed in the current run of rollbacks

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class TrainingDiverged(RuntimeError):
    pass


# ---------------------------------------------------------------- rollback bookkeeping (Trainer and PPO)


def apply_lr_scale(scheduler, optimizer, base_lr: float) -> None:
    """Set a LambdaLR schedule's base learning rate (a rollback lowers it) and recompute
    the current lr of every param group from it."""
    scheduler.base_lrs = [base_lr for _ in optimizer.param_groups]
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)


def read_rollback_record(ckpt_root: Path, say: Callable[[str], None] = print) -> dict[str, Any] | None:
    """``OUT/checkpoints/rollback.json``: the newest rollback's outcome, or None."""
    try:
        return json.loads((ckpt_root / ROLLBACK_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        say(f"{ckpt_root / ROLLBACK_FILE} is unreadable ({type(e).__name__}); ignored")
        return None


def write_rollback_record(ckpt_root: Path, record: dict[str, Any]) -> None:
    """Write the rollback record atomically and durably (main process only)."""
    tmp = ckpt_root / f".{ROLLBACK_FILE}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_root / ROLLBACK_FILE)


def discard_checkpoints(ckpt_root: Path, names: Iterable[str]) -> None:
    """Remove checkpoints a rollback fell back past (renamed aside first, so a kill
    midway never leaves a half-deleted folder that looks like a checkpoint)."""
    for name in names:
        path = ckpt_root / name
        if path.is_dir():
            aside = path.with_name(path.name + ".discarded")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            shutil.rmtree(aside, ignore_errors=True)


def rollback_plan(step: int, consecutive: int, failed_step: int) -> tuple[int, int]:
    """For a failure at ``step + 1``: (failures in a row including this one, the furthest
    failed step of that run). Failures in a row are those with no step past the
    furthest failed one in between."""
    failed = step + 1
    in_a_row = consecutive > 0 and step < failed_step
    return (consecutive + 1 if in_a_row else 1), (max(failed_step, failed) if in_a_row else failed)


def checkpoints(root: str | os.PathLike) -> list[Path]:
    """Every complete checkpoint folder under ``root``, oldest first (unverified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name))


def good_checkpoints(root: str | os.PathLike, exclude: Iterable[str] = (), main: bool = False,
                     report: Callable[[str], None] | None = None) -> list[Path]:
    """The checkpoints under ``root`` whose files match their checksums, newest first.

    A damaged one (a file truncated, missing or altered since it was written) is
    reported by name through ``report`` and, by the ``main`` process, renamed to
    ``step_XXXXXXXX.damaged`` so that no later resume considers it; ``exclude``
    names checkpoints to pass over (discarded by a rollback)."""
    good = []
    for path in reversed(checkpoints(root)):
        if path.name in exclude:
            continue
        damage = folder_damage(path)
        if damage is None:
            good.append(path)
            continue
        if report:
            report(f"checkpoint {path.name} is damaged ({damage}); falling back to an older one")
        if main:
            try:
                os.replace(path, path.with_name(path.name + ".damaged"))
            except OSError:
                pass
    return good


def latest_checkpoint(root: str | os.PathLike, main: bool = False,
                      report: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint under ``root`` that passes its checksums (see :func:`good_checkpoints`)."""
    for path in good_checkpoints(root, main=main, report=report):
        return path
    return None


def save_checkpoint(acc, root: Path, step: int, keep: int) -> Path:
    """``acc.save_state`` (models, optimizers, registered objects, RNG states) into
    ``root/step_XXXXXXXX``: written under a ``.tmp`` name, listed with sizes and
    sha256 in ``checksums.json`` and renamed, so a resume never picks a half-written
    checkpoint and detects one damaged since; only the newest ``keep`` are kept."""
    final = Path(root) / f"step_{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp), safe_serialization=True)
    acc.wait_for_everyone()
    if acc.is_main_process:
        write_checksums(tmp)  # every rank's files are complete: sizes and sha256, checked before a resume
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        kept = sorted(p for p in Path(root).iterdir() if CHECKPOINT_RE.match(p.name))
        for old in kept[: max(0, len(kept) - max(1, keep))]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (rank 0 only), flushed per line
    so a tailing reader sees every step as it happens."""

    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.enabled = enabled
        self.f = None
        if enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- trainer

# (model, batch) -> (mean loss over the batch's tokens, number of tokens)
LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, int]]
# (global batch index, micro step, rank, world size) -> micro-batch of tensors
BatchFn = Callable[[int, int, int, int], dict[str, torch.Tensor]]
# (rank, world size) -> this rank's validation micro-batches
EvalBatchesFn = Callable[[int, int], Iterable[dict[str, torch.Tensor]]]


CUSTOM_STATE = "custom_state_{}.json"  # in a checkpoint: the i-th object registered for checkpointing
CUSTOM_TENSORS = "custom_state_{}.safetensors"  # and its tensors, when it has any (``tensor_state_dict``)
PICKLED_CUSTOM_STATE = re.compile(r"^custom_checkpoint_\d+\.pkl$")  # Accelerate's own form of them


class JsonStateAccelerator(Accelerator):
    """An ``Accelerator`` whose checkpoints can be loaded without running code from them.

    Accelerate pickles the objects registered with ``register_for_checkpointing``
    (the learning-rate schedule, the trainer's own state) and unpickles them with
    ``torch.load`` with ``weights_only`` off, which runs whatever a tampered file asks. Here
    they are written as JSON instead, ``custom_state_<i>.json``, and read back with
    ``json``; the rest of a checkpoint is safetensors (the models) or files Accelerate
    itself loads with ``torch.load(weights_only=True)`` (optimizer, RNG states). A
    checkpoint that holds pickled registered objects is refused by name, never unpickled.

    A registered object with tensors (a queue of embeddings, a momentum encoder) also
    offers ``tensor_state_dict()`` and ``load_tensor_state_dict(tensors)``: they go to
    ``custom_state_<i>.safetensors`` beside its JSON, loaded after it.
    """

    # The tensor-parallel mesh ``(dp, tp)`` when ``tp_size`` > 1, the pipeline mesh
    # ``(dp, pp)`` when ``pp_size`` > 1 (:func:`make_accelerator`), else None.
    tp_mesh = None
    pp_mesh = None
    dp_shard = False  # FSDP over the data-parallel dimension of the tensor-parallel mesh

    @property
    def sharded(self) -> bool:
        """Whether each rank holds a different part of the model (tensor or pipeline parallel)."""
        return self.tp_mesh is not None or self.pp_mesh is not None

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        # In one plain fp32 process ``prepare`` hands the module back as it was, so there
        # is nothing to unwrap. Accelerate's unwrap would import DeepSpeed on first use
        # to recognise a wrapper such a process never has: ~2 s and its memory, paid
        # inside a PPO run's first rollout.
        from accelerate.utils import DistributedType

        plain = self.distributed_type == DistributedType.NO and self.mixed_precision == "no"
        if plain and not hasattr(model, "_orig_mod") and self.tp_mesh is None and self.pp_mesh is None:
            return model
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def save_state(self, output_dir=None, safe_serialization: bool = True, **kwargs):
        registered, self._custom_objects = self._custom_objects, []
        # Tensor or pipeline parallel: Accelerate would write the main process's part only;
        # every rank writes its own model and optimizer part instead (``rank<r>_state.*``).
        sharded, self._models, self._optimizers = self._parts(), *(([], []) if self.sharded
                                                                   else (self._models, self._optimizers))
        try:
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        finally:
            self._custom_objects = registered
            if sharded is not None:
                self._models, self._optimizers = sharded
        if sharded is not None:
            self._save_parts(Path(location), *sharded)
        if self.is_main_process:
            for i, obj in enumerate(registered):
                path = Path(location) / CUSTOM_STATE.format(i)
                try:
                    text = json.dumps(obj.state_dict(), allow_nan=True)
                except TypeError as e:
                    raise TypeError(f"{type(obj).__name__}.state_dict() is not plain data for {path.name}: {e}") from e
                path.write_text(text)
                if hasattr(obj, "tensor_state_dict"):
                    from safetensors.torch import save_file

                    tensors = {k: v.detach().contiguous().cpu() for k, v in obj.tensor_state_dict().items()}
                    save_file(tensors, str(Path(location) / CUSTOM_TENSORS.format(i)))
        return location

    def load_state(self, input_dir=None, **kwargs):
        folder = Path(input_dir)
        pickled = sorted(p.name for p in folder.iterdir() if PICKLED_CUSTOM_STATE.match(p.name))
        if pickled:
            raise ValueError(f"checkpoint {folder} holds pickled state ({', '.join(pickled)}), which is never "
                             "loaded; resume from a checkpoint written by this version or start the run again")
        if not self.sharded and (folder / PARALLEL_LAYOUT).exists():
            raise ValueError(f"checkpoint {folder} was written with tensor or pipeline parallelism "
                             f"({PARALLEL_LAYOUT}); resume it with the same tp_size, pp_size and number of processes")
        registered, self._custom_objects = self._custom_objects, []
        sharded, self._models, self._optimizers = self._parts(), *(([], []) if self.sharded
                                                                   else (self._models, self._optimizers))
        try:
            result = super().load_state(str(folder), **kwargs)
        finally:
            self._custom_objects = registered
            if sharded is not None:
                self._models, self._optimizers = sharded
        if sharded is not None:
            self._load_parts(folder, *sharded)
        for i, obj in enumerate(registered):
            path = folder / CUSTOM_STATE.format(i)
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"checkpoint file {path} is missing or unreadable: {e}") from e
            obj.load_state_dict(state)
            if hasattr(obj, "load_tensor_state_dict"):
                from safetensors.torch import load_file

                tensors_path = folder / CUSTOM_TENSORS.format(i)
                if not tensors_path.is_file():
                    raise ValueError(f"checkpoint file {tensors_path} is missing")
                obj.load_tensor_state_dict(load_file(str(tensors_path)))
        return result

    # ------------------------------------------------------------ tensor / pipeline parallel

    def _parts(self):
        return (self._models, self._optimizers) if self.sharded else None

    def _save_parts(self, folder: Path, models, optimizers) -> None:
        from safetensors.torch import save_file

        from crawl2chat.stages.training.parallel import local_state

        if len(models) != 1 or len(optimizers) != 1:
            raise ValueError("tensor- or pipeline-parallel checkpoints hold one model and one optimizer")
        tensors, meta = local_state(models[0], optimizers[0].optimizer)
        r = self.process_index
        save_file(tensors, str(folder / RANK_PART.format(r, "safetensors")))
        (folder / RANK_PART.format(r, "json")).write_text(json.dumps(meta, allow_nan=True))
        if self.is_main_process:
            (folder / PARALLEL_LAYOUT).write_text(json.dumps(self.layout()))
        self.wait_for_everyone()

    def layout(self) -> dict[str, int]:
        """How the model is split over the processes."""
        return {"tp_size": self.tp_mesh["tp"].size() if self.tp_mesh is not None else 1,
                "pp_size": self.pp_mesh["pp"].size() if self.pp_mesh is not None else 1,
                "dp_shard": self.dp_shard, "num_processes": self.num_processes}

    def _load_parts(self, folder: Path, models, optimizers) -> None:
        from safetensors.torch import load_file

        from crawl2chat.stages.training.parallel import load_local_state

        try:
            layout = json.loads((folder / PARALLEL_LAYOUT).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint {folder} has no readable {PARALLEL_LAYOUT} (written without tensor or "
                             f"pipeline parallelism?); resume it with the layout it was written with: {e}") from e
        if layout != self.layout():
            raise ValueError(f"checkpoint {folder} was written with {layout}; this run has {self.layout()}; "
                             "resume with the same tp_size, pp_size and number of processes")
        r = self.process_index
        meta = json.loads((folder / RANK_PART.format(r, "json")).read_text())
        load_local_state(models[0], optimizers[0].optimizer,
                         load_file(str(folder / RANK_PART.format(r, "safetensors"))), meta)

    def get_state_dict(self, model, unwrap: bool = True):
        """Under tensor parallelism every tensor gathered whole, under pipeline parallelism
        every stage's tensors on the main process, None elsewhere (a collective: every rank
        calls it)."""
        if self.pp_mesh is not None:
            from crawl2chat.stages.training.pipeline import gather_state_dict

            return gather_state_dict(self.unwrap_model(model) if unwrap else model, self.pp_mesh)
        if self.tp_mesh is not None:
            from crawl2chat.stages.training.parallel import full_state_dict

            return full_state_dict(self.unwrap_model(model) if unwrap else model)
        return super().get_state_dict(model, unwrap=unwrap)


PARALLEL_LAYOUT = "parallel_layout.json"  # in a tensor/pipeline-parallel checkpoint: tp_size, pp_size, processes
RANK_PART = "rank{}_state.{}"  # each rank's model and optimizer part (safetensors) and optimizer layout (JSON)


def make_accelerator(cfg: LoopConfig):
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    handlers = []
    backend = _deepspeed_cpu_backend()
    if backend:
        # accelerate knows no process-group backend for a machine without an
        # accelerator device and would report every DeepSpeed rank as process 0 of 1.
        handlers.append(InitProcessGroupKwargs(backend=backend))
    acc = JsonStateAccelerator(mixed_precision=resolve_mixed_precision(cfg.mixed_precision), kwargs_handlers=handlers)
    if acc.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, acc.num_processes)))
    tp_size = cfg.tp_size if isinstance(cfg, TrainConfig) else 1  # PPO refuses tp_size
    pp_size = cfg.pp_size if hasattr(cfg, "pp_size") else 1  # pretraining's setting
    compiling = hasattr(cfg, "compile") and cfg.compile  # pretraining's setting
    # Settings that run over the plain or DDP accelerate configs only: (as set, how to turn it off).
    plain_only = [(f"{n}={v}", f"{n}=1") for n, v in (("tp_size", tp_size), ("pp_size", pp_size)) if v > 1]
    plain_only += [("compile=true", "compile=false")] if compiling else []
    if plain_only:
        from accelerate.utils import DistributedType

        if acc.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            setting, off = plain_only[0]
            raise ValueError(f"{setting} runs over the plain or DDP accelerate configs, not "
                             f"{acc.distributed_type.value}; drop accelerate_config or set {off}")
    if compiling:
        compiler = os.environ.get("CXX") or "g++"  # what torch's inductor builds CPU kernels with
        if acc.device.type == "cpu" and shutil.which(compiler) is None:
            raise ValueError(f"compile=true on the CPU builds C++ kernels with {compiler}, which this machine "
                             f"lacks; install it or set compile=false")
    if tp_size > 1:
        from crawl2chat.stages.training.parallel import check_tp_size, tp_mesh

        check_tp_size(tp_size, acc.num_processes)
        acc.tp_mesh = tp_mesh(tp_size, acc.num_processes, acc.device.type)
        acc.dp_shard = cfg.dp_shard
    if pp_size > 1:
        from crawl2chat.stages.training.pipeline import check_pp_size, pp_mesh

        check_pp_size(pp_size, acc.num_processes)
        acc.pp_mesh = pp_mesh(pp_size, acc.num_processes, acc.device.type)
    set_seed(cfg.seed)
    return acc


def _deepspeed_cpu_backend() -> str | None:
    """DeepSpeed's process-group backend (gloo, or ccl with oneCCL) when this process
    was launched for DeepSpeed on a machine where DeepSpeed runs on the CPU."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    ds = get_accelerator()
    if ds.device_name() != "cpu":
        return None
    # DeepSpeed compiles its shared-memory all-reduce when its communication starts (a
    # C++ build, minutes on 2 cores at first use); only inference_all_reduce uses it,
    # never training, so a training process does without (its compatibility table is
    # the switch DeepSpeed itself reads).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return ds.communication_backend_name()


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        accelerator,
        model: torch.nn.Module,
        out_dir: str | os.PathLike,
        batch_fn: BatchFn,
        loss_fn: LossFn,
        eval_batches_fn: EvalBatchesFn | None = None,
        flops_per_token: float | None = None,
        eval_extra: Callable[[float], dict[str, float]] | None = None,
        after_step: Callable[[], None] | None = None,
    ):
        self.cfg, self.acc = cfg, accelerator
        self.out = Path(out_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.batch_fn, self.loss_fn = batch_fn, loss_fn
        self.eval_batches_fn, self.eval_extra = eval_batches_fn, eval_extra
        self.after_step = after_step  # run after each optimizer step (e.g. a momentum encoder's update)
        self.flops_per_token = flops_per_token
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        tp_mesh, pp_mesh = getattr(accelerator, "tp_mesh", None), getattr(accelerator, "pp_mesh", None)
        self.tp_size = tp_mesh["tp"].size() if tp_mesh is not None else 1
        self.pp_size = pp_mesh["pp"].size() if pp_mesh is not None else 1
        # The data-parallel position that draws batches: every rank of a tensor-parallel
        # group or a pipeline must see the same batch (one group: one stream).
        group = self.tp_size * self.pp_size
        self.dp_world, self.dp_rank = self.world // group, self.rank // group
        self.mesh = tp_mesh if tp_mesh is not None else pp_mesh
        self.tokens_per_step = cfg.seq_len * cfg.micro_batch_size * cfg.grad_accum * self.dp_world

        # Split before the optimizer sees the parameters; prepared in evaluation mode below:
        # placement and mixed precision, no DDP wrap (the data-parallel gradient average,
        # when there are several groups, is train_step's).
        self.pipeline = None
        if tp_mesh is not None:
            from crawl2chat.stages.training.parallel import parallelize_decoder

            parallelize_decoder(model.to(accelerator.device), tp_mesh["tp"])
            if cfg.dp_shard:
                from crawl2chat.stages.training.parallel import shard_data_parallel

                shard_data_parallel(model, tp_mesh)
        if pp_mesh is not None:
            from crawl2chat.stages.training.pipeline import Pipeline

            self.pipeline = Pipeline(model, pp_mesh, accelerator.device, n_microbatches=cfg.grad_accum,
                                     schedule=cfg.pp_schedule, autocast=accelerator.autocast)
            from crawl2chat.stages.training.pipeline import stage_layers

            n = model.config.num_hidden_layers
            spans = " | ".join(f"{r.start}-{r.stop - 1}" for r in (stage_layers(n, self.pp_size, i)
                                                                  for i in range(self.pp_size)))
            accelerator.print(f"pipeline: {self.pp_size} stages (layers {spans}), {cfg.pp_schedule}, "
                              f"{cfg.grad_accum} micro-batches a step"
                              + (" (fewer micro-batches than stages: most stages idle; raise grad_accum)"
                                 if cfg.grad_accum < self.pp_size else ""))
        optimizer = build_optimizer(model, cfg, fused=can_fuse(accelerator, model))
        plugin = accelerator.state.deepspeed_plugin
        self.deepspeed = plugin is not None
        if self.deepspeed:
            # No DataLoader goes through prepare() for accelerate to read a batch size
            # from, and the engine accumulates and clips itself: it gets our numbers.
            plugin.deepspeed_config.update(
                train_micro_batch_size_per_gpu=cfg.micro_batch_size, gradient_accumulation_steps=cfg.grad_accum,
                train_batch_size=cfg.micro_batch_size * cfg.grad_accum * self.world, gradient_clipping=cfg.clip_norm)
            if accelerator.device.type == "cpu":
                # With no GPU the "offloaded" optimizer state is where it always was, in host
                # memory: our AdamW steps it there as DeepSpeed's CPU Adam would, without
                # building that C++ op at first use (minutes on 2 cores).
                plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False
            accelerator.gradient_accumulation_steps = cfg.grad_accum
        if self.mesh is not None:
            self.model = accelerator.prepare_model(model, evaluation_mode=True)
            self.optimizer = accelerator.prepare_optimizer(optimizer)
        else:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
        # The scheduler is stepped by hand once per optimizer step; accelerate's
        # wrapper would step it once per process. DeepSpeed's ZeRO optimizer is no
        # torch optimizer (the schedules read ``defaults``); the one inside it is
        # ours, with the same param groups.
        self.scheduler = build_scheduler(optimizer if self.deepspeed else self.optimizer, cfg)
        # Pretraining's ``compile``: the training step's forward and loss through torch.compile
        # (its backward is compiled with it). The model itself is not wrapped, so checkpoints,
        # saving and rollback see the same module; evaluation calls ``loss_fn`` uncompiled
        # (a second graph, for no-grad mode, would cost another compilation).
        self.compiled = hasattr(cfg, "compile") and cfg.compile
        self.train_loss_fn = torch.compile(loss_fn) if self.compiled else loss_fn
        self.state = TrainState()
        accelerator.register_for_checkpointing(self.scheduler, self.state)
        self.metrics = MetricsWriter(self.out / "metrics.jsonl", enabled=accelerator.is_main_process)
        self.peak_flops = cfg.peak_flops
        self.last_eval: dict[str, float] = {}

    # ------------------------------------------------------------ steps

    def forward_backward_step(self, batch_index: int) -> torch.Tensor:
        """All micro-batches of one global batch on this rank; returns the local mean loss."""
        if self.pipeline is not None:
            # The accumulated batch is the pipeline's: its micro-batches run through the stages.
            rows = torch.cat([self.batch_fn(batch_index, micro, self.dp_rank, self.dp_world)["tokens"]
                              for micro in range(self.cfg.grad_accum)])
            return self.pipeline.train_batch(rows, poison=batch_index in self.cfg.inject_nan_at_batches)
        total = torch.zeros((), device=self.acc.device)
        for micro in range(self.cfg.grad_accum):
            batch = {k: v.to(self.acc.device)
                     for k, v in self.batch_fn(batch_index, micro, self.dp_rank, self.dp_world).items()}
            last = micro == self.cfg.grad_accum - 1
            if self.deepspeed:
                # The engine divides the loss by its accumulation steps itself, and
                # reduces, clips and steps inside backward() on the boundary micro-batch.
                self.acc.sync_gradients = last
            # Gradients are all-reduced once, on the last micro-batch.
            with nullcontext() if last or self.deepspeed else self.acc.no_sync(self.model):
                loss, _ = self.train_loss_fn(self.model, batch)
                if batch_index in self.cfg.inject_nan_at_batches:
                    loss = loss * float("nan")
                self.acc.backward(loss if self.deepspeed else loss / self.cfg.grad_accum)
            total += loss.detach() / self.cfg.grad_accum
        return total

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; returns its metrics, or None when it was rolled back."""
        t0 = time.perf_counter()
        batch_index = self.state.batch_index
        self.model.train()
        local_loss = self.forward_backward_step(batch_index)
        if self.pipeline is not None:
            self.pipeline.sum_tied_gradients()
        # Under dp_shard, FSDP has reduce-scattered the gradients over dp already.
        if self.mesh is not None and not self.cfg.dp_shard:
            from crawl2chat.stages.training.parallel import all_reduce_data_parallel

            all_reduce_data_parallel(self.acc.unwrap_model(self.model), self.mesh)
        loss = self.acc.reduce(local_loss, reduction="mean").item()
        grad_norm = self.clip_grad_norm()

        reason = self._instability(loss, grad_norm)
        if reason:
            self.rollback(reason, batch_index, loss, grad_norm)
            return None

        # Under DeepSpeed the step has already been taken (a rollback reloads the
        # checkpoint all the same) and optimizer.step() is a no-op; the lr it used is
        # still the current one, as the scheduler steps only below.
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.after_step is not None:
            self.after_step()
        s = self.state
        s.step += 1
        s.batch_index += 1
        s.tokens_seen += self.tokens_per_step
        s.recent_losses = (s.recent_losses + [loss])[-self.cfg.rollback.spike_window:]
        dt = time.perf_counter() - t0
        tps = self.tokens_per_step / dt
        rec = {"type": "step", "step": s.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_second": tps, "tokens": s.tokens_seen, "step_time": dt}
        if self.flops_per_token and self.peak_flops:
            rec["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.world)
        return rec

    def clip_grad_norm(self) -> float:
        """Clip to ``clip_norm`` and return the global norm before clipping."""
        max_norm = self.cfg.clip_norm if self.cfg.clip_norm > 0 else float("inf")
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm(self.model.parameters(), max_norm)
        if self.cfg.dp_shard:
            from crawl2chat.stages.training.parallel import clip_grad_norm

            return clip_grad_norm(self.model.parameters(), max_norm)
        norm = clip_by_global_norm(self.acc, self.model.parameters(), max_norm)
        if norm is None and self.deepspeed:
            # Older accelerate returns nothing under DeepSpeed; the engine clipped
            # during its step and kept the norm.
            norm = self.model.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def _instability(self, loss: float, grad_norm: float) -> str | None:
        if not math.isfinite(loss):
            return "non-finite loss"
        # With fp16 the gradient scaler owns overflowing gradients (it skips the step).
        if not math.isfinite(grad_norm) and self.acc.mixed_precision != "fp16":
            return "non-finite gradient norm"
        rb, recent = self.cfg.rollback, self.state.recent_losses
        if rb.spike_factor > 0 and len(recent) >= rb.spike_window:
            mean = sum(recent) / len(recent)
            if loss > rb.spike_factor * mean:
                return f"loss spike {loss:.4g} > {rb.spike_factor} x recent mean {mean:.4g}"
        return None

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        return save_checkpoint(self.acc, self.ckpt_root, self.state.step, self.cfg.keep_checkpoints)

    def _load(self, path: Path) -> None:
        self.acc.load_state(str(path))
        self._apply_lr_scale()

    def _apply_lr_scale(self) -> None:
        """Base learning rates follow the rollback scale; the current lr is recomputed from them."""
        apply_lr_scale(self.scheduler, self.optimizer, self.cfg.lr * self.state.lr_scale)

    def _report(self, message: str) -> None:
        self.acc.print(message)
        self.metrics.write({"type": "event", "event": "damaged_checkpoint", "message": message})

    def _read_rollback_record(self) -> dict[str, Any] | None:
        return read_rollback_record(self.ckpt_root, self.acc.print)

    def _write_rollback_record(self, record: dict[str, Any]) -> None:
        """The rollback's outcome, on disk before training goes on: a run killed before
        its next checkpoint resumes with the lowered lr and past the bad batch."""
        if self.acc.is_main_process:
            write_rollback_record(self.ckpt_root, record)

    def _discard(self, names: Iterable[str]) -> None:
        """Checkpoints a rollback fell back past: renamed aside (by the main process)."""
        if self.acc.is_main_process:
            discard_checkpoints(self.ckpt_root, names)

    def _apply_rollback_record(self, record: dict[str, Any]) -> None:
        s = self.state
        s.rollbacks, s.lr_scale = record["rollbacks"], record["lr_scale"]
        s.consecutive_rollbacks, s.failed_step = record["consecutive_rollbacks"], record["failed_step"]
        s.batch_index = record["batch_index"]
        self._apply_lr_scale()

    def resume(self) -> bool:
        """Load the newest checkpoint under ``OUT/checkpoints`` that passes its checksums,
        if any; a rollback recorded after that checkpoint (``rollback.json``) is applied
        again (lr scale, rollback counts, data position past the bad batch)."""
        record = self._read_rollback_record()
        discarded = set(record.get("discard", [])) if record else set()
        if discarded:  # a rollback killed between its record and the discarding
            self._discard(discarded)
            self._write_rollback_record({**record, "discard": []})
        candidates = good_checkpoints(self.ckpt_root, exclude=discarded, main=self.acc.is_main_process,
                                      report=self._report)
        self.acc.wait_for_everyone()
        if not candidates:
            return False
        path = candidates[0]
        self._load(path)
        event = {"type": "event", "event": "resume", "step": self.state.step, "checkpoint": path.name}
        if record and self.state.step <= record["step"]:
            self._apply_rollback_record(record)
            event.update(rollbacks=self.state.rollbacks, lr_scale=self.state.lr_scale,
                         batch_index=self.state.batch_index)
        self.metrics.write(event)
        self.acc.print(f"resumed from {path} at step {self.state.step}"
                       + (f" (after rollback {self.state.rollbacks}: lr x{self.state.lr_scale:.3g}, "
                          f"batch {self.state.batch_index})" if "lr_scale" in event else ""))
        return True

    def rollback(self, reason: str, batch_index: int, loss: float, grad_norm: float) -> None:
        """Back to a good checkpoint with a lower learning rate, past the offending batch.

        Failures in a row (no step past the furthest failed one in between) count
        towards ``max_rollbacks``; the n-th in a row goes n-1 checkpoints further
        back than the newest, discarding the ones it passes, so a checkpoint that
        keeps failing is left behind. The outcome is written to
        ``OUT/checkpoints/rollback.json`` at once."""
        self.optimizer.zero_grad(set_to_none=True)
        s = self.state
        failed_step = s.step + 1
        consecutive, furthest = rollback_plan(s.step, s.consecutive_rollbacks, s.failed_step)
        rollbacks = s.rollbacks + 1
        lr_scale = s.lr_scale * self.cfg.rollback.lr_factor
        event = {"type": "event", "event": "rollback", "step": failed_step, "batch_index": batch_index,
                 "reason": reason, "loss": loss if math.isfinite(loss) else None,
                 "grad_norm": grad_norm if math.isfinite(grad_norm) else None, "rollbacks": rollbacks,
                 "consecutive_rollbacks": consecutive}
        if consecutive > self.cfg.rollback.max_rollbacks:
            self.metrics.write({**event, "event": "diverged"})
            raise TrainingDiverged(
                f"training diverged at step {failed_step} ({reason}) after {consecutive - 1} rollbacks in a row "
                f"(rollback.max_rollbacks={self.cfg.rollback.max_rollbacks}); lower lr or inspect the data "
                f"around batch {batch_index}")
        candidates = good_checkpoints(self.ckpt_root, main=self.acc.is_main_process, report=self._report)
        if not candidates:
            raise RuntimeError(f"no intact checkpoint under {self.ckpt_root} to roll back to")
        back = min(consecutive - 1, len(candidates) - 1)
        path, passed = candidates[back], [p.name for p in candidates[:back]]
        self.acc.load_state(str(path))
        # Counters that must survive the reload: the rollback itself, and the data
        # position, which moves past the offending batch instead of replaying it.
        record = {"checkpoint": path.name, "step": self.state.step, "batch_index": batch_index + 1,
                  "lr_scale": lr_scale, "rollbacks": rollbacks, "consecutive_rollbacks": consecutive,
                  "failed_step": furthest, "discard": passed, "reason": reason}
        self.acc.wait_for_everyone()
        self._write_rollback_record(record)
        if passed:
            # Discarded, then forgotten: a checkpoint saved later under the same name is a new one.
            self._discard(passed)
            self._write_rollback_record({**record, "discard": []})
        self.acc.wait_for_everyone()
        self._apply_rollback_record(record)
        event.update(checkpoint=path.name, resumed_step=self.state.step, lr_scale=lr_scale,
                     discarded=passed)
        self.metrics.write(event)
        self.acc.print(f"rollback {rollbacks} ({consecutive} in a row): {reason} at step {failed_step}; back to "
                       f"{path.name}{f' past {passed}' if passed else ''}, lr x{lr_scale:.3g}, "
                       f"skipping to batch {self.state.batch_index}")

    # ------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.eval_batches_fn is None:
            return {}
        self.model.eval()
        loss_sum = torch.zeros((), device=self.acc.device, dtype=torch.float64)
        count = torch.zeros((), device=self.acc.device, dtype=torch.float64)
        for batch in self.eval_batches_fn(self.dp_rank, self.dp_world):
            batch = {k: v.to(self.acc.device) for k, v in batch.items()}
            if self.pipeline is not None:
                loss, n = self.pipeline.eval_batch(batch["tokens"])
            else:
                loss, n = self.loss_fn(self.model, batch)
            loss_sum += loss.double() * n
            count += n
        loss_sum, count = self.acc.reduce(loss_sum, "sum"), self.acc.reduce(count, "sum")
        if count.item() == 0:
            # Nothing held out to score (an empty split, or eval_batches=0): no figure, not a NaN or a 0.
            return {}
        val_loss = (loss_sum / count).item()
        out = {"val_loss": val_loss, **(self.eval_extra(val_loss) if self.eval_extra else {})}
        self.metrics.write({"type": "eval", "step": self.state.step, **out})
        self.last_eval = out
        return out

    # ------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        """Train to ``max_steps`` (resuming if a checkpoint exists); returns a summary."""
        cfg = self.cfg
        if self.peak_flops is None and self.flops_per_token:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.acc.mixed_precision, torch.float32)
            self.peak_flops = measure_peak_flops(self.acc.device, dtype, seconds=0.3)
        if not self.resume():
            # Step 0 checkpoint: the first rollback needs something to return to.
            self.save_checkpoint()
            self.metrics.write({"type": "event", "event": "start", "step": 0, "world_size": self.world,
                                "tp_size": self.tp_size, "pp_size": self.pp_size,
                                "tokens_per_step": self.tokens_per_step, "peak_flops": self.peak_flops,
                                "grad_checkpointing": is_checkpointing(self.acc.unwrap_model(self.model)),
                                "compile": self.compiled})
        if self.compiled:
            self.acc.print("compile: the first step compiles the training step (torch.compile; tens of seconds "
                           "on a CPU unless torch's compile cache holds it)")
        t_start, tokens_start, step_times = time.perf_counter(), self.state.tokens_seen, []
        while self.state.step < cfg.max_steps:
            rec = self.train_step()
            if rec is None:
                continue
            step_times.append(rec["step_time"])
            step = self.state.step
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                self.metrics.write(rec)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                self.evaluate()
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
                self.save_checkpoint()
        final_eval = self.evaluate()
        wall = time.perf_counter() - t_start
        # Steady-state throughput: median step time, so start-up and evaluation
        # pauses do not count against it.
        med = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
        tps = self.tokens_per_step / med if step_times else float("nan")
        summary = {"steps": self.state.step, "tokens": self.state.tokens_seen, "tokens_per_second": tps,
                   "wall_seconds": wall, "tokens_this_run": self.state.tokens_seen - tokens_start,
                   "rollbacks": self.state.rollbacks, "world_size": self.world, "tp_size": self.tp_size,
                   "pp_size": self.pp_size,
                   "threads_per_process": torch.get_num_threads(), "device": str(self.acc.device),
                   "compile": self.compiled,
                   # The first step of this process: with compile, the compilation's time.
                   "first_step_seconds": step_times[0] if step_times else float("nan"),
                   "final_train_loss": self.state.recent_losses[-1] if self.state.recent_losses else None,
                   **final_eval}
        if self.flops_per_token and self.peak_flops:
            if cfg.peak_flops is None:
                # Measured again now: at the start other work may have shared the machine (MFU
                # above 1 against a peak measured then); the higher of the two is the peak.
                dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.acc.mixed_precision, torch.float32)
                self.peak_flops = max(self.peak_flops, measure_peak_flops(self.acc.device, dtype, seconds=0.3))
            summary["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.world)
            summary["peak_flops_per_device"] = self.peak_flops
            summary["flops_per_token"] = self.flops_per_token
        summary["peak_memory_mb"] = peak_memory_mb(self.acc.device)
        # A figure that could not be measured (no step ran in this process) is left out, never NaN.
        return {k: v for k, v in summary.items() if not (isinstance(v, float) and not math.isfinite(v))}
