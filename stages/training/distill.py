"""Knowledge distillation: a teacher's soft targets -> a smaller decoder.

Run under accelerate::

    accelerate launch -m crawl2chat.stages.training.distill --teacher runs/pretrain/model \\
        --data DIR_OR_TEXT_FILE --out OUT [--max-steps N] [--set preset=tiny --set alpha=0.5 ...]

The student (``preset``, smaller than the teacher) is built from scratch with the
teacher's tokenizer and trained on the teacher's data, packed with the teacher's
held-out split, by the shared :class:`~crawl2chat.stages.training.trainer.Trainer`
(checkpoints, exact resume, rollback). Its loss on a batch is::

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, next token)

(Hinton et al., 2015; the ``T^2`` keeps the soft term's gradients at the hard
term's scale). Validation scores the plain next-token loss, so bits per byte are
comparable across models. With ``compare_without_teacher`` the same student
(same seed, batches and steps) is first trained with ``alpha = 0`` into
``OUT/without_teacher``.

Outputs: ``OUT/model`` (``AutoModelForCausalLM`` loads it), ``OUT/metrics.json``:
``val_bpb`` of the student, ``teacher_val_bpb`` on the same held-out windows,
``without_teacher_val_bpb``, ``alpha``, ``temperature``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from crawl2chat.stages.training.heldout import read_split
from crawl2chat.stages.training.models import build_model, flops_per_token, model_config, num_params
from crawl2chat.stages.training.packing import INDEX, load_index, pack_shards
from crawl2chat.stages.training.pretrain import TokenWindows, causal_lm_loss
from crawl2chat.stages.training.settings import DistillConfig
from crawl2chat.stages.training.stage import (finished_summary, resolve, run_script, save_model, stage_parser,
                                              write_settings)
from crawl2chat.stages.training.tokenizer import load_tokenizer
from crawl2chat.stages.training.trainer import Trainer, make_accelerator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return stage_parser("distill", __doc__).parse_args(argv)


def prepare_data(cfg: DistillConfig, teacher: Path, data: str, out: Path) -> Path:
    """The data packed with the teacher's tokenizer and held-out split (once)."""
    data_dir = out / "data"
    if not (data_dir / INDEX).exists():
        split = read_split(teacher)
        pack_shards(data, teacher, data_dir, val_fraction=split.val_fraction if split else cfg.val_fraction)
    return data_dir


def prepare_on_host(argv: list[str]) -> None:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    prepare_data(resolve(DistillConfig, args), Path(args.teacher), args.data, Path(args.out))


