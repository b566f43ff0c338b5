"""A tiny word-level tokenizer with a chat template, built in memory (no files, no hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(words: int = 512) -> Any:
    """A `PreTrainedTokenizerFast` whose vocabulary is special tokens + w0..wN + common words.

    Unknown words map to <unk>, so any text tokenizes; lengths are one token per word.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    common = ["hello", "world", "the", "a", "say", "user", "assistant", "system", "count", "to"]
    vocab = {tok: i for i, tok in enumerate(specials + common + [f"w{i}" for i in range(words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                  eos_token="<|im_end|>", bos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def save_tiny_model(path: Path) -> Path:
    """A model directory the mock engine serves: the tiny tokenizer and a Llama config.json,
    no weights. Returns `path`."""
    path = Path(path)
    tiny_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path
