"""Tensor parallelism of the Llama decoder, kept apart from the model (as torchtitan's
parallelize step is): :func:`parallelize_decoder` takes a built ``LlamaForCausalLM``
(or any Llama-body model with ``model.layers``) and shards its decoder layers over a
tensor-parallel :class:`~torch.distributed.device_mesh.DeviceMesh` with PyTorch's
DTensor ``parallelize_module``:

* attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank holds
  ``heads / tp`` query heads and ``kv_heads / tp`` key/value heads; the attention
  itself runs on the local heads), ``o_proj`` row-wise (its output is summed
  across the group);
* MLP: ``gate_proj`` and ``up_proj`` column-wise, ``down_proj`` row-wise.

Embeddings, norms and the output head stay ordinary tensors, replicated: every rank
of a tensor-parallel group computes them on the same batch, and the gradients that
reach them are already summed across the group by the column-wise layers' input
redistribution, so the replicas stay equal.

Checkpoint helpers: :func:`local_state` / :func:`load_local_state` (each rank's own
shards, for an exact resume on the same layout) and :func:`full_state_dict` (every
tensor gathered, for the Hugging Face folder). Imports no Prefect or MLflow.
"""

from __future__ import annotations

from typing import Any

import torch

# Names inside each decoder layer -> style (the Llama / Mistral / Qwen2 layout).
LAYER_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def check_tp_size(tp_size: int, world: int, config: Any | None = None) -> None:
    """Refuse a ``tp_size`` the layout or the model cannot be split by, naming the number."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1 (got {tp_size})")
    if world % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide the number of processes ({world}); "
                         f"launch with --num-processes a multiple of {tp_size}")
    if config is None:
        return
    bad = [f"{name}={getattr(config, name)}" for name in
           ("num_attention_heads", "num_key_value_heads", "intermediate_size")
           if getattr(config, name, None) is not None and getattr(config, name) % tp_size]
    if bad:
        raise ValueError(f"tp_size={tp_size} must divide the model's {', '.join(bad)}; "
                         "choose a tp_size that divides each of them")


def tp_mesh(tp_size: int, world: int, device_type: str):
    """The 2-D mesh ``(dp, tp)`` over every process: consecutive ranks form a tensor-parallel
    group (rank // tp_size is the data-parallel index, the batch stream a group draws)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def all_reduce_data_parallel(model: torch.nn.Module, mesh) -> None:
    """Average every gradient over the data-parallel dimension of ``mesh`` (one flat
    all-reduce; each rank's local shard with the same shards of the other groups)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    dp = mesh["dp"]
    if dp.size() == 1:
        return
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=dp.get_group())
    flat /= dp.size()
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


def shard_data_parallel(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP (PyTorch's ``fully_shard``) over the data-parallel dimension of the ``(dp, tp)``
    ``mesh``, on a model already split by :func:`parallelize_decoder`: each decoder layer
    and then the rest are sharded across the ``dp`` groups, so parameters, gradients and
    optimizer state are held once per data-parallel group, gathered layer by layer for
    the forward and backward passes, and gradients reduce-scattered (the 2-D layout of
    torchtitan). Returns the model, changed in place."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Clip by the global gradient norm when parameters live on different meshes (the
    tensor-parallel layers on ``(dp, tp)``, the rest on ``dp`` under FSDP x TP), which
    ``torch.nn.utils.clip_grad_norm_`` cannot combine: one norm per mesh, each made
    whole over its mesh, then added in squares. Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if not groups:
        return 0.0
    parts = []
    for mesh, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        parts.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double().cpu())
    total = float(torch.stack(parts).pow(2).sum().sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def decoder_layers(model: torch.nn.Module):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not all(all(_has(layer, name) for name in LAYER_PLAN) for layer in layers):
        raise ValueError(f"tensor parallelism needs a Llama-style decoder (model.layers with self_attn "
                         f"q/k/v/o_proj and mlp gate/up/down_proj); {type(model).__name__} has none")
    return layers


def _has(module: torch.nn.Module, dotted: str) -> bool:
    try:
        module.get_submodule(dotted)
        return True
    except AttributeError:
        return False


def parallelize_decoder(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Shard every decoder layer of ``model`` over the 1-D tensor-parallel ``mesh`` (in place); returns it.
    The model must already be on the mesh's device type."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tp_size(mesh.size(), mesh.size(), model.config)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder_layers(model):
        parallelize_module(layer, mesh, {name: styles[style]() for name, style in LAYER_PLAN.items()})
    return model


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s state dict whole, on the CPU (a collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in model.state_dict().items()}


def _unique(state: dict[str, torch.Tensor]):
    """(name, tensor) pairs with one name per storage (a tied head is its embedding)."""
    seen = set()
    for name, t in state.items():
        key = (_local(t).data_ptr(), _local(t).shape)
        if key in seen:
            continue
        seen.add(key)
        yield name, t


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's shards: the model's tensors (``model.<name>``) and the optimizer's state
    tensors (``optim.<param index>.<key>``) as plain local tensors, and the optimizer's
    non-tensor part (param groups, state keys) as plain data for JSON."""
    tensors = {f"model.{k}": _local(v).detach().contiguous().cpu()
               for k, v in _unique(model.state_dict(keep_vars=True))}
    sd = optimizer.state_dict()
    meta: dict[str, Any] = {"param_groups": sd["param_groups"], "state": {}}
    for idx, st in sd["state"].items():
        meta["state"][str(idx)] = {}
        for key, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{idx}.{key}"] = _local(v).detach().contiguous().cpu()
                meta["state"][str(idx)][key] = None
            else:
                meta["state"][str(idx)][key] = v
    return tensors, meta


def load_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Put back what :func:`local_state` wrote on this rank: the model's shards in place,
    and the optimizer's state with every tensor shaped like a sharded parameter made a
    DTensor of that parameter's layout again."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, t in _unique(model.state_dict(keep_vars=True)):
            key = f"model.{name}"
            if key not in tensors:
                raise ValueError(f"checkpoint shard has no {name}")
            local = _local(t)
            if tuple(tensors[key].shape) != tuple(local.shape):
                raise ValueError(f"checkpoint shard of {name} is {tuple(tensors[key].shape)}, the model's "
                                 f"{tuple(local.shape)}: written with another tensor-parallel layout")
            local.copy_(tensors[key])
    state = {int(idx): {k: (tensors[f"optim.{idx}.{k}"] if v is None else v) for k, v in st.items()}
             for idx, st in meta["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            st = optimizer.state.get(p, {})
            for k, v in list(st.items()):
                if torch.is_tensor(v) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.to_local().shape) \
                        and v.dim() > 0:
                    st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
