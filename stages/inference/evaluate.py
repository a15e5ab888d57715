"""Model evaluation: pure functions returning dicts, and a command line.

* :func:`evaluate_lm` — bits per byte and perplexity on held-out text. Bits
  per byte (total nats / (ln 2 x UTF-8 bytes)) does not depend on the
  tokenizer, so models with different vocabularies compare; perplexity is per
  token of the model's own tokenizer. Documents are joined as in packing
  (each followed by ``<|endoftext|>``, with one in front so the first token is
  predicted too) and scored with sliding windows of the model's context: every
  token is scored once, with at least ``context - stride`` tokens of history
  after the first window.
* :func:`make_mc_tasks` / :func:`multiple_choice_accuracy` — a HellaSwag-style
  benchmark built from held-out text, so it runs offline: a passage's opening
  is the context, its true continuation and continuations taken from other
  passages are the choices, and the model picks the choice with the highest
  log-likelihood (``acc``) or per-byte log-likelihood (``acc_norm``).
* :func:`question_accuracy` — questions a reference page answers (what a module is
  for, what a function does) as multiple choice: the page's own answer among
  answers to other questions, scored in the model's chat format.
* :func:`sample_generations` — a fixed set of prompts and each model's
  completions, logged as a table by the flows.
* :func:`reward_accuracy` — a reward model's held-out pairwise accuracy.
* :func:`win_rate` — a policy against its SFT parent as judged by the reward
  model, with the KL(policy || parent) on the policy's own samples.

Held-out text is what the model never trained on: a path given as data is read
through the split recorded with the model (:func:`held_out_texts`), and every
result names the split it used (``result["split"]``).

``python -m crawl2chat.stages.inference.evaluate --model DIR --data SHARDS_OR_TEXT [--split model|all] --out FILE.json``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from crawl2chat.stages.inference.generation import Engine, SamplingParams, load_model, stream_tokens
from crawl2chat.stages.training.tokenizer import iter_texts

DEFAULT_PROMPTS = [
    "The history of the city",
    "In this article we explain how",
    "Once upon a time",
    "The best way to learn a new language is",
    "Scientists have discovered",
    "Here is a simple recipe:",
]
DEFAULT_CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a neural network is in one sentence.",
    "Give me three tips for sleeping better.",
]


def eval_texts(data: str | os.PathLike | Sequence[str], max_docs: int | None = None) -> list[str]:
    """Documents from a shards folder, a text file, or a list of strings."""
    if isinstance(data, (str, os.PathLike)) and Path(data).exists():
        return list(iter_texts(data, max_docs=max_docs))
    if isinstance(data, str):
        raise FileNotFoundError(f"{data} does not exist")
    texts = [t for t in data if t]
    return texts[:max_docs] if max_docs else texts


def _model(model_or_dir, quantize: str | None = None):
    if isinstance(model_or_dir, (str, os.PathLike)):
        return load_model(model_or_dir, quantize=quantize)
    return model_or_dir  # an already loaded (model, tokenizer)


# ---------------------------------------------------------------- bits per byte


@torch.inference_mode()
def evaluate_lm(model_dir, data, context: int | None = None, stride: int | None = None,
                max_docs: int | None = None, max_tokens: int | None = None, batch_size: int = 8,
                quantize: str | None = None) -> dict:
    """Bits per byte and perplexity of a causal LM on held-out text.

    ``model_dir``: a model folder or a loaded ``(model, tokenizer)``; ``data``:
    shards folder, text file or list of documents. ``max_tokens`` caps the
    scored tokens (the byte count is then prorated by the tokens scored)."""
    model, tok = _model(model_dir, quantize)
    texts = eval_texts(data, max_docs)
    if not texts:
        raise ValueError("no held-out text to evaluate on")
    eos = tok.eos_token_id
    ids: list[int] = [eos]
    n_bytes = 0
    enc = tok(texts, add_special_tokens=False)["input_ids"]
    for t, e in zip(texts, enc):
        ids.extend(e)
        ids.append(eos)
        n_bytes += len(t.encode("utf-8"))
    n_predicted_total = len(ids) - 1
    if max_tokens is not None and n_predicted_total > max_tokens:
        ids = ids[:max_tokens + 1]
        n_bytes = n_bytes * max_tokens / n_predicted_total
    ctx = context or int(getattr(model.config, "max_position_embeddings", 1024))
    stride = stride or max(1, ctx // 2)
    if not 0 < stride <= ctx:
        raise ValueError("stride must be in (0, context]")
    seq = torch.tensor(ids, dtype=torch.long)
    # Window w covers seq[begin:end] and scores targets whose positions are in [scored_from, end).
    windows, scored = [], 1
    begin = 0
    while scored < len(seq):
        end = min(begin + ctx + 1, len(seq))
        windows.append((begin, end, scored))
        scored = end
        begin = max(0, end - 1 - (ctx - stride))
        if end == len(seq):
            break
    total_nats, total_tokens = 0.0, 0
    t0 = time.perf_counter()
    for i in range(0, len(windows), batch_size):
        group = windows[i:i + batch_size]
        width = max(e - b - 1 for b, e, _ in group)
        x = torch.full((len(group), width), eos, dtype=torch.long)
        y = torch.full((len(group), width), -100, dtype=torch.long)
        for r, (b, e, s) in enumerate(group):
            n = e - b - 1
            x[r, :n] = seq[b:e - 1]
            tgt = seq[b + 1:e].clone()
            tgt[: s - b - 1] = -100  # already scored by an earlier window
            y[r, :n] = tgt
        logits = model(input_ids=x, use_cache=False).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100, reduction="sum")
        total_nats += float(nll)
        total_tokens += int((y != -100).sum())
    return {
        "bpb": total_nats / (math.log(2) * n_bytes),
        "perplexity": math.exp(total_nats / total_tokens),
        "loss": total_nats / total_tokens,
        "tokens": total_tokens,
        "bytes": int(round(n_bytes)),
        "documents": len(texts),
        "seconds": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------- multiple choice


def _words(text: str) -> list[str]:
    return re.findall(r"\S+", text)


def make_mc_tasks(texts: Sequence[str], n: int = 100, seed: int = 0, n_choices: int = 4,
                  context_words: int = 24, ending_words: int = 12) -> list[dict]:
    """HellaSwag-style tasks from held-out text: ``{"context", "choices", "label"}``.

    The true ending is the passage's next ``ending_words`` words; the
    distractors are endings of the same length cut from other passages."""
    rng = random.Random(seed)
    span = context_words + ending_words
    passages = []
    for doc in texts:
        w = _words(doc)
        for start in range(0, len(w) - span + 1, span):
            passages.append(w[start:start + span])
    if len(passages) < n_choices:
        raise ValueError(f"held-out text yields {len(passages)} passages; need at least {n_choices}")
    rng.shuffle(passages)
    tasks = []
    for i, p in enumerate(passages[:n]):
        ctx, true_end = " ".join(p[:context_words]), " " + " ".join(p[context_words:])
        others = [j for j in range(len(passages)) if j != i]
        endings = {true_end}
        for j in rng.sample(others, len(others)):
            e = " " + " ".join(passages[j][context_words:])
            endings.add(e)
            if len(endings) == n_choices:
                break
        if len(endings) < n_choices:
            continue
        choices = sorted(endings - {true_end})
        label = rng.randrange(n_choices)
        choices.insert(label, true_end)
        tasks.append({"context": ctx, "choices": choices, "label": label})
    return tasks


@torch.inference_mode()
def continuation_logprobs(model, rows: Sequence[list[int]], starts: Sequence[int], pad_id: int) -> list[float]:
    """Summed log-probability of each row's tokens from ``starts[i]`` on, each predicted
    from the tokens before it, in one right-padded batch. A row longer than the model's
    context keeps its last tokens (the continuation being scored); a continuation cut
    that way is scored on the part left."""
    from crawl2chat.stages.training.chat_data import response_logprobs

    limit = int(getattr(model.config, "max_position_embeddings", 1 << 30))
    cut = [max(0, len(r) - limit) for r in rows]
    kept = [list(r[c:]) for r, c in zip(rows, cut)]
    width = max(len(r) for r in kept)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in kept])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in kept])
    scored = torch.zeros_like(ids)
    for i, (r, c, start) in enumerate(zip(kept, cut, starts)):
        scored[i, max(start - c, 1):len(r)] = 1
    return response_logprobs(model, ids, mask, scored).tolist()


def choice_logprobs(model, tok, context: str, choices: Sequence[str]) -> list[float]:
    """Sum of log-probabilities of each choice's tokens after ``context``."""
    ctx_ids = [tok.eos_token_id] + tok(context, add_special_tokens=False)["input_ids"]
    rows = [ctx_ids + tok(c, add_special_tokens=False)["input_ids"] for c in choices]
    return continuation_logprobs(model, rows, [len(ctx_ids)] * len(rows), tok.eos_token_id)


