"""Workload generators: length distributions, prompt building, determinism, Mooncake prefix sharing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.tokenizer import HFTokenizer, load_tokenizer
from pdserve.bench.workloads import (
    CHAT,
    SHAPES,
    LogNormalLengths,
    PromptBuilder,
    PromptFormat,
    UniformLengths,
    draw_lengths,
    mooncake_requests,
    read_mooncake_trace,
    shape_requests,
    synthetic_requests,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def words(word_tokenizer_dir: Path) -> HFTokenizer:
    return load_tokenizer(str(word_tokenizer_dir))


def test_range_ratio_matches_vllm_bounds() -> None:
    assert UniformLengths.from_range_ratio(100, 0.5) == UniformLengths(50, 150)
    assert UniformLengths.from_range_ratio(10, 0.25) == UniformLengths(7, 13)  # floor 7.5, ceil 12.5
    assert UniformLengths.from_range_ratio(64, 0.0) == UniformLengths(64, 64)
    with pytest.raises(ValueError):
        UniformLengths.from_range_ratio(100, 1.0)


def test_uniform_lengths_cover_the_whole_range() -> None:
    samples = UniformLengths(50, 150).sample(np.random.default_rng(0), 20_000)
    assert samples.min() == 50 and samples.max() == 150
    assert samples.mean() == pytest.approx(100, rel=0.01)


ALL_LENGTHS = [d for shape in SHAPES.values() for d in (shape.input_lengths, shape.output_lengths)]


@pytest.mark.parametrize("lengths", ALL_LENGTHS)
def test_lognormal_shapes_reproduce_their_cited_median_and_mean(lengths: LogNormalLengths) -> None:
    samples = lengths.sample(np.random.default_rng(1), 50_000)
    assert np.median(samples) == pytest.approx(lengths.median, rel=0.03)
    assert samples.mean() == pytest.approx(lengths.mean, rel=0.04)
    assert samples.min() >= lengths.low and samples.max() <= lengths.high


def test_every_shape_is_documented_and_scalable() -> None:
    assert set(SHAPES) == {"chat", "code", "summarization"}
    for shape in SHAPES.values():
        assert shape.source
        half = shape.input_lengths.scaled(0.5)
        assert half.median == pytest.approx(shape.input_lengths.median / 2)
        assert half.sigma == pytest.approx(shape.input_lengths.sigma, rel=0.02)


def test_unreachable_mean_is_rejected() -> None:
    with pytest.raises(ValueError):
        LogNormalLengths(median=100, mean=900, low=1, high=200)  # the clip caps the mean below 900


def test_max_model_len_bounds_prompt_plus_output() -> None:
    pairs = draw_lengths(
        UniformLengths(900, 1100), UniformLengths(100, 300), 200, np.random.default_rng(0), 1024
    )
    assert all(i + o <= 1024 and i >= 1 for i, o in pairs)


def test_text_prompts_hit_the_target_length_and_avoid_special_tokens(words: HFTokenizer) -> None:
    builder = PromptBuilder(words, PromptFormat.TEXT)
    requests = synthetic_requests(builder, UniformLengths(5, 40), UniformLengths(3, 3), 50, seed=0)
    for request in requests:
        assert isinstance(request.prompt, str)
        ids = words.encode(request.prompt)
        assert len(ids) == request.prompt_len and 5 <= request.prompt_len <= 40
        assert not set(ids) & words.special_ids
        assert request.output_len == 3


def test_token_id_prompts_are_exact(words: HFTokenizer) -> None:
    builder = PromptBuilder(words, PromptFormat.TOKEN_IDS)
    requests = synthetic_requests(builder, UniformLengths(16, 16), UniformLengths(4, 8), 10, seed=0)
    assert all(isinstance(r.prompt, tuple) and len(r.prompt) == r.prompt_len == 16 for r in requests)


def test_token_ids_without_a_tokenizer_need_a_vocab_size() -> None:
    builder = PromptBuilder(None, PromptFormat.TOKEN_IDS, vocab_size=1000)
    assert max(builder.random_ids(np.random.default_rng(0), 500)) < 1000
    with pytest.raises(ValueError):
        PromptBuilder(None, PromptFormat.TEXT, vocab_size=1000)


def test_bpe_text_prompts_report_the_length_they_really_encode_to(bpe_tokenizer_dir: Path) -> None:
    bpe = load_tokenizer(str(bpe_tokenizer_dir))
    requests = synthetic_requests(
        PromptBuilder(bpe, PromptFormat.TEXT), UniformLengths(30, 30), UniformLengths(1, 1), 20, seed=0
    )
    lengths = [len(bpe.encode(r.prompt)) for r in requests]
    assert lengths == [r.prompt_len for r in requests]
    assert np.mean(lengths) == pytest.approx(30, abs=3)


def test_same_seed_same_requests(words: HFTokenizer) -> None:
    builder = PromptBuilder(words, PromptFormat.TEXT)
    first = shape_requests(builder, CHAT, 20, seed=5, length_scale=0.02)
    assert first == shape_requests(builder, CHAT, 20, seed=5, length_scale=0.02)
    assert first != shape_requests(builder, CHAT, 20, seed=6, length_scale=0.02)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    return path


TRACE = [
    {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 4]},
    {"timestamp": 4000, "input_length": 600, "output_length": 5, "hash_ids": [5, 6]},
    {"timestamp": 4000, "input_length": 700, "output_length": 5, "hash_ids": [1]},
]


def test_mooncake_shared_hash_ids_give_identical_token_prefixes(tmp_path: Path, words: HFTokenizer) -> None:
    records = read_mooncake_trace(_write_trace(tmp_path / "trace.jsonl", TRACE))
    requests = mooncake_requests(PromptBuilder(words, PromptFormat.TOKEN_IDS), records, seed=0)
    a, b, c, d = (r.prompt for r in requests)
    assert [len(p) for p in (a, b, c, d)] == [1200, 1100, 600, 700]
    assert a[:1024] == b[:1024]  # blocks 1 and 2 shared
    assert a[1024:1100] != b[1024:1100]  # block 3 vs block 4
    assert c[:512] != a[:512]
    assert d[:512] == a[:512] and d[512:] != a[512:700]  # past its one hash id, d's tail is its own
    assert [r.arrival_s for r in requests] == [0.0, 0.5, 3.0, 3.0]
    assert [r.output_len for r in requests] == [10, 20, 5, 5]


def test_mooncake_text_prompts_share_text_prefixes(tmp_path: Path, words: HFTokenizer) -> None:
    records = read_mooncake_trace(_write_trace(tmp_path / "trace.jsonl", TRACE), limit=2)
    first, second = mooncake_requests(PromptBuilder(words, PromptFormat.TEXT), records, seed=0)
    ids = mooncake_requests(PromptBuilder(words, PromptFormat.TOKEN_IDS), records, seed=0)[0].prompt
    shared_text = words.decode(list(ids[:1024]))  # the two shared 512-token blocks
    assert first.prompt.startswith(shared_text) and second.prompt.startswith(shared_text)
    assert first.prompt_len == 1200 and second.prompt_len == 1100


def test_mooncake_prompts_depend_on_the_seed(tmp_path: Path, words: HFTokenizer) -> None:
    records = read_mooncake_trace(_write_trace(tmp_path / "trace.jsonl", TRACE), limit=1)
    builder = PromptBuilder(words, PromptFormat.TOKEN_IDS)
    assert mooncake_requests(builder, records, seed=0) == mooncake_requests(builder, records, seed=0)
    assert mooncake_requests(builder, records, seed=0) != mooncake_requests(builder, records, seed=1)


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TRACE[0]) + "\n" + json.dumps({"timestamp": 3}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_mooncake_trace(path)


def test_load_tokenizer_refuses_missing_paths_without_downloading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="offline"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))