def load_teacher(teacher: Path, cfg: DistillConfig, device):
    from transformers import AutoModelForCausalLM

    if not (teacher / "config.json").exists():
        raise ValueError(f"teacher: {teacher} is not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(teacher, torch_dtype=torch.float32)
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and context < cfg.seq_len:
        raise ValueError(f"seq_len: {cfg.seq_len} exceeds the teacher's context of {context} tokens")
    model.requires_grad_(False)
    return model.eval().to(device)


class DistillLoss:
    """The soft-target loss in training, the plain next-token loss in evaluation."""

    def __init__(self, teacher, alpha: float, temperature: float):
        self.teacher, self.alpha, self.T = teacher, alpha, temperature

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        if not model.training or self.alpha == 0:
            return causal_lm_loss(model, batch)
        tokens = batch["tokens"]
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = model(input_ids=x, use_cache=False).logits.float()
        with torch.no_grad():
            teacher = self.teacher(input_ids=x, use_cache=False).logits.float()
        V = logits.size(-1)
        hard = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        soft = F.kl_div(F.log_softmax(logits.reshape(-1, V) / self.T, -1),
                        F.log_softmax(teacher.reshape(-1, V) / self.T, -1), log_target=True,
                        reduction="batchmean") * self.T ** 2
        return self.alpha * soft + (1 - self.alpha) * hard, y.numel()


@torch.no_grad()
def teacher_val_loss(acc, teacher, windows: TokenWindows) -> float:
    """The teacher's next-token loss on the student's validation windows."""
    total = torch.zeros((), dtype=torch.float64, device=acc.device)
    count = torch.zeros((), dtype=torch.float64, device=acc.device)
    for batch in windows.eval_batches(acc.process_index, acc.num_processes):
        loss, n = causal_lm_loss(teacher, {k: v.to(acc.device) for k, v in batch.items()})
        total += loss.double() * n
        count += n
    total, count = acc.reduce(total, "sum"), acc.reduce(count, "sum")
    return (total / count).item() if count.item() else float("nan")


def train_student(cfg: DistillConfig, teacher_dir: Path, teacher, data_dir: Path, out: Path, alpha: float,
                  tokens_per_byte: float) -> dict:
    """One student run into ``out`` (resumable; a finished one is read back)."""
    done = finished_summary(out, cfg.max_steps)
    if done is not None:
        return done
    acc = make_accelerator(cfg)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(teacher_dir)
    mconf = model_config(cfg.preset, vocab_size=len(tokenizer), seq_len=cfg.seq_len,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(cfg.seed)  # the same initial student with and without the teacher
    student = build_model(mconf, grad_checkpointing=cfg.grad_checkpointing)
    windows = TokenWindows(data_dir, cfg)
    trainer = Trainer(cfg, acc, student, out, batch_fn=windows.batch,
                      loss_fn=DistillLoss(teacher, alpha, cfg.temperature), eval_batches_fn=windows.eval_batches,
                      flops_per_token=flops_per_token(mconf, cfg.seq_len),
                      eval_extra=lambda loss: {"val_bpb": loss * tokens_per_byte / math.log(2)})
    summary = trainer.fit()
    acc.wait_for_everyone()
    state_dict = acc.get_state_dict(trainer.model)
    if acc.is_main_process:
        save_model(acc.unwrap_model(trainer.model), state_dict, teacher_dir, out / "model")
        summary.update(alpha=alpha, preset=cfg.preset, params=num_params(student),
                       model_dir=str((out / "model").resolve()))
        (out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        trainer.metrics.write({"type": "event", "event": "done", **summary})
    trainer.metrics.close()
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = resolve(DistillConfig, args)
    out, teacher_dir = Path(args.out), Path(args.teacher)
    probe = make_accelerator(cfg)
    teacher = load_teacher(teacher_dir, cfg, probe.device)
    if probe.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_settings(cfg, out)
        prepare_data(cfg, teacher_dir, args.data, out)  # already done when prepare_on_host ran
    probe.wait_for_everyone()
    data_dir = out / "data"
    index = load_index(data_dir)
    tokens_per_byte = index["val"]["tokens"] / max(1, index["val"]["bytes"])
    probe.print(f"distilling {teacher_dir} ({num_params(teacher) / 1e6:.2f}M parameters) into a {cfg.preset} "
                f"student: alpha {cfg.alpha}, temperature {cfg.temperature}, "
                f"{index['train']['tokens']:,} training tokens")

    baseline = None
    # With alpha 0 the student learns from the data alone: it is its own comparison.
    if cfg.compare_without_teacher and cfg.alpha > 0:
        probe.print(f"first the same student without the teacher, for comparison ({cfg.max_steps} steps, "
                    f"-> {out / 'without_teacher' / 'model'}); then with it")
        baseline = train_student(cfg, teacher_dir, teacher, data_dir, out / "without_teacher", 0.0, tokens_per_byte)
    summary = train_student(cfg, teacher_dir, teacher, data_dir, out, cfg.alpha, tokens_per_byte)
    if cfg.compare_without_teacher and cfg.alpha == 0:
        baseline = summary
    windows = TokenWindows(data_dir, cfg)
    t_loss = teacher_val_loss(probe, teacher, windows)
    summary.update(temperature=cfg.temperature, teacher=str(teacher_dir.resolve()),
                   teacher_params=num_params(teacher), teacher_val_loss=t_loss,
                   teacher_val_bpb=t_loss * tokens_per_byte / math.log(2), data=str(Path(args.data).resolve()),
                   data_index=str((data_dir / INDEX).resolve()))
    if baseline is not None:
        summary.update(without_teacher_val_loss=baseline.get("val_loss"),
                       without_teacher_val_bpb=baseline.get("val_bpb"))
    if probe.is_main_process:
        (out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        probe.print(json.dumps(summary))
    probe.end_training()
    return summary


if __name__ == "__main__":
    run_script(main)
