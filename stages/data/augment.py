"""Augmented copies of kept documents: noise injection, synonym replacement, back-translation.

Each method turns a source document into one new row: the source's columns (url,
lang, source, sample_weight, ...) with a new ``text``, a new ``id`` derived from
the source id, the method and the seed (:func:`augmented_id`), ``augmented_from``
(the source id) and ``augment_method``. Every random choice for a document comes
from a generator seeded by the seed, the method and the document id
(:func:`document_rng`), so a rerun writes the same rows whatever the batching.

The held-out split of the training stages is decided by the hash of a document's
id; an augmented row is split by ``augmented_from`` instead
(:func:`crawl2chat.stages.training.heldout.document_key`), so it always falls on its
source's side, and packing leaves the augmented copies of held-out documents out.
``held_out_fraction`` also spares the augment step the documents that split will
hold out.

Synonym word list format (``data.augment.synonym.word_list``), UTF-8, one entry a line::

    # comment
    big<TAB>large,huge
    quick<TAB>fast,rapid,speedy
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import xxhash

AUGMENT_COLUMNS = ("augmented_from", "augment_method")
_WORD = re.compile(r"\w+", re.UNICODE)


class AugmentSettingsError(ValueError):
    """An augment setting that cannot work; the message names the setting."""


def augmented_id(source_id: str, method: str, seed: int) -> str:
    """The id of ``method``'s copy of document ``source_id`` under ``seed``: stable across reruns."""
    return hashlib.sha256(f"augment|{method}|{seed}|{source_id}".encode("utf-8")).hexdigest()[:16]


def document_rng(source_id: str, method: str, seed: int) -> random.Random:
    return random.Random(xxhash.xxh64_intdigest(f"{seed}|{method}|{source_id}".encode("utf-8")))


def chosen(source_id: str, fraction: float, seed: int) -> bool:
    """Whether a document is among the ``fraction`` augmented (a stable hash of its id)."""
    if fraction >= 1.0:
        return True
    return xxhash.xxh64_intdigest(f"{seed}|choose|{source_id}".encode("utf-8")) / 2.0**64 < fraction


# --------------------------------------------------------------------------- noise


def _swap_adjacent(items: list, rng: random.Random, rate: float) -> list:
    """Swap each item with the next at ``rate`` (a swapped pair is not swapped again); in place."""
    if rate:
        i = 0
        while i < len(items) - 1:
            if rng.random() < rate:
                items[i], items[i + 1] = items[i + 1], items[i]
                i += 2
            else:
                i += 1
    return items


def _noisy_word(word: str, rng: random.Random, drop: float, swap: float) -> str:
    return "".join(_swap_adjacent([c for c in word if not (drop and rng.random() < drop)], rng, swap))


def noise_text(text: str, rng: random.Random, char_drop: float, char_swap: float, word_drop: float,
               word_swap: float) -> str:
    """Word drops and swaps within each line, then character drops and swaps within each word.

    Line breaks are kept; a line keeps at least one word; a word whose every character was
    dropped disappears."""
    lines = []
    for line in text.split("\n"):
        words = line.split()
        if not words:
            lines.append(line)
            continue
        kept = _swap_adjacent([w for w in words if not (word_drop and rng.random() < word_drop)] or [words[0]],
                              rng, word_swap)
        if char_drop or char_swap:
            kept = [w for w in (_noisy_word(w, rng, char_drop, char_swap) for w in kept) if w]
        lines.append(" ".join(kept))
    return "\n".join(lines)


# --------------------------------------------------------------------------- synonyms


