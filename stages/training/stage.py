"""What every training script does at its start and its end.

Each stage (:mod:`~crawl2chat.stages.training.pretrain`, ``sft``, ``reward``,
``dpo``, ``ppo``) is a script run under ``accelerate launch``. They share:

* the command line (:func:`stage_parser`): the stage's input flags, ``--out``,
  ``--config`` (YAML of the stage's settings), ``--max-steps`` and ``--set
  KEY=VALUE`` overrides read by :func:`crawl2chat.stages.settings.load_settings`;
* the opening (:func:`start_stage`): settings, the finished-run check, the
  accelerator, the output folder with its ``config.yaml`` and the starting model's
  tokenizer;
* the close (:func:`finish`): ``OUT/model`` in the Hugging Face layout written
  atomically (:func:`save_model`) and ``OUT/metrics.json``;
* the failure report (:func:`run_script`): a failing script writes
  ``OUT/failure.json`` naming the kind of failure, so whoever launched it decides
  from that, not from its log, whether a second attempt can help;
* its place in the process tree and the run folder (:func:`run_script`): the
  script dies with the process that launched it
  (:func:`crawl2chat.stages.lifetime.die_with_parent`), and rank 0 holds the run
  folder's lock (:mod:`crawl2chat.stages.locks`) for as long as it runs; a second
  writer exits with status 4 naming the holder's pid and writes nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from crawl2chat.stages.checksums import folder_damage, write_checksums
from crawl2chat.stages.file_modes import publish_modes
from crawl2chat.stages.lifetime import die_with_parent, exit_now
from crawl2chat.stages.locks import FolderBusy, acquire
from crawl2chat.stages.resources import exhaustion
from crawl2chat.stages.secrets import mask_secrets
from crawl2chat.stages.start_gate import wait_at_gate
from crawl2chat.stages.settings import SettingsError, load_settings, parse_overrides
from crawl2chat.stages.training.failures import (BAD_INPUT, BUSY, DIVERGED, EXHAUSTED, EXIT_CODES, FAILURE_FILE,
                                                  TRANSIENT)
from crawl2chat.stages.training.registry import STAGES
from crawl2chat.stages.training.tokenizer import TOKENIZER_FILES

if TYPE_CHECKING:
    from crawl2chat.stages.training.trainer import Trainer

def failure_kind(error: BaseException) -> str:
    # The trainer (torch) is imported where a script runs, not where a run is launched.
    from crawl2chat.stages.training.trainer import TrainingDiverged

    if isinstance(error, TrainingDiverged):
        return DIVERGED
    if exhaustion(error) is not None:
        return EXHAUSTED
    if isinstance(error, (SettingsError, ValueError, FileNotFoundError, KeyError, TypeError)):
        return BAD_INPUT
    return TRANSIENT


def _out_arg(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return None


def run_script(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> NoReturn:
    """Run a stage's ``main`` and end the process: on failure write ``OUT/failure.json``
    (kind, message), print the traceback and then one plain sentence, and exit with
    the kind's status (2: bad input, 3: diverged, 5: out of disk space, file size
    limit or memory, 1: transient). The process ends without the interpreter's
    teardown (:func:`crawl2chat.stages.lifetime.exit_now` says why)."""
    exit_now(_run_main(main, sys.argv[1:] if argv is None else argv))


def _run_main(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    """``main``'s exit status, its failure reported (see :func:`run_script`)."""
    die_with_parent()
    # A training process reports through OUT/metrics.jsonl; the launching task carries it
    # to MLflow. Libraries that probe for MLflow at import time (DeepSpeed's autotuner,
    # imported by Accelerate's unwrap in every save_pretrained) find it absent here,
    # which keeps ~2-3 s of imports off every launch.
    sys.modules.setdefault("mlflow", None)
    if not wait_at_gate():  # started before its data was ready, and the launcher gave up
        print("error: the launching process ended before this run's data was ready; nothing was written",
              file=sys.stderr, flush=True)
        return EXIT_CODES[TRANSIENT]
    out = _out_arg(argv)
    if out is not None and int(os.environ.get("RANK", "0")) == 0:
        try:
            # Held until the process exits: one writer per run folder.
            acquire(out)
        except FolderBusy as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_CODES[BUSY]
        (out / FAILURE_FILE).unlink(missing_ok=True)
    try:
        main(argv)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - every failure is reported, then returned as an exit status
        if isinstance(e, SystemExit):
            if e.code in (0, None):
                return 0
            kind, message = BAD_INPUT, f"invalid command line (exit status {e.code})"
        else:
            kind, message = failure_kind(e), str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if kind == EXHAUSTED:
                message = exhaustion(e, out)
            traceback.print_exc()
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / f".{FAILURE_FILE}.{os.getpid()}"
            try:
                tmp.write_text(json.dumps({"kind": kind, "error": type(e).__name__, "message": message}))
                os.replace(tmp, out / FAILURE_FILE)
            except OSError as write_error:  # a full disk may refuse even this small file
                tmp.unlink(missing_ok=True)
                print(f"error: could not write {out / FAILURE_FILE} ({write_error})", file=sys.stderr, flush=True)
        print(f"error: {message}", file=sys.stderr, flush=True)
        return EXIT_CODES[kind]
    return 0


