"""The tokenizer the benchmark builds prompts and counts tokens with.

The harness needs only four things from a tokenizer (encode, decode, vocabulary size, special ids), so it
depends on this small protocol; `load_tokenizer` adapts a Hugging Face tokenizer directory to it. Loading
is offline: a local directory, or a hub id already in the local cache, never a download, so a benchmark
host without internet behaves the same as one with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class PromptTokenizer(Protocol):
    """What workloads and metrics need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A transformers tokenizer seen through `PromptTokenizer`; `name` is the path it was loaded from."""

    def __init__(self, hf_tokenizer: Any, name: str) -> None:
        self._tokenizer = hf_tokenizer
        self.name = name
        # len() counts added tokens too; `vocab_size` alone would miss them and they are valid ids.
        self._vocab_size = len(hf_tokenizer)
        self._special_ids = frozenset(int(i) for i in hf_tokenizer.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS: the server adds its own, and vllm bench counts prompt tokens the same way.
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> HFTokenizer:
    """Load a tokenizer from a local directory (or the local HF cache) without touching the network."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # transformers is a core pdserve dependency; this is a broken install
        raise RuntimeError("loading a tokenizer needs the transformers package") from exc
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(
            name_or_path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        hint = "" if Path(name_or_path).is_dir() else " (pass a local tokenizer directory with --tokenizer)"
        raise ValueError(f"cannot load tokenizer {name_or_path!r} offline{hint}: {exc}") from exc
    # Results record this name as tokenizer_id: an absolute path lets other tools load it from anywhere.
    name = str(Path(name_or_path).resolve()) if Path(name_or_path).is_dir() else name_or_path
    return HFTokenizer(hf_tokenizer, name)
