"""Text generation shared by serving, the terminal chat, export checks and evaluation.

* :func:`load_model` opens a model folder (Hugging Face layout) for inference,
  optionally with dynamic int8 quantisation of every ``nn.Linear`` (weights
  stored as int8, activations quantised on the fly; CPU only). Quantisation
  happens at load time from the fp32 ``model.safetensors``: no quantised
  checkpoint is ever written.
* :func:`stream_tokens` is the decoding loop: one forward pass over the prompt
  fills the KV cache, then one token per step reuses it. Sampling uses the
  ``transformers`` logits warpers (temperature, top-k, top-p); temperature 0
  is greedy. Decoding stops at ``<|endoftext|>``, at the chat turn end
  ``<|end|>``, at a stop string or at ``max_new_tokens``.
* :class:`TextStream` turns that token stream into text deltas that never
  split a UTF-8 character, which is what the HTTP server streams.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from crawl2chat.stages.inference.kv_decoder import KVDecoder
from crawl2chat.stages.training.tokenizer import END_TURN_TOKEN, EOS_TOKEN

QUANTIZE_CHOICES = ("none", "int8")
SERVING_FILE = "serving.json"  # written by export: defaults for serving this folder
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed, as in the OpenAI API


# ---------------------------------------------------------------- loading


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantisation of the linear layers (CPU inference only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


class ModelUnreadable(ValueError):
    """A model folder whose files cannot be loaded; the message is one sentence naming it."""

    @classmethod
    def because(cls, model_dir: str | os.PathLike, error: BaseException) -> "ModelUnreadable":
        said = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return cls(f"{model_dir} could not be loaded ({type(error).__name__}: {said}); export or train it again")


def serving_defaults(model_dir: str | os.PathLike) -> dict:
    """The folder's serving settings (``serving.json``, written by export), checked."""
    path = Path(model_dir) / SERVING_FILE
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelUnreadable(f"{path} is not readable JSON ({e})") from e
    if not isinstance(found, dict):
        raise ModelUnreadable(f"{path} holds no settings object")
    if str(found.get("quantize", "none")).lower() not in QUANTIZE_CHOICES:
        raise ModelUnreadable(f"{path}: quantize takes one of {', '.join(QUANTIZE_CHOICES)}, "
                              f"not {found['quantize']!r}")
    return found


# What :func:`load_model` imports for the project's (Llama) models: ~3 s on a small CPU, as
# transformers' model classes pull in torch._dynamo, torch.distributed.tensor and scipy. A caller
# that loads a model after other work can import these first, while that work runs.
MODEL_MODULES = ("transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
                 "transformers.models.llama.modeling_llama")


