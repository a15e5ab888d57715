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
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=specials, show_progress=False)
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
    tok.train_from_iterator(texts, trainer=trainer)
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