def multiple_choice_accuracy(model_dir, tasks: Sequence[dict], quantize: str | None = None) -> dict:
    """Accuracy on ``tasks`` by log-likelihood: ``acc`` (sum of log-probabilities)
    and ``acc_norm`` (divided by the choice's UTF-8 bytes), as in HellaSwag."""
    model, tok = _model(model_dir, quantize)
    if not tasks:
        raise ValueError("no tasks")
    correct = correct_norm = 0
    for t in tasks:
        lps = choice_logprobs(model, tok, t["context"], t["choices"])
        norm = [lp / max(1, len(c.encode("utf-8"))) for lp, c in zip(lps, t["choices"])]
        correct += int(max(range(len(lps)), key=lps.__getitem__) == t["label"])
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == t["label"])
    n = len(tasks)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n,
            "chance": sum(1 / len(t["choices"]) for t in tasks) / n}


def question_kind(question: str) -> str:
    """``module`` for "What is the X module for?", ``function`` for "What does X.f() do?",
    else ``other``: distractors are drawn from answers of the same kind."""
    if question.endswith(" module for?"):
        return "module"
    return "function" if question.startswith("What does ") else "other"


def question_accuracy(model_dir, rows: Sequence[dict], n_choices: int = 4, seed: int = 0) -> dict:
    """Reference questions as multiple choice: each row's ``reference`` (the page's own
    answer to its ``prompt``) among ``n_choices - 1`` answers to other questions of the
    same kind, each scored as the assistant's answer to the question in the model's chat
    format, end-of-turn marker included. ``acc`` picks by summed log-likelihood,
    ``acc_norm`` by log-likelihood per UTF-8 byte of the answer; ``chance`` is 1/n_choices.
    Rows with too few distinct answers of their kind to draw from are left out."""
    from crawl2chat.stages.training.chat_data import encode_prompt, encode_response, end_of_turn_id

    model, tok = _model(model_dir)
    eot = end_of_turn_id(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rng = random.Random(seed)
    correct = correct_norm = n = 0
    for i, row in enumerate(rows):
        kind = question_kind(row["prompt"])
        pool = list(dict.fromkeys(r["reference"] for j, r in enumerate(rows) if j != i
                                  and question_kind(r["prompt"]) == kind and r["reference"] != row["reference"]))
        if len(pool) < n_choices - 1:
            continue
        choices = rng.sample(pool, n_choices - 1)
        label = rng.randrange(n_choices)
        choices.insert(label, row["reference"])
        messages = [{"role": "user", "content": row["prompt"]}]
        prompt = encode_prompt(tok, messages)
        answers = [encode_response(tok, messages, c, eot) for c in choices]
        scores = continuation_logprobs(model, [prompt + a for a in answers], [len(prompt)] * n_choices, pad)
        norm = [v / max(1, len(c.encode("utf-8"))) for v, c in zip(scores, choices)]
        correct += int(max(range(n_choices), key=scores.__getitem__) == label)
        correct_norm += int(max(range(n_choices), key=norm.__getitem__) == label)
        n += 1
    if not n:
        return {"n": 0, "chance": 1 / n_choices}
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n, "chance": 1 / n_choices}


