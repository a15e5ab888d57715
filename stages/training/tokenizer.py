"""Tokenizers for every model stage: byte-level BPE, WordPiece or Unigram.

One tokenizer serves pretraining, SFT, reward modelling and PPO/DPO, so its
special tokens cover all of them from the start: end of text (document
separator and generation stop), padding, and the chat roles used by the chat
template. It is saved in the Hugging Face layout (``tokenizer.json`` +
``tokenizer_config.json`` carrying the chat template) so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it with no
conversion step, and the final model folder ships it next to the weights.

Three families, all from the ``tokenizers`` library (``tokenizer_type``):

* ``bpe`` (the default for decoders): byte-level BPE as in GPT-2. Every UTF-8
  byte has a token, so no input is ever unknown, and bits per byte stay
  comparable across tokenizers of different sizes.
* ``wordpiece``: BERT's cased WordPiece (``##`` marks a word's continuation;
  punctuation is split off). Characters never seen in training map to ``<|unk|>``.
* ``unigram``: the SentencePiece unigram language model (``▁`` marks a word
  start, NFKC normalisation). Unseen characters map to ``<|unk|>``.

Each family trains the same tokenizer on every run over the same texts (the
library's WordPiece and Unigram trainers alone do not; see ``_train_wordpiece``
and ``_settle_unigram``), so a rerun of a stage reproduces its tokens.

The encoder stages add what their objective needs (``objective``): masked
language modelling ``<|cls|>``, ``<|sep|>`` and ``<|mask|>`` with a
``<|cls|> text <|sep|>`` template; span corruption T5's sentinels
``<extra_id_0>``, ``<extra_id_1>``, ... and an end-of-text after each input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from crawl2chat.stages.data.versions import iter_documents

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TURN_TOKEN = "<|end|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TURN_TOKEN]
UNK_TOKEN = "<|unk|>"  # WordPiece and Unigram only: byte-level BPE has no unknown input
CLS_TOKEN = "<|cls|>"
SEP_TOKEN = "<|sep|>"
MASK_TOKEN = "<|mask|>"
MLM_TOKENS = [CLS_TOKEN, SEP_TOKEN, MASK_TOKEN]
TOKENIZER_TYPES = ("bpe", "wordpiece", "unigram")
OBJECTIVES = ("causal", "mlm", "span")


def sentinel(i: int) -> str:
    """The i-th span-corruption sentinel (T5's name)."""
    return f"<extra_id_{i}>"

# Each turn is "<|role|>\n{content}<|end|>\n"; generation is prompted with
# "<|assistant|>\n" and stops at <|end|>. SFT masks everything but assistant turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def is_text_file(source: str | os.PathLike) -> bool:
    return Path(source).is_file()


def iter_texts(source: str | os.PathLike, max_docs: int | None = None) -> Iterator[str]:
    """Documents of a shards folder (the ``text`` column) or of a plain text file
    (the whole file is one document), streamed one record batch at a time."""
    if is_text_file(source):
        yield Path(source).read_text(encoding="utf-8")
        return
    n = 0
    for row in iter_documents(source, ["text"]):
        if row["text"]:
            yield row["text"]
            n += 1
            if max_docs is not None and n >= max_docs:
                return


def train_tokenizer(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    vocab_size: int = 8192,
    max_docs: int | None = None,
    min_frequency: int = 2,
    tokenizer_type: str = "bpe",
    objective: str = "causal",
    num_sentinels: int = 0,
) -> Path:
    """Train a tokenizer of ``tokenizer_type`` (bpe, wordpiece, unigram) on ``source``
    for ``objective`` (causal, mlm, span: which special tokens it carries) and save
    it to ``out_dir`` in the Hugging Face layout. Returns ``out_dir``.

    Special token ids are fixed: the six of :data:`SPECIAL_TOKENS` are 0..5 in
    every tokenizer, then ``<|unk|>`` (WordPiece, Unigram), then the objective's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"tokenizer_type: unknown {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown tokenizer objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    specials = list(SPECIAL_TOKENS) + ([UNK_TOKEN] if tokenizer_type != "bpe" else [])
    extra = MLM_TOKENS if objective == "mlm" else [sentinel(i) for i in range(num_sentinels)] if objective == "span" else []
    specials += extra
    floor = len(specials) + (256 if tokenizer_type == "bpe" else 32)
    if vocab_size < floor:
        what = "the 256 bytes and " if tokenizer_type == "bpe" else "an alphabet and "
        raise ValueError(f"vocab_size={vocab_size} must cover {what}{len(specials)} special tokens (at least {floor})")

    if tokenizer_type == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    elif tokenizer_type == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=UNK_TOKEN))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                                    lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        trainer = None  # trained by _train_wordpiece: the same vocabulary on every run
    else:
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials, unk_token=UNK_TOKEN,
                                          show_progress=False)
    texts = iter_texts(source, max_docs=max_docs)
    if is_text_file(source):
        # One huge document trains slowly and its pre-tokenisation holds it all
        # in memory at once; lines are the natural unit for a text file.
        texts = (line for doc in texts for line in doc.splitlines(keepends=True))
    if trainer is None:
        _train_wordpiece(tok, texts, vocab_size, min_frequency, specials)
    else:
        tok.train_from_iterator(texts, trainer=trainer)
    if tokenizer_type == "unigram":
        _settle_unigram(tok, len(specials))
    got = [tok.token_to_id(t) for t in specials]
    if got != list(range(len(specials))):  # every family puts the special tokens first, in order
        raise RuntimeError(f"special tokens got ids {got}, expected 0..{len(specials) - 1}")

    kwargs: dict = {}
    if objective == "mlm":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{CLS_TOKEN} $A {SEP_TOKEN}", pair=f"{CLS_TOKEN} $A {SEP_TOKEN} $B:1 {SEP_TOKEN}:1",
            special_tokens=[(t, tok.token_to_id(t)) for t in (CLS_TOKEN, SEP_TOKEN)])
        kwargs = dict(cls_token=CLS_TOKEN, sep_token=SEP_TOKEN, mask_token=MASK_TOKEN)
    elif objective == "span":
        # T5: every encoder input (and target) ends with the end-of-text token.
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B:1 {EOS_TOKEN}:1",
            special_tokens=[(EOS_TOKEN, tok.token_to_id(EOS_TOKEN))])
    if objective != "causal":
        kwargs["model_input_names"] = ["input_ids", "attention_mask"]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN if tokenizer_type != "bpe" else None,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[2:] + (extra if objective == "span" else []),
        chat_template=CHAT_TEMPLATE if objective == "causal" else None,
        model_max_length=1 << 30,
        **kwargs,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    if objective == "causal":
        _inline_chat_template(out)
    return out


# A word's continuation characters as the BPE trainer sees them when it learns a
# WordPiece vocabulary: planes 0 and 1 shifted into the private-use planes 15
# and 16 (characters beyond keep their spelling: CJK extensions are words of
# their own after BERT's normaliser). Private-use characters of planes 15-16
# already in the text are removed first.
_MARK_OFFSET = 0xF0000
_MARKED_BELOW = 0x20000
# Unicode's White_Space characters, where BERT's pre-tokenizer splits words.
_WHITESPACE = [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
               0x205F, 0x3000]
_MARK_CHUNK_CHARS = 1 << 20


def _word_characters():
    """Whether each code point of planes 0-1 belongs inside a word for BERT's
    pre-tokenizer: neither white space nor punctuation (ASCII punctuation or a
    Unicode P* category)."""
    import string
    import unicodedata

    import numpy as np

    word = np.ones(_MARKED_BELOW, dtype=bool)
    word[_WHITESPACE] = False
    word[[ord(c) for c in string.punctuation]] = False
    word[[c for c in range(_MARKED_BELOW) if unicodedata.category(chr(c)).startswith("P")]] = False
    return word


class _ContinuationMarker:
    """Rewrites normalised text with each word's continuation characters marked,
    a whole chunk of documents at once (no Python work per word)."""

    def __init__(self):
        import numpy as np

        self.np = np
        self.word = _word_characters()
        self.seen = np.zeros(_MARKED_BELOW, dtype=bool)  # characters met inside a word so far

    def __call__(self, text: str) -> str:
        np = self.np
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        codes = codes[codes < _MARK_OFFSET]
        low = codes < _MARKED_BELOW
        word = np.ones(len(codes), dtype=bool)
        word[low] = self.word[codes[low]]
        inside = np.zeros(len(codes), dtype=bool)
        inside[1:] = word[1:] & word[:-1]
        inside &= low
        cont = codes[inside]
        new = np.unique(cont[~self.seen[cont]])
        self.seen[new] = True
        codes[inside] += _MARK_OFFSET
        # Every character also enters the alphabet as a word's first, as in WordPiece's
        # own trainer: once, as a word of one character (which adds no pair to count).
        return codes.tobytes().decode("utf-32-le") + "".join(" " + chr(c) for c in new.tolist())


def _unmark(piece: str) -> str:
    """A piece learned on marked words, in WordPiece's spelling: ``##`` first
    when it starts inside a word."""
    plain = "".join(chr(ord(c) - _MARK_OFFSET) if ord(c) >= _MARK_OFFSET else c for c in piece)
    return "##" + plain if ord(piece[0]) >= _MARK_OFFSET else plain


def _train_wordpiece(tok, texts: Iterator[str], vocab_size: int, min_frequency: int, specials: list[str]) -> None:
    """Learn ``tok``'s WordPiece vocabulary, the same on every run over the same texts.

    ``tokenizers``' own ``WordPieceTrainer`` is BPE whose ``##`` pieces are numbered
    in hash-map order as it meets them, and equal merge counts are decided by
    those numbers, so two runs over one corpus can keep different pieces
    (huggingface/tokenizers#1794, open at 0.23). Here every word's continuation
    characters are written as private-use characters before the same BPE trainer
    runs (with BERT's pre-tokenizer, which keeps them inside their words), so they
    belong to its alphabet, which it numbers in sorted order, and each learned
    piece is spelled back the WordPiece way."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    mark, normalize = _ContinuationMarker(), tok.normalizer.normalize_str

    def marked_chunks() -> Iterator[str]:
        chunk, size = [], 0
        for text in texts:
            chunk.append(text)
            size += len(text)
            if size >= _MARK_CHUNK_CHARS:
                yield mark(normalize("\n".join(chunk)))
                chunk, size = [], 0
        if chunk:
            yield mark(normalize("\n".join(chunk)))

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    bpe.train_from_iterator(marked_chunks(), trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials, show_progress=False))
    special = set(specials)
    vocab = {(p if p in special else _unmark(p)): i for p, i in bpe.get_vocab().items()}
    tok.model = models.WordPiece(vocab, unk_token=UNK_TOKEN, continuing_subword_prefix="##")
    tok.add_special_tokens(specials)


# The Unigram trainer gives each character it adds to cover the alphabet the
# lowest score plus this much per character before it.
_ADDED_CHARACTER_STEP = 1e-4
_SCORE_DECIMALS = 6


def _settle_unigram(tok, n_special: int) -> None:
    """Make ``tok``'s trained Unigram model the same on every run over the same texts.

    ``tokenizers``' Unigram trainer counts words in a hash map, so its sums run in a
    different order each run (scores differ in the last bits) and the characters
    it adds to cover the alphabet come in hash order. Scores are rounded to 1e-6
    (far below any difference that changes a segmentation); the single characters
    on the lowest steps (the added run, steps 1, 2, ... above the lowest score, and
    every single character at that score, among which the run's first) take those
    same scores in code point order; pieces are ordered by score, then spelling."""
    import json

    from tokenizers import models

    model = json.loads(tok.to_str())["model"]
    head, pieces = model["vocab"][:n_special], model["vocab"][n_special:]
    if not pieces:  # no text to learn from: the packing that follows says so, naming the data
        return
    low = min(score for _, score in pieces)
    steps = {}
    for piece, score in pieces:
        j = (score - low) / _ADDED_CHARACTER_STEP
        if len(piece) == 1 and abs(j - round(j)) < 1e-6:
            steps[piece] = round(j)
    # The added run is the unbroken stretch of steps from the lowest score up; a trained
    # piece that happens to fall on the grid higher up is left as it is.
    top, taken = 0, set(steps.values())
    while top + 1 in taken:
        top += 1
    run = sorted(p for p, j in steps.items() if j <= top)
    order = dict(zip(run, sorted(j for j in steps.values() if j <= top)))
    pieces = [(p, low + order[p] * _ADDED_CHARACTER_STEP if p in order else s) for p, s in pieces]
    pieces = sorted(((p, round(s, _SCORE_DECIMALS)) for p, s in pieces), key=lambda ps: (-ps[1], ps[0]))
    tok.model = models.Unigram([tuple(ps) for ps in head] + pieces, model["unk_id"], model["byte_fallback"])


def tokenizer_family(tokenizer_dir: str | os.PathLike) -> str:
    """``bpe``, ``wordpiece`` or ``unigram``: the model type in ``tokenizer.json``."""
    import json

    path = Path(tokenizer_dir) / "tokenizer.json"
    try:
        kind = json.loads(path.read_text(encoding="utf-8"))["model"]["type"]
    except (OSError, ValueError, KeyError) as e:
        raise FileNotFoundError(f"{path}: not a readable Hugging Face tokenizer file ({e})") from None
    return {"BPE": "bpe", "WordPiece": "wordpiece", "Unigram": "unigram"}.get(kind, kind.lower())


def check_tokenizer(tokenizer_dir: str | os.PathLike, tokenizer_type: str, required: list[str] = ()) -> None:
    """Refuse a given tokenizer folder whose family is not ``tokenizer_type`` or that
    lacks tokens the stage needs, naming the settings involved."""
    family = tokenizer_family(tokenizer_dir)
    if family != tokenizer_type:
        raise ValueError(f"tokenizer: {tokenizer_dir} holds a {family} tokenizer but tokenizer_type is "
                         f"{tokenizer_type!r}; set tokenizer_type={family} or train a new one (tokenizer unset)")
    if required:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        missing = [t for t in required if tok.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer: {tokenizer_dir} lacks the special tokens {missing} this stage needs; "
                             f"leave tokenizer unset to train one")


def _inline_chat_template(out: Path) -> None:
    """Keep the chat template inside ``tokenizer_config.json`` (older
    ``transformers`` releases and other runtimes only look there); newer
    releases also read the ``chat_template.jinja`` file written next to it."""
    import json

    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if "chat_template" not in cfg:
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(tokenizer_dir: str | os.PathLike):
    """The saved tokenizer as ``transformers`` loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