def stage_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The command line of the stage ``name`` (its input flags from the registry)."""
    stage = STAGES[name]
    p = argparse.ArgumentParser(prog=stage.module, description=doc.split("\n\n")[0])
    for item in stage.inputs:
        p.add_argument(f"--{item.name}", required=True, help=item.help)
    p.add_argument("--out", required=True, help="run folder; re-running on it resumes")
    p.add_argument("--config", help="YAML file of the stage's settings")
    p.add_argument("--max-steps", type=int, help=stage.max_steps_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting (dotted for nested, e.g. rollback.max_rollbacks=2)")
    return p


def resolve(cls, args: argparse.Namespace):
    """The stage's settings: ``--config``, then ``--set`` overrides, then ``--max-steps``."""
    overrides = parse_overrides(args.overrides)
    if args.max_steps is not None:
        overrides["max_steps"] = args.max_steps
    return load_settings(cls, args.config, overrides)


def script_argv(inputs: dict[str, str], out: str | Path, config: str | None = None, max_steps: int | None = None,
                overrides: list[str] | None = None) -> list[str]:
    """A stage script's argv from its inputs and options (what a launcher passes)."""
    argv = [x for k, v in inputs.items() for x in (f"--{k}", str(v))] + ["--out", str(out)]
    if config:
        argv += ["--config", str(config)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    for o in overrides or []:
        argv += ["--set", o]
    return argv


@dataclass
class StageStart:
    """What every post-training script has once it is under way."""

    cfg: Any
    out: Path
    acc: Any
    tokenizer: Any
    pad_id: int


def start_stage(config_cls, args: argparse.Namespace, model_path: str) -> tuple[StageStart | None, dict | None]:
    """The common opening of the SFT, reward and DPO scripts: settings, the finished-run
    check (returns ``(None, summary)`` when the run is already done), the accelerator,
    the output folder and the tokenizer of the starting model."""
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.trainer import make_accelerator

    cfg = resolve(config_cls, args)
    out = Path(args.out)
    done = finished_summary(out, cfg.max_steps)
    if done is not None:
        print(f"{out} already finished {done['steps']} steps; model in {out / 'model'}")
        return None, done
    acc = make_accelerator(cfg)
    prepare_out(acc, cfg, out)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return StageStart(cfg, out, acc, tokenizer, pad_id), None


def write_settings(cfg, out: Path) -> None:
    """``OUT/config.yaml``: the settings the run trained with, credentials masked (a record, never read back)."""
    (out / "config.yaml").write_text(yaml.safe_dump(mask_secrets(cfg.model_dump(mode="json")), sort_keys=False))


def prepare_out(acc, cfg, out: Path) -> None:
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_settings(cfg, out)
    acc.wait_for_everyone()


def finish(acc, trainer: Trainer, tok_dir: Path, out: Path, summary: dict[str, Any],
           split: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save ``OUT/model`` (weights, config, tokenizer files, the held-out ``split`` the run
    made when it made one) and ``OUT/metrics.json``."""
    acc.wait_for_everyone()
    state_dict = acc.get_state_dict(trainer.model)
    if acc.is_main_process:
        if split:
            summary.update(split=split["name"], split_val_fraction=split["val_fraction"])
        save_model(acc.unwrap_model(trainer.model), state_dict, Path(tok_dir), out / "model", split=split)
        summary["model_dir"] = str((out / "model").resolve())
        (out / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        trainer.metrics.write({"type": "event", "event": "done", **summary})
        acc.print(json.dumps(summary))
    trainer.metrics.close()
    acc.end_training()
    return summary


def finished_summary(out: Path, max_steps: int) -> dict | None:
    """The summary of a run in ``out`` that already reached ``max_steps``, else None."""
    try:
        summary = json.loads((out / "metrics.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if summary.get("steps", 0) >= max_steps and (out / "model" / "config.json").exists():
        damage = model_damage(out / "model")
        if damage:
            print(f"{damage}: training the last steps again from the newest checkpoint", flush=True)
            return None
        return summary
    return None


def model_damage(model_dir: Path) -> str | None:
    """None for a model folder whose files match the checksums written with them,
    else a sentence naming the damaged file."""
    return folder_damage(model_dir)


def save_model(model, state_dict, tok_dir: Path, model_dir: Path, split: dict[str, Any] | None = None) -> None:
    """Weights, config and tokenizer side by side in the Hugging Face layout, with the
    held-out split (:mod:`~crawl2chat.stages.training.heldout`): ``split`` when given
    (pretraining), else the one recorded in ``tok_dir`` (the starting model's folder);
    ``checksums.json`` (sizes and sha256) is written last, before the folder is renamed in."""
    from crawl2chat.stages.training.heldout import SPLIT_FILE, write_split

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.use_cache = True
    if state_dict is not None and getattr(model.config, "tie_word_embeddings", False):
        # A gathered state dict (DeepSpeed) carries the tied head as a copy of its own;
        # the config re-ties it on load, so the file keeps one tensor.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy2(tok_dir / name, tmp / name)
    if split is not None:
        write_split(split, tmp)
    elif (tok_dir / SPLIT_FILE).exists():
        shutil.copy2(tok_dir / SPLIT_FILE, tmp / SPLIT_FILE)
    publish_modes(tmp)  # safetensors writes owner-only files
    write_checksums(tmp)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