# ---------------------------------------------------------------- generations


def sample_generations(model_dir, prompts: Sequence[str] | None = None, chat: bool = False,
                       max_new_tokens: int = 48, temperature: float = 0.0, seed: int = 0,
                       quantize: str | None = None, repetition_penalty: float = 1.0) -> list[dict]:
    """Completions of a fixed prompt set: ``[{"prompt", "completion", "tokens"}]``.
    ``chat`` wraps each prompt as a user turn with the chat template."""
    engine = model_dir if isinstance(model_dir, Engine) else Engine(model_dir, quantize=quantize)
    prompts = list(prompts or (DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS))
    rows = []
    for p in prompts:
        ids = engine.chat_prompt_ids([{"role": "user", "content": p}]) if chat else engine.prompt_ids(p)
        # A prompt longer than the context keeps its last tokens (the question and
        # the assistant header) and leaves room for at least a quarter of the
        # context of answer.
        n = max(1, min(max_new_tokens, max(engine.max_context - len(ids), engine.max_context // 4)))
        truncated = len(ids) + n > engine.max_context
        if truncated:
            ids = ids[len(ids) + n - engine.max_context:]
        ts = engine.stream(ids, SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed,
                                               repetition_penalty=repetition_penalty))
        "".join(ts.deltas())
        rows.append({"prompt": p, "completion": ts.text, "tokens": ts.completion_tokens,
                     "prompt_truncated": truncated})
    return rows


# ---------------------------------------------------------------- reward model and policies


def _reward_text(tok, prompt: str, response: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                   tokenize=False)


@torch.inference_mode()
def reward_scores(rm, tok, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Scalar rewards of (prompt, response) pairs, formatted with the chat template."""
    out = []
    for p, r in zip(prompts, responses):
        ids = tok(_reward_text(tok, p, r), add_special_tokens=False, return_tensors="pt")["input_ids"]
        out.append(float(rm(input_ids=ids).logits.reshape(-1)[0]))
    return out


def load_reward_scorer(rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    rm = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32).eval()
    if rm.config.pad_token_id is None:
        rm.config.pad_token_id = tok.pad_token_id
    return rm, tok


def reward_accuracy(rm_dir, pairs: Sequence[dict]) -> dict:
    """Share of held-out pairs ``{"prompt", "chosen", "rejected"}`` where the
    reward model scores ``chosen`` above ``rejected``, and the mean margin."""
    rm, tok = load_reward_scorer(rm_dir) if isinstance(rm_dir, (str, os.PathLike)) else rm_dir
    if not pairs:
        raise ValueError("no pairs")
    prompts = [p.get("prompt", "") for p in pairs]
    chosen = reward_scores(rm, tok, prompts, [p["chosen"] for p in pairs])
    rejected = reward_scores(rm, tok, prompts, [p["rejected"] for p in pairs])
    margins = [c - r for c, r in zip(chosen, rejected)]
    return {"accuracy": sum(m > 0 for m in margins) / len(margins), "margin": sum(margins) / len(margins),
            "n": len(margins)}


@torch.inference_mode()
def sequence_logprob(model, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
    if not completion_ids:
        return 0.0
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
    tgt = ids[0, 1:]
    return float(lp[len(prompt_ids) - 1:].gather(-1, tgt[len(prompt_ids) - 1:, None]).sum())


def win_rate(policy_dir, parent_dir, rm_dir, prompts: Sequence[str], max_new_tokens: int = 48,
             temperature: float = 1.0, seed: int = 0) -> dict:
    """The policy's win rate against its parent (ties count half) under the
    reward model, on chat-formatted ``prompts``, and the Monte-Carlo estimate
    of KL(policy || parent) in nats per completion from the policy's samples."""
    policy, parent = Engine(policy_dir), Engine(parent_dir)
    rm, rm_tok = load_reward_scorer(rm_dir) if isinstance(rm_dir, (str, os.PathLike)) else rm_dir
    if not prompts:
        raise ValueError("no prompts")
    wins, kls, r_pol, r_par = 0.0, [], [], []
    for i, p in enumerate(prompts):
        msgs = [{"role": "user", "content": p}]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        ids_pol = policy.chat_prompt_ids(msgs)
        gen_pol = list(stream_tokens(policy.model, ids_pol, params, policy.stop_ids))
        ids_par = parent.chat_prompt_ids(msgs)
        gen_par = list(stream_tokens(parent.model, ids_par, params, parent.stop_ids))
        text_pol = policy.tokenizer.decode(gen_pol, skip_special_tokens=True)
        text_par = parent.tokenizer.decode(gen_par, skip_special_tokens=True)
        a, b = reward_scores(rm, rm_tok, [p, p], [text_pol, text_par])
        wins += 1.0 if a > b else 0.5 if a == b else 0.0
        r_pol.append(a)
        r_par.append(b)
        if policy.tokenizer.get_vocab() == parent.tokenizer.get_vocab():
            kls.append(sequence_logprob(policy.model, ids_pol, gen_pol) - sequence_logprob(parent.model, ids_pol, gen_pol))
    n = len(prompts)
    return {"win_rate": wins / n, "kl": sum(kls) / len(kls) if kls else float("nan"),
            "policy_reward": sum(r_pol) / n, "parent_reward": sum(r_par) / n, "n": n}


# ---------------------------------------------------------------- entry point


def held_out_texts(model_dir, data: str | os.PathLike, split: str = "model",
                   max_docs: int | None = None) -> tuple[list[str], str]:
    """The documents of ``data`` (shards folder or text file) to evaluate ``model_dir``
    on, and the name of the split they come from.

    ``split="model"``: the held-out split recorded with the model
    (``held_out_split.json``, written by pretraining and carried by every later
    stage), so no document the model was trained on is read; a model without one
    (or data the split does not apply to) is evaluated on all of ``data``, named
    ``all``. ``split="all"``: every document of ``data``."""
    from crawl2chat.stages.training.heldout import ALL, held_out_rows, read_split

    if split not in ("model", ALL):
        raise ValueError(f"split must be 'model' or 'all', not {split!r}")
    recorded = read_split(model_dir) if split == "model" and isinstance(model_dir, (str, os.PathLike)) else None
    rows, name = held_out_rows(recorded, data, max_docs=max_docs)
    if split == "model" and name == ALL:
        why = "records no held-out split" if recorded is None else f"was split ({recorded.name}) on other data"
        print(f"note: {model_dir} {why}; evaluating on every document of {data}", file=sys.stderr)
    return [r["text"] for r in rows if r.get("text")], name


def evaluate_model(model_dir, data=None, mc_tasks: int = 100, max_docs: int | None = 2000,
                   max_tokens: int | None = 200_000, prompts: Sequence[str] | None = None, chat: bool = False,
                   quantize: str | None = None, seed: int = 0, split: str = "model") -> dict:
    """Everything that applies to a causal LM: bpb/perplexity and the
    multiple-choice benchmark when ``data`` is given, and sample generations.

    ``data`` as a path is read through the held-out split (:func:`held_out_texts`);
    a list of texts is evaluated as given. ``result["split"]`` names what was read."""
    engine = Engine(model_dir, quantize=quantize)
    loaded = (engine.model, engine.tokenizer)
    result: dict = {"model": str(model_dir), "quantize": engine.quantize}
    if data is not None:
        if isinstance(data, (str, os.PathLike)):
            texts, result["split"] = held_out_texts(model_dir, data, split, max_docs)
        else:
            texts, result["split"] = eval_texts(data, max_docs), "given"
        result["lm"] = evaluate_lm(loaded, texts, max_tokens=max_tokens)
        if mc_tasks:
            try:
                tasks = make_mc_tasks(texts, n=mc_tasks, seed=seed)
            except ValueError as e:  # too little held-out text to build tasks from
                result["mc"] = {"skipped": str(e)}
            else:
                result["mc"] = multiple_choice_accuracy(loaded, tasks)
    result["generations"] = sample_generations(engine, prompts, chat=chat)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="crawl2chat.stages.inference.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model folder (Hugging Face layout)")
    p.add_argument("--data", help="Parquet shards folder or text file; read through --split")
    p.add_argument("--split", choices=["model", "all"], default="model",
                   help="model: only the documents held out by the split recorded with the model "
                        "(all of --data when it records none); all: every document of --data")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--mc-tasks", type=int, default=100, help="multiple-choice tasks generated from --data (0: none)")
    p.add_argument("--max-docs", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=200_000, help="cap on scored tokens")
    p.add_argument("--chat", action="store_true", help="sample generations through the chat template")
    p.add_argument("--quantize", choices=["none", "int8"], default="none")
    p.add_argument("--reward-model", help="also: pairwise accuracy of this reward model on --pairs")
    p.add_argument("--pairs", help="JSONL of {prompt, chosen, rejected} for --reward-model")
    p.add_argument("--parent", help="also: win rate of --model against this parent, judged by --reward-model")
    p.add_argument("--prompts", help="JSONL or text file of held-out prompts for --parent (one per line)")
    args = p.parse_args(argv)
    res = evaluate_model(args.model, args.data, mc_tasks=args.mc_tasks, max_docs=args.max_docs,
                         max_tokens=args.max_tokens, chat=args.chat, quantize=args.quantize, split=args.split)
    if args.reward_model and args.pairs:
        pairs = [json.loads(line) for line in Path(args.pairs).read_text().splitlines() if line.strip()]
        res["reward"] = reward_accuracy(args.reward_model, pairs)
    if args.parent and args.reward_model and args.prompts:
        res["policy"] = win_rate(args.model, args.parent, args.reward_model, prompt_texts(args.prompts))
    text = json.dumps(res, indent=2, ensure_ascii=False)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return res


def prompt_texts(path: str) -> list[str]:
    """The last user turn of every usable row of a prompts file (any shape
    :func:`~crawl2chat.stages.training.chat_data.load_prompts` reads: JSONL or
    Parquet, ``prompt`` or ``messages`` rows)."""
    from crawl2chat.stages.training.chat_data import load_prompts

    conversations, _ = load_prompts(path)
    return [msgs[-1]["content"] for msgs in conversations if msgs and msgs[-1]["role"] == "user"]


if __name__ == "__main__":
    main(sys.argv[1:])