def load_word_list(path: str | None, setting: str = "data.augment.synonym.word_list") -> dict[str, list[str]]:
    """Parse a synonym list (``word<TAB>syn1,syn2``); a missing, empty or malformed file raises
    :class:`AugmentSettingsError` naming ``setting``, the file and the line."""
    if not path:
        raise AugmentSettingsError(f"{setting} is not set: synonym replacement needs a word list file")
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AugmentSettingsError(f"{setting}: {p} does not exist") from None
    except UnicodeDecodeError as e:
        raise AugmentSettingsError(f"{setting}: {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise AugmentSettingsError(f"{setting}: {p} cannot be read ({e.strerror or e})") from None
    table: dict[str, list[str]] = {}
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, tab, rest = line.partition("\t")
        synonyms = [s.strip() for s in rest.split(",") if s.strip()]
        if not tab or not word.strip() or not synonyms or len(word.split()) != 1:
            raise AugmentSettingsError(
                f"{setting}: {p} line {n} is not `word<TAB>synonym1,synonym2`: {line[:80]!r}")
        key = word.strip().lower()
        table.setdefault(key, [])
        table[key] += [s for s in synonyms if s.lower() != key and s not in table[key]]
    table = {k: v for k, v in table.items() if v}
    if not table:
        raise AugmentSettingsError(f"{setting}: {p} holds no entry (`word<TAB>synonym1,synonym2`)")
    return table


def _match_case(word: str, replacement: str) -> str:
    if word.isupper() and len(word) > 1:
        return replacement.upper()
    if word[:1].isupper():
        return replacement[:1].upper() + replacement[1:]
    return replacement


def synonym_text(text: str, rng: random.Random, table: dict[str, list[str]], rate: float) -> str:
    """Each word found in ``table`` is replaced with probability ``rate`` by one of its synonyms."""

    def replace(m: re.Match) -> str:
        word = m.group(0)
        options = table.get(word.lower())
        if not options or rng.random() >= rate:
            return word
        return _match_case(word, rng.choice(options))

    return _WORD.sub(replace, text)


# --------------------------------------------------------------------------- back-translation


def check_model_folder(path: str | None, setting: str) -> str:
    """The absolute path of a seq2seq model folder, or :class:`AugmentSettingsError` naming ``setting``."""
    if not path:
        raise AugmentSettingsError(f"{setting} is not set: back-translation needs two model folders")
    p = Path(path)
    if not (p / "config.json").is_file():
        raise AugmentSettingsError(f"{setting}: {p} is not a model folder (no config.json)")
    return str(p.resolve())


class Translator:
    """Greedy, batched, length-bounded translation of text segments with one seq2seq model."""

    def __init__(self, folder: str, device: str, prefix: str, max_input_tokens: int, max_new_tokens: int,
                 batch_size: int):
        import torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.torch, self.device = torch, device
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForSeq2SeqLM.from_pretrained(folder).to(device).eval()
        self.prefix, self.max_in, self.max_new, self.batch = prefix, max_input_tokens, max_new_tokens, batch_size

    def __call__(self, segments: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(segments), self.batch):
            chunk = [self.prefix + s for s in segments[i:i + self.batch]]
            enc = self.tok(chunk, return_tensors="pt", padding=True, truncation=True, max_length=self.max_in)
            enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            with self.torch.no_grad():
                ids = self.model.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=self.max_new)
            out += [t.strip() for t in self.tok.batch_decode(ids, skip_special_tokens=True)]
        return out


class BackTranslator:
    def __init__(self, cfg: Any):
        common = dict(device=cfg.device, max_input_tokens=cfg.max_input_tokens, max_new_tokens=cfg.max_new_tokens,
                      batch_size=cfg.batch_size)
        self.forward = Translator(cfg.forward_model, prefix=cfg.input_prefix, **common)
        self.backward = Translator(cfg.backward_model, prefix=cfg.backward_prefix, **common)
        self.max_segments = cfg.max_segments

    def __call__(self, texts: Sequence[str]) -> list[str]:
        """Round-trip every document's non-empty lines (the first ``max_segments``), all documents'
        lines batched together; a document's copy is its translated lines, one a line."""
        spans, segments = [], []
        for text in texts:
            lines = [ln.strip() for ln in text.split("\n") if ln.strip()][: self.max_segments]
            spans.append((len(segments), len(segments) + len(lines)))
            segments += lines
        back = self.backward(self.forward(segments)) if segments else []
        return ["\n".join(s for s in back[a:b] if s) for a, b in spans]


