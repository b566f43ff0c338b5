"""The tokenizer the benchmark builds prompts and counts tokens with, and how it is found.

The harness needs only four things from a tokenizer (encode, decode, vocabulary size, special ids), so it
depends on this small protocol; `load_tokenizer` adapts a Hugging Face tokenizer directory to it. Loading
is offline: a local directory, or a hub id already in the local cache, never a download, so a benchmark
host without internet behaves the same as one with it.

Without --tokenizer, `resolve_tokenizer` finds the model's own: the model name as a directory or cached
hub id, the embedded model's checkpoint for its served name (what `pdserve serve` serves by default),
else the path the server says it loaded the model from (`fetch_model_root`, vLLM's /v1/models `root`).
`find_tokenizer` is what the CLI calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pdserve.errors import ModelPreparationError
from pdserve.models import EMBEDDED_SERVED_NAME, EMBEDDED_SOURCE, resolve_model


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


class TokenizerNotFoundError(ValueError):
    """No tokenizer for a model could be loaded offline; the message says what was tried."""


def resolve_tokenizer(model: str, server_root: str | None = None, *, trust_remote_code: bool = False,
                      cache_dir: Path | None = None) -> HFTokenizer:
    """The tokenizer of the served model `model`, found offline. Tried in order:

    1. `model` itself: a local directory, or a hub id in the local Hugging Face cache;
    2. the embedded model's checkpoint when `model` is its served name (or "embedded"), located or
       converted once into `cache_dir` (default: the user cache) exactly as `pdserve serve` does;
    3. `server_root`, where the server loaded the model from (vLLM's /v1/models `root`).
    """
    candidates: list[Callable[[], str]] = [lambda: model]
    if model in (EMBEDDED_SERVED_NAME, EMBEDDED_SOURCE):
        candidates.append(lambda: resolve_model(EMBEDDED_SOURCE, cache_dir).path)
    if server_root and server_root != model:
        candidates.append(lambda: server_root)
    failures = []
    for candidate in candidates:
        try:
            source = candidate()
        except ModelPreparationError as exc:
            failures.append(f"the embedded model: {exc}")
            continue
        try:
            return load_tokenizer(source, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            failures.append(_why_not(source, exc))
    raise TokenizerNotFoundError(
        f"no tokenizer found offline for model {model!r} ({'; '.join(failures)}); pass a local "
        "tokenizer directory (or a hub id in the local Hugging Face cache) with --tokenizer")


def _why_not(source: str, exc: ValueError) -> str:
    if Path(source).is_dir():
        return f"{source}: {exc.__cause__ or exc}"
    return f"{source!r} is neither a local directory nor a hub id in the local Hugging Face cache"


async def find_tokenizer(model: str, base_url: str, *, explicit: str | None = None,
                         api_key: str | None = None, trust_remote_code: bool = False) -> HFTokenizer:
    """The benchmark's tokenizer: `explicit` (--tokenizer) as given; else the model's own, found
    offline (`resolve_tokenizer`), the server at `base_url` asked where it loaded the model from only
    when nothing local fits."""
    if explicit:
        return load_tokenizer(explicit, trust_remote_code=trust_remote_code)
    try:
        return resolve_tokenizer(model, trust_remote_code=trust_remote_code)
    except TokenizerNotFoundError:
        root = await fetch_model_root(base_url, model, api_key)
        if root is None:
            raise
        return resolve_tokenizer(model, root, trust_remote_code=trust_remote_code)


async def fetch_model_root(base_url: str, model: str, api_key: str | None = None,
                           timeout_s: float = 10.0) -> str | None:
    """Where the server loaded `model` from, as vLLM's /v1/models says (`root`: the path or hub id
    given to `vllm serve`); None when the server does not say (pdserve's does not) or cannot be
    asked. Only a hint: the benchmark goes on without it."""
    from pdserve.bench.server_info import list_models  # the bench extra (aiohttp)

    try:
        cards = await list_models(base_url, api_key, timeout_s)
    except ConnectionError:
        return None
    for card in cards:
        if card.get("id") == model:
            root = card.get("root")
            return root if isinstance(root, str) and root else None
    return None