def load_model(model_dir: str | os.PathLike, quantize: str | None = None, device: str = "cpu"):
    """``(model, tokenizer)`` for inference from a model folder. ``quantize``:
    ``None``/``"none"`` or ``"int8"``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantize = (quantize or "none").lower()
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if quantize == "int8" and device != "cpu":
        raise ValueError("int8 dynamic quantisation runs on the CPU only")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - a truncated or missing file, in whichever library's words
        raise ModelUnreadable.because(model_dir, e) from e
    model.eval().to(device)
    model.config.use_cache = True
    if quantize == "int8":
        model = quantize_int8(model)
    return model, tokenizer


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))


def stop_token_ids(tokenizer) -> set[int]:
    """Token ids that end a generation: end of text and end of a chat turn."""
    ids = set()
    for tok in (EOS_TOKEN, END_TURN_TOKEN, tokenizer.eos_token):
        if tok is None:
            continue
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i >= 0:
            ids.add(i)
    return ids


# ---------------------------------------------------------------- decoding


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be tokenized (a lone UTF-16 surrogate, which JSON's ``\\ud800``
    escapes and undecodable terminal bytes produce), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode text: a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}"
    return None


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: Sequence[str] = ()
    seed: int | None = None
    # Scores of tokens already in the prompt or the answer are divided by this
    # (multiplied when negative), as in Hugging Face generate: small models
    # decoded greedily otherwise loop on one phrase. 1.0 = off.
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 5.0:
            raise ValueError("temperature must be in [0, 5]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 1.0 <= self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in [1, 2]")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")


def _warpers(p: SamplingParams):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    procs = LogitsProcessorList()
    if p.temperature > 0 and p.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(TopPLogitsWarper(p.top_p))
    return procs


@torch.inference_mode()
def stream_tokens(model, prompt_ids: Sequence[int], params: SamplingParams,
                  stop_ids: set[int] | frozenset = frozenset()) -> Iterator[int]:
    """Generated token ids, one at a time, with a KV cache. A stop token ends
    the stream and is not yielded."""
    params.validate()
    device = next(model.parameters(), torch.empty(0)).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(params.seed)
    warpers = _warpers(params)
    penalty = None
    if params.repetition_penalty != 1.0:
        from transformers import RepetitionPenaltyLogitsProcessor

        penalty = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    seen = ids
    decoder = KVDecoder(model, ids.shape[1] + params.max_new_tokens)
    logits = decoder.prefill(ids)
    for n in range(params.max_new_tokens):
        scores = logits.float()
        if penalty is not None:
            scores = penalty(seen, scores)
        if params.temperature == 0:
            nxt = int(scores.argmax(-1))
        else:
            scores = warpers(ids, scores)  # these warpers look at the scores only
            probs = torch.softmax(scores, dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        if nxt in stop_ids:
            return
        yield nxt
        if n == params.max_new_tokens - 1:
            return
        step = torch.tensor([nxt], dtype=torch.long, device=device)
        if penalty is not None:
            seen = torch.cat([seen, step[None]], dim=1)
        logits = decoder.step(step, torch.tensor([[ids.shape[1] + n]], device=device))


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token (padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def all_finite(scores: torch.Tensor) -> bool:
    """Whether every score is finite: their sum first, which an inf or NaN anywhere makes
    non-finite (one pass and no boolean tensor: 30 us against 119 us for ``isfinite(...)
    .all()`` over a PPO step's 8 x 6k scores); element by element only when the sum is
    not finite (an overflow alone can make it so)."""
    return bool(torch.isfinite(scores.sum())) or bool(torch.isfinite(scores).all())


class NonFiniteLogits(RuntimeError):
    """A forward pass gave inf or NaN scores, so no token can be drawn."""


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` (rows need not sum exactly to one), by inverse CDF: one
    uniform number a row. ``torch.multinomial`` draws an exponential number per vocabulary
    entry instead (8 x 6k of them a token at PPO's rollout size: 1.3 ms a call, 5% of a
    PPO run on a 1.6M-parameter policy)."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * cdf[:, -1:]
    # right=True: the first entry whose cumulative mass exceeds u, so a zero-probability
    # entry (flat CDF) is never drawn.
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


@torch.no_grad()
def sample_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float, eos_id: int, pad_id: int,
                 everyone_done: Callable[[bool], bool] = bool, with_logprobs: bool = False):
    """Sampled continuations of a batch of left-padded prompts: ``(batch, prompt + new)``
    token ids, where a row that has drawn ``eos_id`` continues with ``pad_id``; stops
    early once every row has ended. Temperature only (no top-k/top-p): what PPO's
    rollouts draw from, so that the log-probabilities it trains on are the sampling ones.
    ``with_logprobs``: also each drawn token's log-probability under the distribution it
    was drawn from, ``(batch, new)`` (a padding token's is meaningless), as a pair.

    ``everyone_done(ended_here)``: whether every process's rows have ended. With several
    processes it must be a collective: where a forward pass is one (FSDP gathers each
    layer's weights from every process), a process that stopped alone would leave the
    others waiting; so a process whose rows have ended steps on, drawing padding, until
    all have (``generate``'s ``synced_gpus``). Default: this process's rows alone.

    Written out rather than ``model.generate``: this loop of one cached step and one draw
    per token (:class:`KVDecoder`) takes ~0.09-0.11 s where ``generate`` takes ~0.18 s at
    PPO's rollout size (8 prompts, 24 tokens, a 1.6M-parameter policy), its per-step
    machinery (logits processors, stopping criteria, cache bookkeeping) costing as much as
    the model.
    Raises :class:`NonFiniteLogits` when a step's scores were not finite, once every
    process has stopped (the process steps on until then, drawing from uniform scores)."""
    batch = input_ids.shape[0]
    mask = attention_mask.long()
    pos = positions(mask)
    decoder = KVDecoder(model, input_ids.shape[1] + max_new_tokens)
    logits = decoder.prefill(input_ids, mask, pos)
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    new, logps, failed = [], [], False
    for n in range(max_new_tokens):
        scores = logits.float()
        if not all_finite(scores):
            failed, scores = True, torch.zeros_like(scores)
        logp = torch.log_softmax(scores if temperature == 1.0 else scores / temperature, -1)
        tok = draw(logp.exp())
        if with_logprobs:
            logps.append(logp.gather(-1, tok[:, None])[:, 0])
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        new.append(tok)
        done |= tok == eos_id
        if everyone_done(bool(done.all()) or failed) or n == max_new_tokens - 1:
            break
        pos = pos[:, -1:] + 1
        logits = decoder.step(tok, pos)
    if failed:
        raise NonFiniteLogits("non-finite scores while sampling")
    ids = torch.cat([input_ids, torch.stack(new, 1)], 1)
    return (ids, torch.stack(logps, 1)) if with_logprobs else ids


@dataclass
class TextStream:
    """Incremental detokenisation of a token stream with stop strings.

    ``deltas()`` yields text pieces; afterwards ``finish_reason`` is ``"stop"``
    (stop token or stop string) or ``"length"`` and ``completion_tokens`` the
    number of generated tokens."""

    tokenizer: object
    tokens: Iterator[int]
    max_new_tokens: int
    stop: Sequence[str] = ()
    completion_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    _ids: list[int] = field(default_factory=list)

    def deltas(self) -> Iterator[str]:
        emitted = 0
        hold = max((len(s) for s in self.stop), default=1) - 1
        for tok in self.tokens:
            self._ids.append(tok)
            self.completion_tokens += 1
            text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
                continue
            cut = _first_stop(text, self.stop)
            if cut is not None:
                self.text = text[:cut]
                if cut > emitted:
                    yield text[emitted:cut]
                self.finish_reason = "stop"
                self._close()
                return
            self.text = text
            safe = len(text) - hold  # a stop string may still be forming at the end
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        self.finish_reason = "length" if self.completion_tokens >= self.max_new_tokens else "stop"
        text = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        cut = _first_stop(text, self.stop)
        if cut is not None:
            text, self.finish_reason = text[:cut], "stop"
        self.text = text
        if len(self.text) > emitted:
            yield self.text[emitted:]

    def _close(self) -> None:
        close = getattr(self.tokens, "close", None)
        if close:
            close()


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stops if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


class Engine:
    """A loaded model and tokenizer with the prompt handling every front end
    shares (HTTP server, terminal chat, sample generations)."""

    def __init__(self, model_dir: str | os.PathLike, quantize: str | None = None, device: str = "cpu"):
        self.model_dir = str(model_dir)
        defaults = serving_defaults(model_dir)
        if quantize is None:
            quantize = defaults.get("quantize", "none")
        self.quantize = quantize
        self.model, self.tokenizer = load_model(model_dir, quantize=quantize, device=device)
        self.compiled = bool(defaults.get("compile", False))
        if self.compiled:  # export measured it faster than eager on this kind of machine
            self.model.forward = torch.compile(self.model.forward, dynamic=True)
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.max_context = context_length(self.model)
        self.lock = threading.Lock()  # calls that reconfigure a shared tokenizer take it
        # A fast tokenizer's Rust core encodes concurrently from many threads as
        # long as nothing reconfigures it (truncation, padding): requests then
        # tokenise in parallel instead of one after another.
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._backend = backend if backend is not None and backend.truncation is None \
            and backend.padding is None else None

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, text: str) -> list[int]:
        """A raw completion prompt as a document start: ``<|endoftext|>`` (what
        precedes every document in the packed pretraining data) then the text."""
        return [self.tokenizer.eos_token_id] + self.encode(text)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        # rendering the (compiled, cached) Jinja template reads shared state only
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_ids) + max_new_tokens
        if total > self.max_context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_new_tokens}) = {total} "
                             f"exceeds the model's context of {self.max_context} tokens")

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> TextStream:
        params.validate()
        self.check_length(prompt_ids, params.max_new_tokens)
        return TextStream(self.tokenizer, stream_tokens(self.model, prompt_ids, params, self.stop_ids),
                          params.max_new_tokens, stop=tuple(params.stop))

    def complete(self, prompt: str, params: SamplingParams) -> str:
        ts = self.stream(self.prompt_ids(prompt), params)
        return "".join(ts.deltas())

    def chat(self, messages: list[dict], params: SamplingParams) -> str:
        ts = self.stream(self.chat_prompt_ids(messages), params)
        return "".join(ts.deltas())


def init_model_dir(out_dir: str | os.PathLike, text_file: str | os.PathLike, preset: str = "tiny",
                   vocab_size: int = 320, seq_len: int = 256, seed: int = 0) -> Path:
    """A randomly initialised model folder (weights, config and a tokenizer
    trained on ``text_file``) in the same layout as a training stage's output;
    used by smoke tests and serving benchmarks."""
    from crawl2chat.stages.training.models import build_model, model_config
    from crawl2chat.stages.training.tokenizer import TOKENIZER_FILES, load_tokenizer, train_tokenizer

    out = Path(out_dir)
    tok_dir = out / "tokenizer.tmp"
    train_tokenizer(text_file, tok_dir, vocab_size=vocab_size)
    tok = load_tokenizer(tok_dir)
    torch.manual_seed(seed)
    cfg = model_config(preset, vocab_size=len(tok), seq_len=seq_len, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id)
    build_model(cfg).save_pretrained(out, safe_serialization=True)
    import shutil

    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy2(tok_dir / name, out / name)
    shutil.rmtree(tok_dir)
    return out