# --------------------------------------------------------------------------- the step's batch function


class AugmentBatch:
    """Ray Data callable: the batch's documents followed by their augmented copies.

    Built once per worker (the word list read, the models loaded); ``cfg`` has the
    absolute paths :func:`prepare` checked."""

    def __init__(self, cfg: Any, schema_names: Sequence[str]):
        self.cfg = cfg
        self.names = list(schema_names)
        self.table = load_word_list(cfg.synonym.word_list) if cfg.synonym.enabled else {}
        self.bt = BackTranslator(cfg.back_translation) if cfg.back_translation.enabled else None

    def eligible(self, doc_id: str) -> bool:
        from crawl2chat.stages.training.packing import is_validation

        cfg = self.cfg
        if cfg.held_out_fraction and is_validation(doc_id, cfg.held_out_fraction):
            return False
        return chosen(doc_id, cfg.fraction, cfg.seed)

    def augment(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        cfg, seed = self.cfg, self.cfg.seed
        sources = [d for d in docs if d.get("text") and d.get("id") is not None and self.eligible(str(d["id"]))]
        new: list[dict[str, Any]] = []

        def add(doc: dict[str, Any], method: str, text: str) -> None:
            if not text.strip() or text == doc["text"]:
                return  # nothing changed: no row
            row = dict(doc)
            row.update(id=augmented_id(str(doc["id"]), method, seed), text=text, augmented_from=str(doc["id"]),
                       augment_method=method, dup_cluster=None)
            new.append(row)

        if cfg.noise.enabled:
            n = cfg.noise
            for d in sources:
                rng = document_rng(str(d["id"]), "noise", seed)
                add(d, "noise", noise_text(d["text"], rng, n.char_drop_rate, n.char_swap_rate, n.word_drop_rate,
                                           n.word_swap_rate))
        if cfg.synonym.enabled:
            for d in sources:
                rng = document_rng(str(d["id"]), "synonym", seed)
                add(d, "synonym", synonym_text(d["text"], rng, self.table, cfg.synonym.rate))
        if self.bt is not None and sources:
            for d, text in zip(sources, self.bt([d["text"] for d in sources])):
                add(d, "back_translation", text)
        return new

    def __call__(self, batch):
        import pyarrow as pa

        docs = batch.to_pylist()
        for d in docs:
            d.setdefault("augmented_from", None)
            d.setdefault("augment_method", None)
        rows = docs + self.augment(docs)
        schema = batch.schema
        for name in AUGMENT_COLUMNS:
            if name not in schema.names:
                schema = schema.append(pa.field(name, pa.string()))
        return pa.Table.from_pylist(rows, schema=schema)


def prepare(cfg: Any) -> tuple[Any, list[Any]]:
    """Check the augment settings before any work (word list parsed, model folders present)
    and return them with absolute paths (Ray workers may run elsewhere), plus the identity
    of the files they name for the step's fingerprint."""
    from crawl2chat.stages.data.pipeline import files_fingerprint

    identity: list[Any] = []
    if cfg.synonym.enabled:
        load_word_list(cfg.synonym.word_list)
        path = str(Path(cfg.synonym.word_list).resolve())
        cfg = cfg.model_copy(update={"synonym": cfg.synonym.model_copy(update={"word_list": path})})
        identity.append(files_fingerprint([path]))
    if cfg.back_translation.enabled:
        bt = cfg.back_translation
        fwd = check_model_folder(bt.forward_model, "data.augment.back_translation.forward_model")
        bwd = check_model_folder(bt.backward_model, "data.augment.back_translation.backward_model")
        cfg = cfg.model_copy(update={"back_translation": bt.model_copy(update={"forward_model": fwd,
                                                                                "backward_model": bwd})})
        for folder in (fwd, bwd):
            identity.append(files_fingerprint(sorted(str(p) for p in Path(folder).iterdir() if p.is_file())))
    return cfg, identity


def method_counts(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        if r.get("augment_method"):
            out[r["augment_method"]] = out.get(r["augment_method"], 0) + 1
    return dict(sorted(out.items()))
