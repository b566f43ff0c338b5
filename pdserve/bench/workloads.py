"""Benchmark workloads: the requests a run sends, built deterministically from a seed.

Lifecycle: a caller picks a workload (random lengths, a synthetic shape, or a Mooncake trace), draws
input/output lengths with a seeded `numpy.random.Generator`, turns each input length into a prompt
(random token ids, optionally decoded to text through a tokenizer) and gets back a list of frozen
`BenchRequest` values. Nothing here touches the network or the clock, so the same seed always gives the
same requests, and a sweep can replay one workload at many request rates.

Prompts are built like `vllm bench serve --dataset-name random`: random token ids are decoded to text and
re-encoded until the token count matches, because servers receive text and tokenize it themselves.
Token-id prompts (`PromptFormat.TOKEN_IDS`) skip that round trip and hit exact lengths, for
/v1/completions only.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.tokenizer import PromptTokenizer

# Mooncake traces hash prompts in blocks of 512 tokens (kvcache-ai/Mooncake, FAST25-release/README).
MOONCAKE_BLOCK_TOKENS = 512
# vllm's gen_prompt_decode_to_target_len gives up after 10 decode/encode rounds; so do we.
_MAX_RETOKENIZE_ROUNDS = 10


class PromptFormat(enum.Enum):
    """How a prompt travels: as text (the server tokenizes) or as token ids (/v1/completions only)."""

    TEXT = "text"
    TOKEN_IDS = "token-ids"


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload.

    `prompt_len` is the prompt's length in tokens as our tokenizer counts it (the server may add a BOS);
    `arrival_s` is set only for trace replay: seconds after the trace's first request.
    """

    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int
    arrival_s: float | None = None


@dataclass(frozen=True, slots=True)
class UniformLengths:
    """Integer lengths drawn uniformly from [low, high], both inclusive (low == high: fixed)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low} high={self.high}")

    @classmethod
    def from_range_ratio(cls, length: int, range_ratio: float) -> UniformLengths:
        """vllm's `--random-range-ratio`: uniform on [floor(L*(1-r)), ceil(L*(1+r))], r in [0, 1)."""
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
        low = max(1, math.floor(length * (1.0 - range_ratio)))
        high = max(low, math.ceil(length * (1.0 + range_ratio)))
        return cls(low, high)

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=count)


@dataclass(frozen=True, slots=True)
class LogNormalLengths:
    """Lengths from a log-normal with a published median and mean, clipped to [low, high].

    mu = ln(median); sigma is solved so that the *clipped* distribution has the published mean (an
    unclipped fit, sigma = sqrt(2 ln(mean/median)), would lose a few percent of its mean to the clip).
    Median and mean are the two numbers papers and trace READMEs actually report, so each shape below
    cites exactly what it is fitted to.
    """

    median: float
    mean: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 < self.median <= self.mean:
            raise ValueError(f"need 0 < median <= mean, got median={self.median} mean={self.mean}")
        if not 1 <= self.low <= self.median <= self.high:
            raise ValueError(f"need 1 <= low <= median <= high, got {self.low}, {self.median}, {self.high}")
        _solve_sigma(self.median, self.mean, self.low, self.high)  # fail at construction if unreachable

    @property
    def sigma(self) -> float:
        return _solve_sigma(self.median, self.mean, self.low, self.high)

    def scaled(self, factor: float) -> LogNormalLengths:
        """The same shape with every length multiplied by `factor` (small models, CPU runs)."""
        low = max(1, round(self.low * factor))
        median = max(float(low), self.median * factor)
        return LogNormalLengths(
            median, max(median, self.mean * factor), low, max(low, round(self.high * factor))
        )

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        draws = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=count)
        return np.clip(np.rint(draws), self.low, self.high).astype(np.int64)


