"""Post-training data: SFT conversations, preference pairs and PPO prompts.

Readers take JSONL, ``.jsonl.gz`` or Parquet and return normalised records
plus a :class:`collections.Counter` of skipped rows by reason. A bad row is
counted and skipped; only a file with nothing usable left is an error.

Accepted shapes:

* SFT: ``messages`` (a list of ``{role, content}``), or ``prompt`` +
  ``response``, or ``instruction`` + ``input`` + ``output`` (Alpaca).
  Normalised to a list of messages ending with an assistant turn.
* Preferences: ``prompt`` + ``chosen`` + ``rejected`` (``prompt`` a string or
  a message list; optional per-pair ``margin``), or whole transcripts in
  ``chosen``/``rejected`` as in Anthropic HH (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``),
  split into the shared conversation and the two final assistant turns.
  Normalised to ``{"prompt": messages, "chosen": str, "rejected": str, "margin": float | None}``
  (``None``: the pair has no margin of its own).
* PPO prompts: any of the above; the prompt messages are kept.

Tokenisation goes through the tokenizer's own chat template: a conversation
is rendered prefix by prefix, so each assistant turn's span (its content and
the end-of-turn marker) is known and only those tokens get labels.

:func:`derive_demo_sets` builds small SFT, preference and prompt sets from
the crawled corpus itself, so the whole pipeline runs with no outside data.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

IGNORE_INDEX = -100
ROLES = {"system", "user", "assistant"}
HH_TURN_RE = re.compile(r"\n\n(Human|Assistant): ")


class NoUsableRows(ValueError):
    """Every row of a data file was skipped."""


# ---------------------------------------------------------------- reading


def read_rows(path: str | os.PathLike) -> Iterator[dict[str, Any] | None]:
    """Rows of a JSONL (optionally gzipped) or Parquet file; ``None`` for a line
    that is not a JSON object."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield None
                continue
            yield row if isinstance(row, dict) else None


def _text(x: Any) -> str | None:
    return x if isinstance(x, str) and x.strip() else None


def _messages(x: Any) -> list[dict[str, str]] | None:
    if not isinstance(x, list) or not x:
        return None
    out = []
    for m in x:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_hh(transcript: str) -> list[dict[str, str]] | None:
    """``"\\n\\nHuman: a\\n\\nAssistant: b"`` -> ``[{user: a}, {assistant: b}]``."""
    parts = HH_TURN_RE.split(transcript)
    if len(parts) < 3 or parts[0].strip():
        return None
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[who], "content": text.strip()} for who, text in zip(parts[1::2], parts[2::2])]


def sft_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """A row in one of the SFT shapes as messages; ValueError(reason) otherwise."""
    if "messages" in row:
        msgs = _messages(row["messages"])
        if msgs is None:
            raise ValueError("bad_messages")
    elif "instruction" in row and "output" in row:
        instr, out = _text(row["instruction"]), _text(row["output"])
        if instr is None or out is None:
            raise ValueError("empty_field")
        extra = _text(row.get("input"))
        msgs = [{"role": "user", "content": f"{instr}\n\n{extra}" if extra else instr},
                {"role": "assistant", "content": out}]
    elif "prompt" in row and "response" in row:
        prompt, resp = row["prompt"], _text(row["response"])
        pmsgs = [{"role": "user", "content": prompt}] if _text(prompt) else _messages(prompt)
        if pmsgs is None or resp is None:
            raise ValueError("empty_field")
        msgs = [*pmsgs, {"role": "assistant", "content": resp}]
    else:
        raise ValueError("unknown_format")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        raise ValueError("no_assistant_turn")
    return msgs


