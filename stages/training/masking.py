"""The corruptions of the encoder objectives, as pure functions of a row and a generator.

* :func:`mask_tokens`: BERT's masked language modelling. Of a row's ordinary
  tokens (special tokens are never chosen) ``round(p x n)`` are selected for
  prediction; each selected token is replaced by ``<|mask|>`` with probability
  ``mask_replace_prob`` (0.8), by a random ordinary token with probability
  ``random_replace_prob`` (0.1), and kept otherwise. With whole-word masking the
  selection takes whole words (every token of a word or none), in the way of
  Google's BERT reference (``create_masked_lm_predictions``): words in random
  order, each taken while the count stays within the target, the 80/10/10
  replacement then applied per token.
* :func:`random_spans_noise_mask` and :func:`corrupt_spans`: T5's span
  corruption (``t5.data.preprocessors.random_spans_noise_mask``): ``round(L x
  density)`` noise tokens in ``round(noise / mean_span_length)`` spans whose
  lengths, like those of the kept stretches between them, are a uniformly random
  composition; each span is replaced by one sentinel in the input, and the
  target lists each sentinel followed by the span it replaced.

The random state is a ``numpy.random.Generator`` the caller seeds (the stages
seed one per (batch index, row)), so a batch is a pure function of its index.

Written here rather than taken from ``transformers``: its
``DataCollatorForLanguageModeling`` draws from one generator that advances
across calls (a batch would depend on the batches before it) and its whole-word
mode drops the random and kept shares; T5's span noise exists there only in an
example script.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100


# ---------------------------------------------------------------- masked language modelling


def word_boundaries(token_strings: list[str], tokenizer_type: str) -> tuple[np.ndarray, np.ndarray]:
    """Per token id: does the token begin a word, and does it end with whitespace
    (so the token after it begins one)? From the family's word markers: WordPiece
    ``##`` continues a word; Unigram ``▁`` and byte-level BPE ``Ġ`` (space) begin one."""
    n = len(token_strings)
    starts, ends_space = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    if tokenizer_type == "wordpiece":
        for i, t in enumerate(token_strings):
            starts[i] = not t.startswith("##")
    elif tokenizer_type == "unigram":
        for i, t in enumerate(token_strings):
            starts[i], ends_space[i] = t.startswith("▁"), t.endswith("▁")
    elif tokenizer_type == "bpe":
        space = {"Ġ", "Ċ", "ĉ", "č"}  # byte-level images of space, newline, tab, carriage return
        for i, t in enumerate(token_strings):
            starts[i], ends_space[i] = t[:1] in space, t[-1:] in space
    else:
        raise ValueError(f"tokenizer_type: unknown {tokenizer_type!r}")
    return starts, ends_space


def word_ids(ids: np.ndarray, special: np.ndarray, starts: np.ndarray, ends_space: np.ndarray) -> np.ndarray:
    """Word number of each token of ``ids`` (-1 for special tokens). A word begins at a
    word-start token, after a special token or after a token ending in whitespace; the
    row's first ordinary token always begins one (a window may cut a word)."""
    sp = special[ids]
    prev = np.concatenate([[0], ids[:-1]])
    begin = starts[ids] | special[prev] | ends_space[prev]
    begin[0] = True
    begin &= ~sp
    wid = np.cumsum(begin) - 1
    wid[sp] = -1
    return wid


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, special: np.ndarray, mask_id: int,
                random_ids: np.ndarray, mlm_probability: float = 0.15, mask_replace_prob: float = 0.8,
                random_replace_prob: float = 0.1, words: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)`` for one row of token ids: labels hold the original id at
    selected positions and ``IGNORE_INDEX`` elsewhere. ``special`` flags special ids
    (never selected); ``random_ids`` are the ids a random replacement draws from;
    ``words`` (from :func:`word_ids`) turns on whole-word selection."""
    ids = np.asarray(ids, dtype=np.int64)
    candidates = np.flatnonzero(~special[ids])
    target = int(round(mlm_probability * len(candidates)))
    if len(candidates) and target == 0:
        target = 1
    if words is None:
        selected = rng.choice(candidates, size=target, replace=False) if target else candidates[:0]
    else:
        members: dict[int, list[int]] = {}
        for pos in candidates:
            members.setdefault(int(words[pos]), []).append(int(pos))
        groups = list(members.values())
        chosen: list[int] = []
        for g in rng.permutation(len(groups)):
            if len(chosen) >= target:
                break
            if len(chosen) + len(groups[g]) > target:
                continue
            chosen.extend(groups[g])
        selected = np.asarray(chosen, dtype=np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[selected] = ids[selected]
    inputs = ids.copy()
    u = rng.random(len(selected))
    to_mask = selected[u < mask_replace_prob]
    to_random = selected[(u >= mask_replace_prob) & (u < mask_replace_prob + random_replace_prob)]
    inputs[to_mask] = mask_id
    inputs[to_random] = rng.choice(random_ids, size=len(to_random))
    return inputs, labels


# ---------------------------------------------------------------- span corruption


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """``(noise tokens, noise spans)`` of a row of ``length`` tokens, as T5 rounds them."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = max(int(round(noise / mean_span_length)), 1)
    return noise, spans


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a uniformly random split of ``num_items`` into ``num_segments`` non-empty parts."""
    first = np.zeros(num_items, dtype=bool)
    first[1 + rng.choice(num_items - 1, size=num_segments - 1, replace=False)] = True
    first[0] = True
    return np.diff(np.append(np.flatnonzero(first), num_items))


def random_spans_noise_mask(length: int, noise_density: float, mean_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """Boolean noise mask of a row: kept and noise stretches alternate, kept first."""
    noise, spans = span_counts(length, noise_density, mean_span_length)
    if length - noise < spans:
        raise ValueError(f"a row of {length} tokens cannot hold {spans} noise spans between kept tokens")
    noise_lengths = _random_segmentation(noise, spans, rng)
    kept_lengths = _random_segmentation(length - noise, spans, rng)
    mask = np.zeros(length, dtype=bool)
    pos = 0
    for k, n in zip(kept_lengths, noise_lengths):
        pos += int(k)
        mask[pos:pos + int(n)] = True
        pos += int(n)
    return mask


def corrupt_spans(ids: np.ndarray, noise: np.ndarray, sentinel_ids: list[int] | np.ndarray,
                  eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)``: the row with each noise span replaced by the next sentinel,
    and the sentinels each followed by the span it replaced; both end with ``eos_id``."""
    ids = np.asarray(ids, dtype=np.int64)
    span_start = noise & ~np.concatenate([[False], noise[:-1]])
    n_spans = int(span_start.sum())
    if n_spans > len(sentinel_ids):
        raise ValueError(f"{n_spans} noise spans but only {len(sentinel_ids)} sentinel tokens")
    sent = np.asarray(sentinel_ids, dtype=np.int64)[:n_spans]
    span_no = np.cumsum(span_start) - 1  # span number of each noise token
    inputs = np.where(span_start, sent[np.clip(span_no, 0, None)] if n_spans else ids, ids)[~noise | span_start]
    targets = np.insert(ids[noise], np.flatnonzero(span_start[noise]), sent)
    return np.append(inputs, eos_id), np.append(targets, eos_id)