def _clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[clip(X, low, high)] for ln X ~ N(mu, sigma^2), in closed form."""

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
    middle = math.exp(mu + sigma**2 / 2.0) * (cdf(b - sigma) - cdf(a - sigma))
    return low * cdf(a) + middle + high * (1.0 - cdf(b))


@functools.lru_cache(maxsize=256)
def _solve_sigma(median: float, mean: float, low: int, high: int) -> float:
    """The smallest sigma whose clipped log-normal has `mean`: scan up, then bisect the crossing."""
    mu = math.log(median)
    if mean <= median * (1.0 + 1e-9):
        return 1e-6
    step, previous = 0.05, 1e-6
    for index in range(1, 101):  # sigma up to 5: wider than any published length distribution
        sigma = index * step
        if _clipped_lognormal_mean(mu, sigma, low, high) >= mean:
            for _ in range(50):
                middle = (previous + sigma) / 2.0
                if _clipped_lognormal_mean(mu, middle, low, high) >= mean:
                    sigma = middle
                else:
                    previous = middle
            return sigma
        previous = sigma
    raise ValueError(f"no log-normal clipped to [{low}, {high}] has median {median} and mean {mean}")


LengthDistribution = UniformLengths | LogNormalLengths


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """A named synthetic workload: input and output length distributions and where they come from."""

    name: str
    input_lengths: LogNormalLengths
    output_lengths: LogNormalLengths
    source: str


# Where the shape statistics come from. The Azure LLM inference trace 2023 (Patel et al., "Splitwise",
# ISCA'24; github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_{conv,code}.csv) is the trace
# DistServe-style P/D studies use. The paper reports medians (conversation: 1,020 prompt / 129 output
# tokens; code: 1,500 / 13); the means and p99s below are statistics of the released CSVs (as computed in
# a public workload survey of those files). Each shape is a log-normal through the median, clipped at the
# trace's p99 (so no request is longer than the trace's 99th percentile), with sigma solved so that the
# clipped distribution keeps the trace's mean (see LogNormalLengths).
#
# Conversation CSV (19,366 requests): context median 1,020, mean 1,155, p99 4,142; generated median 129,
# mean 211, p99 601. For scale, the chat datasets most benchmarks use have far shorter prompts: about
# 94 user / 348 assistant tokens per turn for ShareGPT and 70 / 216 for LMSYS-Chat-1M (WildChat paper,
# ICLR'24, Table 1), which is why they exercise decode far more than prefill.
CHAT = WorkloadShape(
    name="chat",
    input_lengths=LogNormalLengths(median=1020, mean=1155, low=4, high=4142),
    output_lengths=LogNormalLengths(median=129, mean=211, low=1, high=601),
    source="Azure LLM inference trace 2023, conversation (Splitwise, ISCA'24)",
)

# Code CSV (8,819 requests): context median 1,469 (the paper rounds to 1,500), mean 2,048, p99 7,436;
# generated median 13, mean 28, p99 249. Code completion is prefill-heavy: long context, a few words out.
CODE = WorkloadShape(
    name="code",
    input_lengths=LogNormalLengths(median=1469, mean=2048, low=4, high=7436),
    output_lengths=LogNormalLengths(median=13, mean=28, low=1, high=249),
    source="Azure LLM inference trace 2023, code (Splitwise, ISCA'24)",
)

# Long-context, summarization-like traffic: the Mooncake conversation trace (Qin et al., "Mooncake",
# FAST'25, Table 2: 12,031 requests, average input 12,035 tokens, average output 343; file
# kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl, input median 6,909 and p99 85,399 as
# computed from that file). Two choices are ours, not the trace's: inputs are capped at 32,768 tokens (a
# common context window; pass --max-model-len for shorter ones), and the output median (208, i.e. the
# spread of the Azure conversation outputs: mean / median ~ e^0.5) since the paper gives only the mean.
SUMMARIZATION = WorkloadShape(
    name="summarization",
    input_lengths=LogNormalLengths(median=6909, mean=12035, low=256, high=32768),
    output_lengths=LogNormalLengths(median=208, mean=343, low=1, high=2048),
    source="Mooncake conversation trace (FAST'25), long-context inputs",
)

SHAPES: dict[str, WorkloadShape] = {shape.name: shape for shape in (CHAT, CODE, SUMMARIZATION)}


def draw_lengths(
    input_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    count: int,
    rng: np.random.Generator,
    max_model_len: int | None = None,
) -> list[tuple[int, int]]:
    """(input, output) length pairs; inputs are cut so that input + output fits `max_model_len`.

    Inputs are drawn before outputs, all at once, like vllm's RandomDataset, so a seed gives the same
    inputs whatever the output distribution is.
    """
    inputs = input_lengths.sample(rng, count)
    outputs = output_lengths.sample(rng, count)
    pairs = []
    for input_len, output_len in zip(inputs.tolist(), outputs.tolist(), strict=True):
        if max_model_len is not None:
            output_len = min(output_len, max_model_len - 1)
            input_len = max(1, min(input_len, max_model_len - output_len))
        pairs.append((int(input_len), int(output_len)))
    return pairs


class PromptBuilder:
    """Turns token-id sequences into prompts in the chosen format.

    Holds the tokenizer and the ids random prompts may use (special tokens excluded: a decoded
    `<|endoftext|>` would be re-tokenized as a control token and could end generation early).
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        prompt_format: PromptFormat,
        vocab_size: int | None = None,
    ) -> None:
        if prompt_format is PromptFormat.TEXT and tokenizer is None:
            raise ValueError("text prompts need a tokenizer to turn random token ids into text")
        if tokenizer is None and vocab_size is None:
            raise ValueError("token-id prompts without a tokenizer need vocab_size")
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.allowed_ids = _allowed_token_ids(tokenizer, vocab_size)

    def random_ids(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return self.allowed_ids[rng.integers(0, len(self.allowed_ids), size=count)]

    def random_prompt(self, rng: np.random.Generator, length: int) -> tuple[str | tuple[int, ...], int]:
        """A prompt of `length` tokens; text prompts come back with the length they really re-encode to."""
        token_ids = self.random_ids(rng, length).tolist()
        if self.prompt_format is PromptFormat.TOKEN_IDS:
            return tuple(token_ids), length
        return self._text_of_length(token_ids, length, rng)

    def _text_of_length(self, token_ids: list[int], target: int, rng: np.random.Generator) -> tuple[str, int]:
        """Decode, re-encode, pad or truncate until the text is `target` tokens (vllm's approach).

        Decoding random ids and re-encoding the text merges or splits tokens, so one pass rarely hits
        the target; vllm's gen_prompt_decode_to_target_len repeats up to 10 times, and so do we.
        """
        assert self.tokenizer is not None
        text = self.tokenizer.decode(token_ids)
        for _ in range(_MAX_RETOKENIZE_ROUNDS):
            token_ids = self.tokenizer.encode(text)
            if len(token_ids) == target:
                break
            if len(token_ids) < target:
                token_ids = token_ids + self.random_ids(rng, target - len(token_ids)).tolist()
            else:
                token_ids = token_ids[:target]
            text = self.tokenizer.decode(token_ids)
        return text, len(self.tokenizer.encode(text))


def _allowed_token_ids(tokenizer: PromptTokenizer | None, vocab_size: int | None) -> np.ndarray:
    size = tokenizer.vocab_size if tokenizer is not None else vocab_size
    assert size is not None
    special = set(tokenizer.special_ids) if tokenizer is not None else set()
    allowed = np.array([i for i in range(size) if i not in special], dtype=np.int64)
    if len(allowed) == 0:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    return allowed


def synthetic_requests(
    builder: PromptBuilder,
    input_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    num_prompts: int,
    seed: int,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """Random-token requests with lengths from the given distributions (random and shape datasets)."""
    rng = np.random.default_rng(seed)
    pairs = draw_lengths(input_lengths, output_lengths, num_prompts, rng, max_model_len)
    requests = []
    for input_len, output_len in pairs:
        prompt, prompt_len = builder.random_prompt(rng, input_len)
        requests.append(BenchRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    return requests


def shape_requests(
    builder: PromptBuilder,
    shape: WorkloadShape,
    num_prompts: int,
    seed: int,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """Requests of a named synthetic shape; `length_scale` shrinks it for small models and CPU runs."""
    if length_scale <= 0:
        raise ValueError(f"length scale must be positive, got {length_scale}")
    return synthetic_requests(
        builder,
        shape.input_lengths.scaled(length_scale),
        shape.output_lengths.scaled(length_scale),
        num_prompts,
        seed,
        max_model_len,
    )


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One line of a Mooncake trace: arrival (ms), lengths, and the prompt's 512-token block hashes."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake_trace(path: str | Path, limit: int | None = None) -> list[MooncakeRecord]:
    """Parse a Mooncake-format JSONL trace, stopping after `limit` records."""
    records = []
    for line_number, line in _numbered_lines(Path(path)):
        if limit is not None and len(records) >= limit:
            break
        try:
            row = json.loads(line)
            records.append(
                MooncakeRecord(
                    timestamp_ms=float(row["timestamp"]),
                    input_length=int(row["input_length"]),
                    output_length=int(row["output_length"]),
                    hash_ids=tuple(int(h) for h in row.get("hash_ids", ())),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{line_number}: not a Mooncake trace record ({exc})") from exc
    return records


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as trace:
        for number, line in enumerate(trace, start=1):
            if line.strip():
                yield number, line


def mooncake_requests(
    builder: PromptBuilder,
    records: Sequence[MooncakeRecord],
    seed: int,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[BenchRequest]:
    """Replay a Mooncake trace: requests sharing leading hash_ids share an identical prompt prefix.

    Block `h` always holds the same `block_tokens` token ids (drawn from a generator seeded with
    (seed, h)), and a prompt is the concatenation of its blocks cut to `input_length`, so a prefix cache
    sees exactly the reuse the trace recorded. Text prompts decode the whole id sequence at once:
    decoding is prefix-stable (decode(a + b) starts with decode(a)), so shared blocks give identical
    text prefixes, and unlike per-block decoding no words are glued together at block boundaries. The
    server re-tokenizes that text, so its shared prefix matches the trace's up to the block boundary's
    last few tokens. Arrivals are the trace's timestamps relative to its first record.
    """
    if not records:
        return []
    start_ms = records[0].timestamp_ms
    requests = []
    for index, record in enumerate(records):
        token_ids = np.concatenate(_prompt_blocks(builder, record, index, seed, block_tokens)).tolist()
        if builder.prompt_format is PromptFormat.TOKEN_IDS:
            prompt: str | tuple[int, ...] = tuple(token_ids)
            prompt_len = len(token_ids)
        else:
            assert builder.tokenizer is not None
            prompt = builder.tokenizer.decode(token_ids)
            prompt_len = len(builder.tokenizer.encode(prompt))
        requests.append(
            BenchRequest(
                prompt=prompt,
                prompt_len=prompt_len,
                output_len=max(1, record.output_length),
                arrival_s=(record.timestamp_ms - start_ms) / 1000.0,
            )
        )
    return requests


def _prompt_blocks(
    builder: PromptBuilder, record: MooncakeRecord, index: int, seed: int, block_tokens: int
) -> list[np.ndarray]:
    """The token blocks of one trace record: one per hash id, the last cut to the input length.

    A record longer than its hash ids cover gets tail tokens unique to that record (index-seeded), so
    it shares nothing it should not.
    """
    blocks, remaining = [], max(1, record.input_length)
    for hash_id in record.hash_ids:
        if remaining <= 0:
            break
        block = builder.random_ids(np.random.default_rng((seed, 0, hash_id)), block_tokens)
        blocks.append(block[:remaining])
        remaining -= len(blocks[-1])
    if remaining > 0:
        blocks.append(builder.random_ids(np.random.default_rng((seed, 1, index)), remaining))
    return blocks