def preference_pair(row: dict[str, Any]) -> dict[str, Any]:
    """A row in one of the preference shapes, normalised; ValueError(reason) otherwise."""
    if "chosen" not in row or "rejected" not in row:
        raise ValueError("unknown_format")
    # No margin (or a null in a margin column): the reward model's `margin` setting applies.
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
        raise ValueError("bad_margin")
    margin = None if margin is None else float(margin)
    if "prompt" in row and row["prompt"] is not None:
        prompt = row["prompt"]
        pmsgs = [{"role": "user", "content": prompt}] if _text(prompt) else _messages(prompt)
        chosen, rejected = _text(row["chosen"]), _text(row["rejected"])
        if pmsgs is None or chosen is None or rejected is None:
            raise ValueError("empty_field")
        return {"prompt": pmsgs, "chosen": chosen, "rejected": rejected, "margin": margin}
    c, r = _text(row["chosen"]), _text(row["rejected"])
    if c is None or r is None:
        raise ValueError("empty_field")
    cm, rm = parse_hh(c), parse_hh(r)
    if cm is None or rm is None:
        raise ValueError("bad_transcript")
    if cm[-1]["role"] != "assistant" or rm[-1]["role"] != "assistant" or cm[:-1] != rm[:-1] or len(cm) < 2:
        raise ValueError("transcripts_diverge")
    if not cm[-1]["content"] or not rm[-1]["content"]:
        raise ValueError("empty_field")
    if cm[-1]["content"] == rm[-1]["content"]:
        raise ValueError("identical_pair")
    return {"prompt": cm[:-1], "chosen": cm[-1]["content"], "rejected": rm[-1]["content"], "margin": margin}


MAX_RANKED = 16  # answers of one ranked row (120 pairs)


