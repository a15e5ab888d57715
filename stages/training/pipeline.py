"""Pipeline parallelism of the Llama decoder, kept apart from the model (as torchtitan's
pipelining step is): the decoder layers are split into ``pp_size`` contiguous stages,
one per process of a pipeline group; the first stage also holds the token embedding,
the last the final norm and the output head. Training runs PyTorch's own schedules
(``torch.distributed.pipelining``: GPipe or 1F1B) over the trainer's accumulation
micro-batches, so a pipeline step sees exactly the rows a one-process step does.

* **Splitting** (:func:`prune_to_stage`): every rank builds the whole model from the
  same seed (the weights equal a one-process run's) and then drops what is not its
  stage's, leaving ``None`` in place of the dropped modules so parameter names stay the
  whole model's (``model.layers.3.mlp.up_proj.weight`` on whichever rank holds layer 3):
  checkpoints, optimizer state and the gathered Hugging Face folder need no renaming.
* **Tied embeddings** (every preset but ``1b``): the input embedding lives on the first
  stage and the output head, the same matrix, on the last; their two gradient parts
  are summed between those two ranks after the backward pass (as Megatron does), so
  both copies take the same optimizer step and stay equal. The gradient norm counts
  the matrix once.
* **Evaluation** runs a plain forward pass from stage to stage with point-to-point sends
  written here: the schedules fix each micro-batch's shape at their first step, while
  held-out batches vary in size.

Imports no Prefect or MLflow.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

SCHEDULES = ("gpipe", "1f1b")


def check_pp_size(pp_size: int, world: int, config: Any | None = None) -> None:
    """Refuse a ``pp_size`` the layout or the model cannot be split by, naming the number."""
    if pp_size < 1:
        raise ValueError(f"pp_size must be at least 1 (got {pp_size})")
    if world % pp_size:
        raise ValueError(f"pp_size={pp_size} must divide the number of processes ({world}); "
                         f"launch with --num-processes a multiple of {pp_size}")
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and layers < pp_size:
        raise ValueError(f"pp_size={pp_size} is more stages than the model's {layers} layers; "
                         f"choose pp_size <= {layers}")


def pp_mesh(pp_size: int, world: int, device_type: str):
    """The 2-D mesh ``(dp, pp)`` over every process: consecutive ranks form a pipeline
    (rank // pp_size is the data-parallel index, the batch stream a pipeline draws)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // pp_size, pp_size), mesh_dim_names=("dp", "pp"))


def stage_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """The decoder layers of ``stage``: contiguous, sizes differing by at most one, the
    larger ones first (the last stage also carries the output head)."""
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def prune_to_stage(model: torch.nn.Module, stage: int, pp_size: int) -> range:
    """Drop from ``model`` (a ``LlamaForCausalLM``-style decoder) every module outside
    ``stage``, in place; returns the layers kept."""
    body = model.model
    keep = stage_layers(len(body.layers), pp_size, stage)
    for i in range(len(body.layers)):
        if i not in keep:
            body.layers._modules[str(i)] = None
    if stage != 0:
        body.embed_tokens = None
    if stage != pp_size - 1:
        body.norm = None
        model.lm_head = None
    return keep


class DecoderStage(torch.nn.Module):
    """One stage's forward: token ids (first stage) or hidden states in, hidden states or
    logits (last stage) out; rotary positions and the causal mask are recomputed on each
    stage from the sequence length, as the whole model computes them once."""

    def __init__(self, model: torch.nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.model, self.first, self.last = model, first, last
        self.layer_ids = list(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        body = self.model.model
        h = body.embed_tokens(x) if self.first else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=body.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        rotary = body.rotary_emb(h, position_ids=position_ids)
        for i in self.layer_ids:
            h = body.layers[i](h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return self.model.lm_head(body.norm(h)) if self.last else h


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class Pipeline:
    """This rank's stage of a pipeline over ``mesh["pp"]`` and the schedule that drives it.

    ``n_microbatches`` is the trainer's ``grad_accum``: a training step hands the whole
    accumulated batch to the schedule, which runs its micro-batches through the stages
    and averages their gradients (``scale_grads``), as the one-process loop does."""

    def __init__(self, model: torch.nn.Module, mesh, device: torch.device, n_microbatches: int,
                 schedule: str = "1f1b", autocast: Callable[[], AbstractContextManager] = nullcontext):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {SCHEDULES} (got {schedule!r})")
        pp = mesh["pp"]
        self.size, self.index = pp.size(), pp.get_local_rank()
        self.group = pp.get_group()
        self.first, self.last = self.index == 0, self.index == self.size - 1
        self.ranks = [dist.get_global_rank(self.group, i) for i in range(self.size)]
        check_pp_size(self.size, self.size, model.config)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.tied_group = self._tied_group(mesh) if self.tied else None
        layers = prune_to_stage(model, self.index, self.size)
        self.module = DecoderStage(model.to(device), layers, self.first, self.last)
        self.device, self.autocast = device, autocast
        self.poisoned = False  # the next training batch's loss made NaN (rollback drills)
        stage = PipelineStage(self.module, self.index, self.size, device, group=self.group)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.schedule = cls(stage, n_microbatches, loss_fn=self._loss, scale_grads=True)

    def _tied_group(self, mesh):
        """The (first, last) stage pair of each pipeline, one process group each (created
        by every rank, in the same order, as process groups must be)."""
        if self.size == 2:
            return self.group
        mine = None
        pp, dp = self.size, mesh["dp"].size()
        for j in range(dp):
            ranks = [int(mesh.mesh[j, 0]), int(mesh.mesh[j, pp - 1])]
            g = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = g
        return mine

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = next_token_loss(logits, targets)
        return loss * float("nan") if self.poisoned else loss

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        dist.broadcast(value, src=self.ranks[-1], group=self.group)
        return value

    def train_batch(self, tokens: torch.Tensor, poison: bool = False) -> torch.Tensor:
        """Forward and backward over ``tokens`` (the accumulated batch, ``seq_len + 1``
        columns); returns the mean loss of its micro-batches on every stage."""
        x, y = tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)
        self.poisoned = poison
        losses: list[torch.Tensor] = []
        with self.autocast():
            if self.first:
                self.schedule.step(x, return_outputs=False)
            elif self.last:
                self.schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        loss = torch.stack([l.detach().float() for l in losses]).mean() if self.last \
            else torch.zeros((), device=self.device)
        return self._from_last(loss)

    def sum_tied_gradients(self) -> None:
        """Add the output head's gradient part to the embedding's and back (the same matrix)."""
        if self.tied_group is None or not (self.first or self.last):
            return
        w = self.module.model.model.embed_tokens.weight if self.first else self.module.model.lm_head.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=self.tied_group)

    def clip_grad_norm(self, parameters, max_norm: float) -> float:
        """Clip by the norm of the whole model's gradient (every stage's, the tied matrix once)."""
        params = [p for p in parameters if p.grad is not None]
        counted = params
        if self.tied and self.last and not self.first:
            head = self.module.model.lm_head.weight
            counted = [p for p in params if p is not head]
        grads = [p.grad for p in counted]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.device)
        total_sq = local.double().pow(2)
        dist.all_reduce(total_sq, group=self.group)
        total = total_sq.sqrt().to(local.dtype)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    @torch.no_grad()
    def eval_batch(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean next-token loss of ``tokens`` through every stage (a forward pass only);
        the same value on every stage."""
        x, y = tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)
        with self.autocast():
            if self.first:
                h = self.module(x)
            else:
                shape = torch.empty(3, dtype=torch.int64)
                dist.recv(shape, src=self.ranks[self.index - 1], group=self.group)
                h = torch.empty(*shape.tolist(), dtype=torch.float32, device=self.device)
                dist.recv(h, src=self.ranks[self.index - 1], group=self.group)
                h = self.module(h)
            if not self.last:
                dist.send(torch.tensor(h.shape, dtype=torch.int64), dst=self.ranks[self.index + 1], group=self.group)
                dist.send(h.float().contiguous(), dst=self.ranks[self.index + 1], group=self.group)
                loss = torch.zeros((), device=self.device)
            else:
                loss = next_token_loss(h, y)
        return self._from_last(loss.float()), y.numel()


def gather_state_dict(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor] | None:
    """Every stage's tensors in one state dict on global rank 0 (None elsewhere): the
    first pipeline's stages each send theirs (a collective: call on every rank)."""
    mine = {k: v.detach().cpu() for k, v in model.state_dict().items()} if mesh["dp"].get_local_rank() == 0 else {}
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return None
    whole: dict[str, torch.Tensor] = {}
    for part in parts:
        whole.update(part)
    return whole


def whole_model(config, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A complete model of ``config`` holding ``state_dict`` (built without touching the
    training's random state), for saving the gathered stages as one Hugging Face folder."""
    from crawl2chat.stages.training.models import build_model

    with torch.random.fork_rng(devices=[]):
        model = build_model(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"the gathered stages do not make a whole model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model
