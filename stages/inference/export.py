"""Export a model folder for serving engines, with optional int8 measurements.

A training stage's model folder is already in the Hugging Face layout;
:func:`export_model` copies it and adds what serving engines (transformers
pipelines, vLLM, TGI, llama.cpp converters) read besides the weights:

* ``generation_config.json`` — stop tokens (``<|endoftext|>`` and the chat
  turn end ``<|end|>``), padding, default sampling;
* the chat template in ``tokenizer_config.json`` and ``chat_template.jinja``.

It then reloads the copy with ``transformers`` alone and checks that it
produces the same logits as the source, that the chat template renders and
that ``generate`` stops where the generation config says.

With ``quantize="int8"`` it also measures dynamic int8 quantisation of the
linear layers against fp32 on this CPU — prefill latency, decode tokens/s and,
given held-out data, bits per byte — reports them side by side, and records
``{"quantize": "int8"}`` in ``serving.json`` so that ``crawl2chat serve`` on
the exported folder quantises at load time. The weights stay fp32
safetensors; no quantised checkpoint is written.

With ``compile_check`` it measures ``torch.compile`` against eager decoding
and records ``"compile": true`` in ``serving.json`` only when compiled
decoding is measurably faster (it is not, for these small models on CPU:
the growing KV cache recompiles and the compiled step is slower than eager).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from crawl2chat.stages.inference.generation import (SERVING_FILE, ModelUnreadable, SamplingParams, load_model,
                                          quantize_int8, stop_token_ids, stream_tokens)
from crawl2chat.stages.checksums import CHECKSUMS, write_checksums
from crawl2chat.stages.file_modes import publish_modes
from crawl2chat.stages.fault_points import kill_point
from crawl2chat.stages.locks import hold_folder
from crawl2chat.stages.training.tokenizer import CHAT_TEMPLATE

REPORT = "export_report.json"
PROBE = "The river runs past the old stone bridge, and the town wakes up."


def write_generation_config(model_dir: Path, tokenizer, max_new_tokens: int = 256) -> dict:
    from transformers import GenerationConfig

    stops = sorted(stop_token_ids(tokenizer))
    gc = GenerationConfig(eos_token_id=stops if len(stops) > 1 else stops[0], pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.eos_token_id, do_sample=True, temperature=0.8, top_p=0.95,
                          max_new_tokens=max_new_tokens)
    gc.save_pretrained(str(model_dir))
    return gc.to_dict()


def ensure_chat_template(model_dir: Path) -> str:
    """The chat template stored both in ``tokenizer_config.json`` and ``chat_template.jinja``."""
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = model_dir / "chat_template.jinja"
    template = cfg.get("chat_template") or (jinja.read_text() if jinja.exists() else CHAT_TEMPLATE)
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja.write_text(template)
    return template


@torch.inference_mode()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def check_reload(src_dir: Path, out_dir: Path, atol: float = 1e-5) -> dict:
    """Reload ``out_dir`` with ``transformers`` alone and compare it with ``src_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        src = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 - a truncated or missing file, in the library's words
        raise ModelUnreadable.because(src_dir, e) from e
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    ids = tok(PROBE, return_tensors="pt", add_special_tokens=False)["input_ids"]
    diff = float((_logits(src, ids) - _logits(model, ids)).abs().max())
    if diff > atol:
        raise RuntimeError(f"the exported model's logits differ from the source's by {diff:.3g} (> {atol})")
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    gc = GenerationConfig.from_pretrained(str(out_dir))
    out = model.generate(ids, generation_config=gc, do_sample=False, max_new_tokens=8)
    return {"max_abs_logit_diff": diff, "chat_prompt": chat, "generate_ok": out.shape[1] > ids.shape[1],
            "eos_token_id": gc.eos_token_id}


def measure_speed(model, tokenizer, prompt_tokens: int = 64, new_tokens: int = 32, repeats: int = 3) -> dict:
    """Prefill latency and KV-cache decode speed (median of ``repeats``) on this machine."""
    ids = (tokenizer(PROBE * 20, add_special_tokens=False)["input_ids"] * 4)[:prompt_tokens]
    ctx = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    ids = ids[: max(1, min(prompt_tokens, ctx - new_tokens))]
    x = torch.tensor([ids])
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    prefill, decode = [], []
    with torch.inference_mode():
        _logits(model, x)  # warm-up (and, for a compiled model, compilation)
        sum(1 for _ in stream_tokens(model, ids, params))
        for _ in range(repeats):
            t0 = time.perf_counter()
            _logits(model, x)
            prefill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n = sum(1 for _ in stream_tokens(model, ids, params))  # no stop ids: always new_tokens
            decode.append(n / (time.perf_counter() - t0))
    return {"prefill_ms": 1000 * statistics.median(prefill), "decode_tokens_per_s": statistics.median(decode),
            "prompt_tokens": len(ids), "new_tokens": new_tokens}


