"""Decoder-only model presets, built from ``transformers`` config classes.

Models are Llama-architecture (RMSNorm, rotary positions, SwiGLU, grouped
query attention where set) and always start from random weights: nothing is
downloaded. Because the model *is* a ``LlamaForCausalLM``, the checkpoint the
training stage saves is loadable by ``AutoModelForCausalLM.from_pretrained``
and by every runtime that speaks the Hugging Face format.

Presets scale from a test-sized model that trains in seconds on a laptop CPU
to 1B for GPUs. Parallelisation (DDP, FSDP) is not the model's business; the
accelerate configs under ``infra/accelerate/`` choose it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# name -> (layers, width, heads, kv_heads, ffn width, tie embeddings)
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: ~0.1M params with a 512-token vocabulary.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=192, tie_word_embeddings=True),
    # nanoGPT's Tiny Shakespeare CPU setting: 4 layers, 128 wide, 4 heads (~0.8M + embeddings).
    "cpu-small": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=384, tie_word_embeddings=True),
    # A few million parameters: the largest that trains usefully on a CPU.
    "cpu": dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                intermediate_size=768, tie_word_embeddings=True),
    # GPT-2 small shape (124M with a 50k vocabulary).
    "124m": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=2048, tie_word_embeddings=True),
    # TinyLlama shape (1.1B with a 32k vocabulary).
    "1b": dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, tie_word_embeddings=False),
}


def is_causal_lm(architectures: list[str]) -> bool:
    """Whether a model folder's recorded architectures include a causal language model
    (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...): what generation and bits per byte need."""
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)


def model_folder_problem(folder: str | Path, kind: str = "causal") -> str | None:
    """None for a folder a stage or command can load as its input model; otherwise what is
    wrong, in words naming the folder or file: not a model folder, a file damaged since it
    was written (``checksums.json``), or not of the ``kind`` the reader needs: ``causal``
    (a causal language model: an encoder would be read with a random or masked-LM head),
    ``reward`` (a sequence classifier with its score head: a causal LM would be read with a
    random head), ``encoder`` (a BERT encoder, what contrastive learning starts from), ``any``."""
    import json

    from crawl2chat.stages.checksums import folder_damage

    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder} does not exist" if not folder.exists() else f"{folder} is a file, not a model folder"
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        return f"{folder} is not a model folder (no config.json)"
    except (OSError, ValueError) as e:
        return f"{folder / 'config.json'} is unreadable ({type(e).__name__})"
    damage = folder_damage(folder)
    if damage:
        return damage
    architectures = config.get("architectures") or []
    named = ", ".join(architectures) or "not recorded"
    if kind == "reward" and not any(a.endswith("ForSequenceClassification") for a in architectures):
        return f"{folder} is not a reward model (its architecture is {named}; crawl2chat reward trains one)"
    if kind == "causal" and not is_causal_lm(architectures):
        return (f"{folder} is not a causal language model (its architecture is {named}; crawl2chat pretrain, "
                "sft, ppo, dpo and distill train one)")
    if kind == "encoder" and not any(a.startswith("Bert") and not a.endswith("LMHeadModel") for a in architectures):
        return f"{folder} is not a BERT encoder (its architecture is {named}; crawl2chat mlm trains one)"
    return None


def model_config(preset: str, vocab_size: int, seq_len: int, pad_token_id: int | None = None,
                 eos_token_id: int | None = None, **overrides: Any):
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    kw = dict(PRESETS[preset])
    kw.update(overrides)
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_dropout=0.0,
        initializer_range=0.02,
        pad_token_id=pad_token_id,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        use_cache=True,
        **kw,
    )


def build_model(config, grad_checkpointing: bool = False, attn_implementation: str = "sdpa"):
    """A freshly initialised causal LM for ``config``.

    The class is instantiated directly rather than through ``from_config``: under
    DeepSpeed ZeRO-3, ``from_config`` builds inside ``deepspeed.zero.Init``, whose
    partitioned initialisation draws different weights, so the same seed would give a
    different model with ZeRO-3 than without it (here it gives the same one)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config._attn_implementation = attn_implementation
    model = AutoModelForCausalLM._model_mapping[type(config)](config)
    if grad_checkpointing:
        enable_grad_checkpointing(model)
    return model


def enable_grad_checkpointing(model):
    """Recompute each decoder layer's activations in the backward pass (any Hugging Face
    model: a causal LM, or a sequence classifier such as the reward model); returns it."""
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    model.config.use_cache = False
    return model


def is_checkpointing(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def num_params(model, non_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if non_embedding:
        n -= model.get_input_embeddings().weight.numel()
    return n


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x the parameters a
    token passes through (weights incl. the output projection) plus causal
    attention, 6 * layers * seq_len * width (PaLM appendix B, halved for the
    causal mask). Used for model-FLOPs utilisation."""
    L, d, f, V = config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f  # q,o + k,v + gate,up,down
    matmul_params = L * per_layer + d * V
    return 6.0 * matmul_params + 6.0 * L * seq_len * d
