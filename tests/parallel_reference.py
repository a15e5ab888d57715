"""What every model-parallel test compares with, built once per session (the
``parallel_reference`` fixture in ``conftest.py``): a small corpus, its tokenizer, and a
1-process pretraining run of 20 steps (tiny preset, constant learning rate after warmup,
so a run stopped early and resumed, or a shorter run, follows the same schedule)."""

from __future__ import annotations

from pathlib import Path

from test_pretrain import BASE, corpus_text

COMMON = [*BASE, "schedule=constant", "checkpoint_every=10", "eval_every=0", "grad_accum=1"]
STEPS = 20


def train(shared: dict, name: str, *extra: str, num_processes: int = 1, max_steps: int = STEPS) -> Path:
    from crawl2chat.tasks.train import launch_training

    out = shared["root"] / name
    launch_training("pretrain", {"data": str(shared["corpus"])}, str(out), max_steps=max_steps,
                    num_processes=num_processes, overrides=[*COMMON, f"tokenizer={shared['tok']}", *extra])
    return out


def build(root: Path) -> dict:
    from crawl2chat.stages.training.pretrain import prepare_data
    from crawl2chat.stages.training.settings import PretrainConfig

    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text(3000))
    tok_dir, _ = prepare_data(PretrainConfig(vocab_size=320, val_fraction=0.1), corpus, root / "prep")
    shared = {"root": root, "corpus": corpus, "tok": tok_dir}
    shared["single"] = train(shared, "single")  # 4 sequences a step, one process
    return shared


def assert_same_weights(out: Path, single: Path, atol: float) -> dict:
    """``out``'s saved model holds every tensor of the reference's, same shapes, within ``atol``;
    returns ``out``'s tensors."""
    import torch
    from safetensors.torch import load_file

    want, have = load_file(single / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert want.keys() == have.keys()
    for k in want:
        assert have[k].shape == want[k].shape, k
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=atol, msg=k)
    return have


def load_and_score_like(out: Path, single: Path):
    """``out``'s Hugging Face folder, loaded in one process, gives the reference's logits
    (within 1e-3) on a few tokens; returns the loaded model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokens = torch.tensor([[3, 17, 40, 5, 9, 100]])
    with torch.no_grad():
        ref_model = AutoModelForCausalLM.from_pretrained(single / "model")
        torch.testing.assert_close(model(tokens).logits, ref_model(tokens).logits, rtol=0, atol=1e-3)
    return model
