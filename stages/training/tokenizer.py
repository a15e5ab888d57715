"""Byte-level BPE tokenizer for every model stage.

One tokenizer serves pretraining, SFT, reward modelling and PPO/DPO, so its
special tokens cover all of them from the start: end of text (document
separator and generation stop), padding, and the chat roles used by the chat
template. It is saved in the Hugging Face layout (``tokenizer.json`` +
``tokenizer_config.json`` carrying the chat template) so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it with no
conversion step, and the final model folder ships it next to the weights.

Byte-level means every UTF-8 byte has a token, so no input is ever unknown,
and bits per byte stay comparable across tokenizers of different sizes.
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
) -> Path:
    """Train a byte-level BPE on ``source`` and save it to ``out_dir`` in the
    Hugging Face layout. Returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover the 256 bytes and {len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,  # ids 0..5, identical across runs
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = iter_texts(source, max_docs=max_docs)
    if is_text_file(source):
        # One huge document trains slowly and its pre-tokenisation holds it all
        # in memory at once; lines are the natural unit for a text file.
        texts = (line for doc in texts for line in doc.splitlines(keepends=True))
    tok.train_from_iterator(texts, trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[2:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    _inline_chat_template(out)
    return out


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