def compare_int8(model_dir: str | os.PathLike, data=None, max_tokens: int = 50_000) -> dict:
    """fp32 and dynamic-int8 side by side: speed, and bits per byte given ``data``."""
    from crawl2chat.stages.inference.evaluate import evaluate_lm, eval_texts, held_out_texts

    model, tok = load_model(model_dir)
    q = quantize_int8(load_model(model_dir)[0])
    res = {"fp32": measure_speed(model, tok), "int8": measure_speed(q, tok)}
    ids = tok(PROBE, return_tensors="pt", add_special_tokens=False)["input_ids"]
    lp32, lp8 = torch.log_softmax(_logits(model, ids), -1), torch.log_softmax(_logits(q, ids), -1)
    res["probe_kl"] = float((lp32.exp() * (lp32 - lp8)).sum(-1).mean())
    res["probe_top1_agreement"] = float((lp32.argmax(-1) == lp8.argmax(-1)).float().mean())
    if data is not None:
        if isinstance(data, (str, os.PathLike)):  # the model's held-out split, as every evaluation reads
            texts, res["split"] = held_out_texts(model_dir, data, "model", max_docs=2000)
        else:
            texts, res["split"] = eval_texts(data, max_docs=2000), "given"
        res["fp32"]["bpb"] = evaluate_lm((model, tok), texts, max_tokens=max_tokens)["bpb"]
        res["int8"]["bpb"] = evaluate_lm((q, tok), texts, max_tokens=max_tokens)["bpb"]
        res["bpb_change"] = res["int8"]["bpb"] - res["fp32"]["bpb"]
    res["decode_speedup"] = res["int8"]["decode_tokens_per_s"] / res["fp32"]["decode_tokens_per_s"]
    res["prefill_speedup"] = res["fp32"]["prefill_ms"] / res["int8"]["prefill_ms"]
    return res


def measure_compile(model_dir: str | os.PathLike, min_speedup: float = 1.1, new_tokens: int = 32) -> dict:
    """Eager against ``torch.compile`` (dynamic shapes) for KV-cache decoding;
    ``kept`` only when compiled decoding is at least ``min_speedup`` x faster."""
    model, tok = load_model(model_dir)
    eager = measure_speed(model, tok, new_tokens=new_tokens, repeats=2)
    t0 = time.perf_counter()
    model.forward = torch.compile(model.forward, dynamic=True)
    try:
        compiled = measure_speed(model, tok, new_tokens=new_tokens, repeats=2)
    except Exception as e:  # noqa: BLE001 - a backend that cannot compile here is a measured "no"
        return {"eager": eager, "error": f"{type(e).__name__}: {e}"[:500], "kept": False}
    speedup = compiled["decode_tokens_per_s"] / eager["decode_tokens_per_s"]
    return {"eager": eager, "compiled": compiled, "compile_and_measure_s": time.perf_counter() - t0,
            "decode_speedup": speedup, "kept": speedup >= min_speedup}


def export_model(model_dir: str | os.PathLike, out_dir: str | os.PathLike, quantize: str | None = None,
                 data=None, max_new_tokens: int = 256, compile_check: bool = False) -> dict:
    """Copy ``model_dir`` to ``out_dir`` ready for serving engines, verify the
    reload, and (``quantize="int8"``) measure int8 against fp32. Returns the
    report, also written to ``out_dir/export_report.json``. ``out_dir`` is held
    for the export (a second export into it is refused naming the holder's pid)
    and gets ``checksums.json`` for its files last."""
    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src} is not a model folder (no config.json)")
    with hold_folder(out):  # one export at a time into a folder
        _restore_swapped_out(out)
        if problem := _target_problem(src, out):
            raise FileExistsError(problem)
        return _export(src, out, quantize, data, max_new_tokens, compile_check)


def _target_problem(src: Path, out: Path) -> str | None:
    """Why ``out`` may not be replaced by an export: only a new or empty folder, an earlier
    export (its report) or the model folder itself (the files are added there) may be."""
    if not out.exists() or out.resolve() == src.resolve():
        return None
    if not out.is_dir():
        return f"{out} is a file; --out takes a new folder, an empty one or an earlier export"
    if (out / REPORT).exists() or not any(out.iterdir()):
        return None
    return (f"{out} holds files that are not an earlier export (no {REPORT}), which an export would replace; "
            f"choose a new folder for --out")


def _restore_swapped_out(out: Path) -> None:
    """Put back the previous export a killed export had moved aside to swap its own in
    (``.NAME.tmp-old-PID``), when nothing took its place."""
    for old in sorted(out.parent.glob(f".{out.name}.tmp-old-*")):
        if not out.exists() and (old / REPORT).exists():
            os.replace(old, out)


def _export(src: Path, out: Path, quantize: str | None, data, max_new_tokens: int, compile_check: bool) -> dict:
    """Into a separate ``out``: built in a temporary sibling folder and swapped into place
    whole, so a killed export leaves the previous export (if any) untouched and the rerun
    starts afresh; in place (``out`` is the model folder), the files are added there."""
    if out.resolve() == src.resolve():
        return _build(src, out, quantize, data, max_new_tokens, compile_check)
    for leftover in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed export (we hold the lock)
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(REPORT, SERVING_FILE, CHECKSUMS))
    publish_modes(tmp)  # a model saved owner-only by safetensors is served by other accounts too
    try:
        report = _build(src, tmp, quantize, data, max_new_tokens, compile_check, final=out)
        kill_point("export:built")
        old = out.parent / f".{out.name}.tmp-old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _build(src: Path, out: Path, quantize: str | None, data, max_new_tokens: int, compile_check: bool,
           final: Path | None = None) -> dict:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - a missing or damaged tokenizer file, in the library's words
        raise ModelUnreadable.because(src, e) from e
    report: dict = {"source": str(src.resolve()), "out": str((final or out).resolve())}
    report["generation_config"] = write_generation_config(out, tok, max_new_tokens)
    ensure_chat_template(out)
    report["reload"] = check_reload(src, out)
    serving = {"quantize": "none"}
    if quantize and quantize != "none":
        if quantize != "int8":
            raise ValueError(f"unsupported quantisation {quantize!r}; use int8")
        report["int8"] = compare_int8(out, data)
        serving["quantize"] = "int8"
    if compile_check:
        report["compile"] = measure_compile(out)
        serving["compile"] = report["compile"]["kept"]
    (out / SERVING_FILE).write_text(json.dumps(serving, indent=2) + "\n")
    report["serving"] = serving
    (out / REPORT).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    write_checksums(out)
    return report
