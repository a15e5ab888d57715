"""Memory per GPU for the 124M, 1B and 7B shapes under the layouts the trainer can use.

Prints the README's memory plan. Per parameter, mixed-precision Adam holds 16 bytes
(bf16 weights 2 + bf16 gradients 2 + fp32 master weights 4 + Adam moments 8; Rajbhandari
et al., ZeRO, 2020): DDP keeps all of it on every GPU, ZeRO-2 / FSDP SHARD_GRAD_OP
shard gradients and optimizer state, ZeRO-3 / FSDP FULL_SHARD shard everything,
tensor parallelism divides the layers' weights (and their activations) by its degree,
and pipeline parallelism gives each stage 1/pp of the layers (under 1F1B the first stage
holds the activations of up to pp micro-batches of its layers: about one whole
micro-batch's worth).
Activations per transformer layer and token follow Korthikanti et al. (2022):
``h * (34 + 5 * heads * seq / h)`` bytes in bf16 without recomputation, ``2 * h`` with
full activation checkpointing (only each layer's input is kept).

    python benchmarks/memory_plan.py
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2 ** 30


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int

    @property
    def params(self) -> float:
        attn = 4 * self.hidden * self.hidden
        mlp = 3 * self.hidden * self.ffn  # gate, up, down (Llama)
        return self.layers * (attn + mlp) + self.vocab * self.hidden

    def activations(self, micro_batch: int, tp: int, recompute: bool) -> float:
        """Activation bytes of one micro-batch on one GPU."""
        per_token = 2 * self.hidden if recompute else self.hidden * (34 + 5 * self.heads * self.seq / self.hidden)
        return self.layers * micro_batch * self.seq * per_token / tp


SHAPES = (
    Shape("124m", 12, 768, 12, 2048, 50304, 1024),
    Shape("1b", 22, 2048, 32, 5632, 32000, 2048),
    Shape("7b", 32, 4096, 32, 11008, 32000, 4096),
)

# (GPUs, layout, the settings that select it, data-parallel degree, tensor-parallel degree,
#  pipeline stages, state sharding, recompute). Every layout here runs with these settings
# (nodes=8: over 8 machines of a Ray cluster).
CKPT = "grad_checkpointing=true"
LAYOUTS = {
    "124m": [(1, "single GPU", "(defaults)", 1, 1, 1, "none", False),
             (8, "DDP x8", "--num-processes 8", 8, 1, 1, "none", False),
             (64, "DDP x64 (8 nodes)", "num_processes=64, nodes=8", 64, 1, 1, "none", False)],
    "1b": [(1, "single GPU, checkpointing", CKPT, 1, 1, 1, "none", True),
           (8, "FSDP FULL_SHARD x8", "accelerate_config=fsdp", 8, 1, 1, "full", False),
           (8, "pipeline 2 x DDP 4 (1F1B)", "pp_size=2, grad_accum>=4", 4, 1, 2, "none", False),
           (64, "FSDP x64 (8 nodes)", "accelerate_config=fsdp, nodes=8", 64, 1, 1, "full", False)],
    "7b": [(1, "ZeRO-3 + CPU offload, checkpointing", f"accelerate_config=deepspeed_zero3_offload, {CKPT}",
            1, 1, 1, "offload", True),
           (8, "FSDP FULL_SHARD x8, checkpointing", f"accelerate_config=fsdp, {CKPT}", 8, 1, 1, "full", True),
           (8, "pipeline 8 (1F1B), checkpointing", f"pp_size=8, grad_accum>=16, {CKPT}", 1, 1, 8, "none", True),
           (64, "TP 8 inside a node x FSDP 8 across nodes", f"tp_size=8, dp_shard=true, nodes=8, {CKPT}",
            8, 8, 1, "full", True)],
}


def per_gpu(shape: Shape, dp: int, tp: int, sharding: str, recompute: bool, micro_batch: int = 1,
            pp: int = 1) -> dict:
    p = shape.params / tp / pp
    weights, grads, optim = 2 * p, 2 * p, 12 * p
    if sharding == "full":
        weights, grads, optim = weights / dp, grads / dp, optim / dp
    elif sharding == "offload":  # ZeRO-3 offload: master weights and moments in host memory
        optim = 0.0
    act = shape.activations(micro_batch, tp, recompute)
    return {"weights": weights, "grads": grads, "optim": optim, "act": act,
            "total": weights + grads + optim + act}


def table() -> str:
    rows = ["| model | params | GPUs | layout | settings | weights | grads | optimizer | activations (1 x seq) "
            "| total per GPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        for gpus, layout, settings, dp, tp, pp, sharding, recompute in LAYOUTS[shape.name]:
            m = per_gpu(shape, dp, tp, sharding, recompute, pp=pp)
            rows.append(f"| {shape.name} (seq {shape.seq}) | {shape.params / 1e9:.2f}B | {gpus} | {layout} | "
                        f"`{settings}` | "
                        + " | ".join(f"{m[k] / GiB:.1f} GiB" for k in ("weights", "grads", "optim", "act", "total"))
                        + " |")
    return "\n".join(rows)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