def ranked_pairs(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A prompt with ``ranked`` answers, best first, as every ordered pair of them
    (K choose 2), each tagged with the prompt (``group``) and weighted
    ``1 / (K choose 2)`` so that a prompt counts once in the reward model's loss,
    however many answers it ranks (InstructGPT)."""
    answers = row.get("ranked")
    if not isinstance(answers, list) or not 2 <= len(answers) <= MAX_RANKED:
        raise ValueError("bad_ranking")
    texts = [_text(a) for a in answers]
    if any(t is None for t in texts):
        raise ValueError("empty_field")
    if len(set(texts)) != len(texts):
        raise ValueError("identical_pair")
    prompt = row.get("prompt")
    pmsgs = [{"role": "user", "content": prompt}] if _text(prompt) else _messages(prompt) if prompt else None
    if pmsgs is None:
        raise ValueError("empty_field")
    group = json.dumps(pmsgs, sort_keys=True)
    n = len(texts) * (len(texts) - 1) // 2
    return [{"prompt": pmsgs, "chosen": texts[i], "rejected": texts[j], "margin": None, "group": group,
             "weight": 1.0 / n} for i in range(len(texts)) for j in range(i + 1, len(texts))]


def preference_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The pairs of a row: a ranked row gives all of its pairs, any other shape one."""
    return ranked_pairs(row) if "ranked" in row else [preference_pair(row)]


def prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The prompt of a row in any SFT or preference shape (a trailing assistant turn is dropped)."""
    try:
        return preference_pair(row)["prompt"]
    except ValueError:
        pass
    if "prompt" in row and "response" not in row:
        p = row["prompt"]
        msgs = [{"role": "user", "content": p}] if _text(p) else _messages(p)
        if msgs is None:
            raise ValueError("empty_field")
        return msgs
    msgs = _messages(row["messages"]) if "messages" in row else sft_messages(row)
    if msgs is None:
        raise ValueError("bad_messages")
    while msgs and msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]
    if not msgs:
        raise ValueError("no_prompt")
    return msgs


def _load(path, parse) -> tuple[list, Counter]:
    records, skipped = [], Counter()
    for row in read_rows(path):
        if row is None:
            skipped["bad_json"] += 1
            continue
        try:
            records.append(parse(row))
        except ValueError as e:
            skipped[str(e)] += 1
    if not records:
        raise NoUsableRows(f"{path}: no usable rows (skipped {dict(skipped)})")
    return records, skipped


def load_sft(path: str | os.PathLike) -> tuple[list[list[dict[str, str]]], Counter]:
    return _load(path, sft_messages)


def load_preferences(path: str | os.PathLike) -> tuple[list[dict[str, Any]], Counter]:
    """Preference pairs of a file; a ranked row's pairs come one after another, sharing
    its ``group`` (see :func:`ranked_pairs`)."""
    rows, skipped = _load(path, preference_rows)
    return [p for pairs in rows for p in pairs], skipped


def load_prompts(path: str | os.PathLike) -> tuple[list[list[dict[str, str]]], Counter]:
    return _load(path, prompt_messages)


def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def is_held_out(key: str, fraction: float) -> bool:
    """Stable split by content hash, independent of row order."""
    return (_key_hash(key) % 10_000) < fraction * 10_000


# How a post-training set was split (reported in the stage's summary as ``held_out_rule``).
SPLIT_HASH = "content_hash"  # the share of rows whose content hash falls under val_fraction
SPLIT_HASH_TAIL = "hash_tail"  # the hash held out nothing: the distinct rows last in hash order
SPLIT_NONE = "none"  # val_fraction 0, or a single distinct row: no held-out set, no held-out figures


def split_held_out(keys: list[str], fraction: float) -> tuple[list[bool], str]:
    """Which rows are held out, and by which rule; rows with one key always fall on one side.

    The content hash (:func:`is_held_out`) decides. A small set whose hash holds out
    nothing (few distinct rows) falls back to a tail, as pretraining does: the
    ``ceil(fraction x distinct)`` distinct keys last in hash order, leaving at least one
    for training; independent of row order like the hash. A single distinct row, or
    ``fraction`` 0, holds out nothing (:data:`SPLIT_NONE`)."""
    if fraction <= 0 or not keys:
        return [False] * len(keys), SPLIT_NONE
    held = [is_held_out(k, fraction) for k in keys]
    if any(held) and not all(held):
        return held, SPLIT_HASH
    distinct = sorted(set(keys), key=_key_hash)
    if len(distinct) < 2:
        return [False] * len(keys), SPLIT_NONE
    n_val = min(len(distinct) - 1, max(1, math.ceil(fraction * len(distinct))))
    tail = set(distinct[len(distinct) - n_val:])
    return [k in tail for k in keys], SPLIT_HASH_TAIL


def held_out_phrase(n_val: int, rule: str) -> str:
    """How a post-training set was split, in words for the log."""
    if rule == SPLIT_NONE:
        return "no held-out set (val_fraction 0, or a single distinct example): no held-out figures"
    return f"{n_val} held out" + (" (the hash held out none: the last distinct examples in hash order)"
                                  if rule == SPLIT_HASH_TAIL else "")


# ---------------------------------------------------------------- tokenisation


def render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_sft(tokenizer, messages, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels for a conversation: labels are the ids on assistant
    turns (content and end-of-turn marker) and ``IGNORE_INDEX`` elsewhere.

    The conversation is rendered prefix by prefix with the chat template; each
    stretch between prefixes is tokenised on its own, which is also how a
    prompt and a generated answer are tokenised at inference time."""
    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(tokenizer, messages[:i], add_generation_prompt=True) if i else render(tokenizer, [], True)
            full = render(tokenizer, messages[: i + 1])
            if not head.startswith(done) or not full.startswith(head):
                raise ValueError("template_not_prefix_stable")
            t = _ids(tokenizer, head[len(done):])
            ids += t
            labels += [IGNORE_INDEX] * len(t)
            t = _ids(tokenizer, full[len(head):])
            ids += t
            labels += t
            done = full
    tail = render(tokenizer, messages)[len(done):]
    t = _ids(tokenizer, tail)
    ids += t
    labels += [IGNORE_INDEX] * len(t)
    ids, labels = ids[:max_len], labels[:max_len]
    if all(x == IGNORE_INDEX for x in labels):
        raise ValueError("no_assistant_tokens_within_seq_len")
    return ids, labels


def encode_prompt(tokenizer, prompt_messages_, max_len: int | None = None) -> list[int]:
    """Prompt ids ending with the assistant generation prompt; long prompts keep their end."""
    ids = _ids(tokenizer, render(tokenizer, prompt_messages_, add_generation_prompt=True))
    return ids[-max_len:] if max_len else ids


def encode_response(tokenizer, prompt_messages_, response: str, eot_id: int | None = None) -> list[int]:
    """Ids of an assistant answer as the template closes it: content up to and
    including the end-of-turn marker (what a sampled answer ends with; text the
    template puts after the marker is dropped, so a reward model is trained on
    exactly the sequences PPO later asks it to score)."""
    head = render(tokenizer, prompt_messages_, add_generation_prompt=True)
    full = render(tokenizer, [*prompt_messages_, {"role": "assistant", "content": response}])
    if not full.startswith(head):
        raise ValueError("template_not_prefix_stable")
    ids = _ids(tokenizer, full[len(head):])
    eot = end_of_turn_id(tokenizer) if eot_id is None else eot_id
    if eot in ids:
        ids = ids[: len(ids) - ids[::-1].index(eot)]
    return ids


def end_of_turn_id(tokenizer) -> int:
    """The token a chat answer ends with: the template's end-of-turn marker, else EOS."""
    ids = _ids(tokenizer, render(tokenizer, [{"role": "assistant", "content": "x"}]))
    special = set(tokenizer.all_special_ids)
    trailing = [t for t in ids if t in special]
    return trailing[-1] if trailing else tokenizer.eos_token_id


def encode_pair(tokenizer, pair: dict[str, Any], max_len: int) -> dict[str, Any]:
    """Prompt + chosen / prompt + rejected ids with response masks, at most
    ``max_len`` tokens each: a long prompt keeps its end, a long answer its start,
    and the answer keeps at least half of ``max_len``."""
    out: dict[str, Any] = {"margin": pair.get("margin")}
    eot = end_of_turn_id(tokenizer)
    for side in ("chosen", "rejected"):
        resp = encode_response(tokenizer, pair["prompt"], pair[side], eot)
        prompt = encode_prompt(tokenizer, pair["prompt"])
        # Over budget: the answer keeps at least half, the prompt keeps its end.
        resp = resp[: max_len - min(len(prompt), max_len // 2)]
        prompt = prompt[len(prompt) - (max_len - len(resp)):] if len(prompt) + len(resp) > max_len else prompt
        out[side] = prompt + resp
        out[side + "_mask"] = [0] * len(prompt) + [1] * len(resp)
    return out


def pad(rows: list[list[int]], value: int, length: int | None = None, left: bool = False):
    import torch

    n = length or max(len(r) for r in rows)
    return torch.tensor([([value] * (n - len(r)) + r) if left else (r + [value] * (n - len(r))) for r in rows],
                        dtype=torch.long)


def scored_logits(model, input_ids, scored, **kwargs):
    """Logits at the positions that predict the tokens where ``scored`` is true, and those
    tokens: ``(n, vocab)`` and ``(n,)``, rows in order. The vocabulary projection runs only
    there (``logits_to_keep`` as a mask): prompts, templates and padding are a large part
    of a chat row, and the projection a large share of a small model's work."""
    import torch.nn.functional as F

    predicts = scored[:, 1:].bool()  # position t predicts token t + 1
    logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=F.pad(predicts, (0, 1), value=False),
                   **kwargs).logits
    return logits, input_ids[:, 1:][predicts]


def response_logprobs(model, input_ids, attention_mask, response_mask):
    """Sum of log-probabilities of the tokens where ``response_mask`` is 1 (right-padded rows)."""
    import torch

    logits, targets = scored_logits(model, input_ids, response_mask, attention_mask=attention_mask)
    lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    rows = response_mask[:, 1:].bool().nonzero()[:, 0]
    return torch.zeros(input_ids.shape[0], dtype=lp.dtype, device=lp.device).index_add(0, rows, lp)


# ---------------------------------------------------------------- demo sets from the corpus

_SENT_RE = re.compile(r"(?<=[.!?])\s+")


def _corrupt(text: str, rng: random.Random) -> str:
    words = text.split()
    kind = rng.randrange(3)
    if kind == 0 and len(words) > 3:
        rng.shuffle(words)
        return " ".join(words)
    if kind == 1 and len(words) > 4:
        return " ".join(words[: max(2, len(words) // 4)])
    head = " ".join(words[: max(1, min(4, len(words)))])
    return " ".join([head] * 3)


def _weighted_order(groups: list[str], sizes: list[int], weights: list[float], seed: int) -> tuple[list[int], dict]:
    """Candidates in a weighted random order without replacement (Efraimidis-Spirakis keys
    ``u ** (1 / w)``), where every candidate of group g weighs ``p_g / n_g``: ``p_g`` the
    group's target share (sum of weight x size over its candidates, normalised), ``n_g``
    its number of candidates. Any prefix of the order then holds each group at about
    its target share, as long as the group has candidates left."""
    import numpy as np

    names = sorted(set(groups))
    code = {g: i for i, g in enumerate(names)}
    g_idx = np.array([code[g] for g in groups])
    mass = np.bincount(g_idx, weights=np.asarray(weights) * np.asarray(sizes), minlength=len(names))
    count = np.bincount(g_idx, minlength=len(names))
    target = mass / mass.sum()
    w = target[g_idx] / count[g_idx]
    u = np.random.default_rng(seed).random(len(groups))
    keys = np.log(np.maximum(u, 1e-300)) / w  # log(u ** (1/w)): larger is earlier
    order = np.argsort(-keys, kind="stable").tolist()
    return order, {g: float(target[code[g]]) for g in names}


# The share of reference pages kept for the questions and the showcase (no set uses them).
QUESTION_PAGES = 0.1

_SIGNATURE_RE = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)\s*$")
_NAME_RE = re.compile(r"^[A-Za-z_][\w.]*$")
# A C function's docstring opens with its call and result: "S.rfind(sub[, start]) -> int",
# "D.clear() -> None. Remove all items from D.", "L.index(value) -> integer -- return first index".
_CALL_RESULT_RE = re.compile(r"^[A-Za-z_][\w.]*\(.*\)\s*-{1,2}>\s*")
_AFTER_RESULT_RE = re.compile(r"\.\s+|\s+--?\s+")


def _says_what_it_does(line: str) -> bool:
    return len(line.split()) >= 4 and not line.endswith(":") and not _SIGNATURE_RE.match(line)


def _function_answer(lines: list[str], i: int) -> str | None:
    """What the function whose signature is ``lines[i]`` does: the line under it, or,
    where that line is a call and its result (a C function's docstring), the words after
    the result on that line or the next line of text below it. None when there is none."""
    line = lines[i + 1]
    call = _CALL_RESULT_RE.match(line)
    if not call:
        return line if _says_what_it_does(line) else None
    parts = _AFTER_RESULT_RE.split(line[call.end():], maxsplit=1)
    if len(parts) == 2 and _says_what_it_does(parts[1]):
        return parts[1][:1].upper() + parts[1][1:]
    below = next((x for x in lines[i + 2:i + 4] if x), "")
    return below if _says_what_it_does(below) and not _CALL_RESULT_RE.match(below) else None


def doc_examples(text: str, url: str | None, max_chars: int = 300) -> list[tuple[str, str]]:
    """Questions a reference page answers, with its own words as the answers:
    ``What is the X module for?`` (the docstring under "Module Reference") and
    ``What does X.f() do?`` (the line under each ``f(args)`` signature, past a call and
    its result such as ``S.rfind(sub) -> int``, which says nothing a person would answer).
    Pages of the Python documentation server have this shape; other pages give none."""
    module = None
    if url:
        tail = url.rstrip("/").rsplit("/", 1)[-1]
        if tail.endswith(".html") and "?" not in tail:
            module = tail[: -len(".html")]
    if not module or module == "index":
        return []
    lines = [" ".join(line.split()) for line in text.splitlines()]  # pydoc spaces words with no-break spaces
    out: list[tuple[str, str]] = []
    # The page's heading: "json (version 2.0.9) index", then the source path or
    # "(built-in)", then (when the site template was kept) "Module Reference".
    head = next((i for i, line in enumerate(lines[:12]) if line.split()[:1] == [module] and line.endswith("index")),
                None)
    if head is not None:
        rest = iter(lines[head + 1:])
        para: list[str] = []
        for line in rest:
            if not line:
                if para:
                    break
                continue
            if not para and (line.startswith(("/", "(built-in)")) or line.endswith(".py") or line == "Module Reference"):
                continue
            para.append(line)
        purpose = " ".join(para)
        # A module without a docstring shows the modules it imports there instead,
        # one name a line: a list of names, not a purpose.
        imports = all(_NAME_RE.match(line) for line in para)
        if (para and len(purpose.split()) >= 3 and not imports and not _SIGNATURE_RE.match(para[0])
                and not purpose.endswith(":")):
            out.append((f"What is the {module} module for?", purpose[:max_chars]))
    for i, line in enumerate(lines[:-1]):
        m = _SIGNATURE_RE.match(line)
        answer = _function_answer(lines, i) if m and not m.group(1).startswith("_") else None
        if answer:
            out.append((f"What does {module}.{m.group(1)}() do?", answer[:max_chars]))
    return out


def derive_demo_sets(shards_dir: str | os.PathLike, out_dir: str | os.PathLike, n: int = 200,
                     seed: int = 0, max_chars: int = 400, split=None, by_weight: bool = True,
                     scan: int | None = None, questions_n: int = 100) -> dict[str, str]:
    """Small SFT, preference and prompt sets derived from the corpus (``text``
    column of the Parquet shards), deterministic for a given corpus and seed.

    * SFT: on reference pages, the questions :func:`doc_examples` finds (what a
      module is for, what a function does) answered by the page; elsewhere
      ``"Continue: <first sentence>"`` -> the following text, and ``"Summarise the
      page titled ..."`` (when a ``title`` column exists) -> the page's opening.
    * Preferences: the same prompts, chosen = the real answer, rejected = the answer
      to another question (half of the reference questions) or a shuffled-word,
      truncated or repeated corruption of it.
    * Prompts (for PPO): prompts of pages not used above.

    ``split`` (a :class:`~crawl2chat.stages.training.heldout.HeldOutSplit`, the
    base model's): documents it holds out are never used, so evaluations on them
    stay clean of every stage's training data. ``by_weight``: pages are drawn by
    the balance weights (``sample_weight``, grouped by ``lang``), so each
    language's share of the examples follows the balance target, among the first
    ``scan`` usable pages (default ``20 * n``; a demo set does not read a whole
    crawl). Without weights the draw is uniform.

    Writes ``sft.jsonl``, ``preference.jsonl``, ``prompts.jsonl`` (each row with
    the ``source_id`` of its page), ``showcase.jsonl`` and ``questions.jsonl``
    (reference questions about pages the base model read and no set used: three
    to show, up to ``questions_n`` to score; the pages kept for them, :data:`QUESTION_PAGES`
    of the reference pages by id hash, come first, then pages the sets left over) and
    ``demo_sets.json`` (the split used, the number of questions, and per group
    ``share.<g>.target`` / ``share.<g>.realised`` of the SFT examples) under
    ``out_dir`` and returns their paths (``summary`` for the last)."""
    from crawl2chat.stages.training.heldout import training_rows

    rng = random.Random(seed)
    scan = scan or 20 * n
    examples, groups, sizes, weights = [], [], [], []
    for row in training_rows(split, shards_dir, ["id", "url", "text", "title", "lang", "sample_weight"]):
        text = (row.get("text") or "").strip()
        if len(text) < 80:
            continue
        docs = doc_examples(text, row.get("url"))
        if docs:
            w = row.get("sample_weight")
            for prompt, resp in rng.sample(docs, min(len(docs), 4)):  # a few per page: more pages, more variety
                examples.append((prompt, resp, row.get("id")))
                groups.append(str(row.get("lang") or "unknown"))
                sizes.append(len(text.encode("utf-8")))
                weights.append(float(w) if by_weight and isinstance(w, (int, float)) and w > 0 else 1.0)
            if len(examples) >= (scan if by_weight else 3 * n):
                break
            continue
        sents = [s.strip() for s in _SENT_RE.split(text.replace("\n", " ")) if s.strip()]
        if len(sents) < 2:
            continue
        title = (row.get("title") or "").strip()
        if title and len(examples) % 2 == 1:
            prompt = f"Summarise the page titled \"{title[:100]}\"."
            resp = " ".join(sents)[:max_chars]
        else:
            prompt = f"Continue: {sents[0][:200]}"
            resp = " ".join(sents[1:])[:max_chars]
        if len(resp.split()) >= 5:
            examples.append((prompt, resp, row.get("id")))
            groups.append(str(row.get("lang") or "unknown"))
            sizes.append(len(text.encode("utf-8")))
            w = row.get("sample_weight")
            weights.append(float(w) if by_weight and isinstance(w, (int, float)) and w > 0 else 1.0)
        if len(examples) >= (scan if by_weight else 3 * n):
            break
    if not examples:
        raise NoUsableRows(f"no documents with two or more sentences under {shards_dir}")
    order, target = _weighted_order(groups, sizes, weights, seed) if by_weight else (list(range(len(examples))), {})
    # Reference pages whose id hashes under QUESTION_PAGES are kept for the questions
    # and the showcase alone, so every model is scored on pages no set used however
    # many examples the sets take.
    reserved = [e[2] is not None and e[0].startswith("What ") and is_held_out(f"questions:{e[2]}", QUESTION_PAGES)
                for e in examples]
    for_sets = [i for i in order if not reserved[i]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    picked = [examples[i] for i in for_sets[: 3 * n]]
    sft = picked[:n]
    pref = picked[: n]
    prompts = picked[n: 2 * n] or picked[: n]
    paths = {k: out / f"{k}.jsonl" for k in ("sft", "preference", "prompts")}
    with open(paths["sft"], "w", encoding="utf-8") as f:
        for p, r, i in sft:
            f.write(json.dumps({"prompt": p, "response": r, "source_id": i}) + "\n")
    with open(paths["preference"], "w", encoding="utf-8") as f:
        for j, (p, r, i) in enumerate(pref):
            # A reference question's wrong answer is, for every other pair, another
            # question's right one (the reward model learns what answers what), else a
            # shuffled, truncated or repeated copy of its own (it learns fluency, which
            # is what a small policy loses first).
            other = pref[(j + 1 + rng.randrange(max(1, len(pref) - 1))) % len(pref)][1]
            bad = other if p.startswith("What ") and other != r and j % 2 == 0 else _corrupt(r, rng)
            if bad != r:
                f.write(json.dumps({"prompt": p, "chosen": r, "rejected": bad, "source_id": i}) + "\n")
    with open(paths["prompts"], "w", encoding="utf-8") as f:
        for p, _, i in prompts:
            f.write(json.dumps({"prompt": p, "source_id": i}) + "\n")
    # Questions no stage trains on, for showing the models side by side at the end.
    used = {e[2] for e in picked[: 2 * n]}
    # Reference questions first (what a module is for, then what a function does):
    # their answers are on pages the model read, so they show what it learnt.
    def kind(prompt: str) -> int:
        if re.search(r"\btests?\b|\btest_", prompt):
            return 3  # a test module's purpose ("Tests for X") shows little of what was learnt
        return 0 if prompt.endswith("module for?") else 1 if prompt.startswith("What does ") else 2

    unused = [examples[i] for i in order if reserved[i]] + [examples[i] for i in for_sets if examples[i][2] not in used]
    showcase, pages = [], set()
    for e in sorted(unused, key=lambda e: kind(e[0])):  # stable: keeps the draw order within a kind
        if e[2] not in pages and len(showcase) < 3:
            showcase.append(e)
            pages.add(e[2])
    showcase = showcase or picked[-3:]
    paths["showcase"] = out / "showcase.jsonl"
    with open(paths["showcase"], "w", encoding="utf-8") as f:
        for p, r, i in showcase:
            f.write(json.dumps({"prompt": p, "reference": r, "source_id": i}) + "\n")
    # A larger set of such questions (at most two a page) to score every model on,
    # as multiple choice among other pages' answers (evaluate.question_accuracy).
    questions, per_page = [], Counter()
    for p, r, i in unused:
        if kind(p) < 2 and per_page[i] < 2 and len(questions) < questions_n:
            questions.append((p, r, i))
            per_page[i] += 1
    if questions:
        paths["questions"] = out / "questions.jsonl"
        with open(paths["questions"], "w", encoding="utf-8") as f:
            for p, r, i in questions:
                f.write(json.dumps({"prompt": p, "reference": r, "source_id": i}) + "\n")
    chosen_groups = Counter(groups[i] for i in for_sets[:n])
    summary: dict[str, Any] = {"split": split.name if split is not None else "none (no base model split given)",
                               "by_weight": by_weight, "candidates": len(examples),
                               "question_pages": len({e[2] for e, r in zip(examples, reserved) if r}),
                               "questions": len(questions)}
    for g in sorted(set(groups)):
        key = re.sub(r"[^A-Za-z0-9_\-/ ]", "_", g)
        if target:
            summary[f"share.{key}.target"] = target[g]
        summary[f"share.{key}.realised"] = chosen_groups[g] / max(1, len(sft))
    paths["summary"] = out / "demo_sets.json"
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    return {k: str(v) for k, v in paths.items()}
