"""The serving arms the GPU proof compares, by name, and what is read from them.

An arm is a deployment on one host: `xPyD` (pdserve, x prefill + y decode engines, KV over NCCL;
`xPyD-grpc` over gRPC, `xPyD-ipc` by CUDA IPC copies between engines of one node; `-adaptive`
after either: `pdserve serve --adaptive`, decode engines also prefill while the prefill pool is
behind, routing against the SLO targets, TPOT 10 ms unless named `-adaptive-20ms`),
`colocated-N` (pdserve, N colocated engines) or `vllm-N` (N plain vLLM servers, behind
pdserve.bench.rr_proxy from two on; one is reached directly, as a client of `vllm serve` would);
issue 9's two-GPU names stay (`disagg` = 1P1D, `colocated` =
colocated-2, `vllm` = vllm-2). Every arm serves with the same engine settings (`ENGINE`). This
module names arms (`arm_spec`), builds the commands that serve them (`serve_command`,
`vllm_command`, `proxy_command`), scores a rate's requests (`per_request`, `attainment`) and reads
the engines' counters from /metrics text (`engine_counters`) and the decode engine's pull log
(`pulls_from_log`). `benchmarks/gpu/proof.py` starts the processes and sends the
load; pdserve.bench.arm_summary tables the records.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Issue 9's workload (records without a workload of their own are this one: pdserve.bench.grid's
# `isl2k`) and the TPOT targets its records scored.
ISL, OSL = 2048, 256
TTFT_MS = 500.0
LEGACY_TPOT_TARGETS_MS = (8.0, 10.0, 20.0)
# Issue 31's TPOT targets, scored on every workload of the grid.
TPOT_TARGETS_MS = (8.0, 10.0, 15.0, 20.0)
ATTAINMENT = 0.90
# One set of engine settings for every arm and every workload (recorded in each arm's JSON), so one
# started arm serves every workload of pdserve.bench.grid. 8192 batched tokens is vLLM's own default
# for its OpenAI server on these GPUs; CUDA graphs and chunked prefill on. max_model_len 34816 =
# 32768 + 2048: the Mooncake-shaped workload's longest prompt and output uncut (the 16k workload
# needs 16640); it costs no KV (vLLM sizes the cache by memory, not by this) and only a longer block
# table per request. Issue 9's records (2026-11-26 .. 11-29) ran with 4096.
ENGINE = {
    "load_format": "dummy",
    "dtype": "bfloat16 (from config.json)",
    "max_model_len": 34816,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "gpu_memory_utilization": 0.9,
    "enforce_eager": False,
    "enable_chunked_prefill": True,
    "enable_prefix_caching": True,
    "seed": 0,
}
# Total request rates (req/s over the arm's GPUs) of issue 9's arms, bracketing each arm's knee from the H200
# calibration (one vLLM engine meets TPOT p90 8 ms near 4 req/s and saturates near 14; 1P1D is
# prefill-bound near 22) and a first colocated sweep on 2 x H200 (knees at 9-12, 12-16, 16-20).
RATES = {
    "disagg": [10, 14, 18, 22, 26],
    "colocated": [6, 9, 12, 16, 20],
    "vllm": [6, 9, 12, 16, 20],
}
ARMS = tuple(RATES)
LABELS = {
    "disagg": "pdserve 1P1D (NCCL)",
    "colocated": "pdserve colocated x2",
    "vllm": "2 x vLLM + round robin",
}
LEGACY_NAMES = {"disagg": "1P1D", "colocated": "colocated-2", "vllm": "vllm-2"}
_ARM_NAME = re.compile(
    r"^(?:(\d+)P(\d+)D(?:-(grpc|nccl|ipc|cuda_ipc))?(-adaptive(?:-(\d+)ms)?)?|(colocated|vllm)-(\d+))$")
_TRANSPORTS = {None: "nccl", "nccl": "nccl", "grpc": "grpc", "ipc": "cuda_ipc", "cuda_ipc": "cuda_ipc"}
_TRANSPORT_LABELS = {"nccl": "NCCL", "grpc": "gRPC", "cuda_ipc": "CUDA IPC"}
_TRANSPORT_SUFFIXES = {"nccl": "", "grpc": "-grpc", "cuda_ipc": "-ipc"}
# Arm kinds served by pdserve (the candidates for a table's best pdserve arm).
PDSERVE_KINDS = ("disagg", "colocated")
# The TPOT target an adaptive arm routes against when its name gives none (its TTFT target is
# its first workload's).
ADAPTIVE_TPOT_MS = 10.0


@dataclass(frozen=True, slots=True)
class ArmSpec:
    """What an arm name means: its kind and engine counts."""

    name: str
    kind: str  # "disagg" | "colocated" | "vllm"
    prefill: int = 0
    decode: int = 0
    engines: int = 0
    transport: str = "nccl"  # disaggregated arms: how the KV moves (`2P2D-grpc`, `1P1D-ipc`)
    adaptive: bool = False  # disaggregated arms: decode engines also prefill (`1P1D-adaptive`)
    route_tpot_ms: float = ADAPTIVE_TPOT_MS  # the TPOT an adaptive arm routes against

    @property
    def num_gpus(self) -> int:
        return self.prefill + self.decode if self.kind == "disagg" else self.engines

    @property
    def label(self) -> str:
        if self.name in LABELS:
            return LABELS[self.name]
        if self.kind == "disagg":
            how = _TRANSPORT_LABELS[self.transport] + (", adaptive" if self.adaptive else "")
            return f"pdserve {self.prefill}P{self.decode}D ({how})"
        if self.kind == "colocated":
            return f"pdserve colocated x{self.engines}"
        return f"{self.engines} x vLLM + round robin"

    @property
    def pdserve(self) -> bool:
        return self.kind in PDSERVE_KINDS

    @property
    def canonical(self) -> str:
        """One name per deployment, for tables that join records of several sessions: issue 9's
        names as their xPyD / colocated-N / vllm-N, `-nccl` dropped, `-cuda_ipc` as `-ipc`."""
        if self.kind == "disagg":
            suffix = _TRANSPORT_SUFFIXES[self.transport] + (self._adaptive_suffix if self.adaptive else "")
            return f"{self.prefill}P{self.decode}D{suffix}"
        return f"{self.kind}-{self.engines}"

    @property
    def _adaptive_suffix(self) -> str:
        if self.route_tpot_ms == ADAPTIVE_TPOT_MS:
            return "-adaptive"
        return f"-adaptive-{self.route_tpot_ms:g}ms"


def arm_spec(name: str) -> ArmSpec:
    """Parses an arm name (`2P2D`, `1P1D-ipc`, `1P1D-adaptive-20ms`, `colocated-4`, `vllm-4`, or
    issue 9's `disagg`/...)."""
    match = _ARM_NAME.match(LEGACY_NAMES.get(name, name))
    if match is None:
        raise argparse.ArgumentTypeError(
            f"arm {name!r}: expected xPyD (or xPyD-grpc, xPyD-ipc; then -adaptive[-Tms]), "
            f"colocated-N, vllm-N, or one of {', '.join(LEGACY_NAMES)}")
    prefill, decode, transport, adaptive, tpot, kind, engines = match.groups()
    if kind is None:
        spec = ArmSpec(name, "disagg", int(prefill), int(decode), transport=_TRANSPORTS[transport],
                       adaptive=bool(adaptive),
                       route_tpot_ms=float(tpot) if tpot else ADAPTIVE_TPOT_MS)
    else:
        spec = ArmSpec(name, kind, engines=int(engines))
    if spec.num_gpus < 1 or (spec.kind == "disagg" and min(spec.prefill, spec.decode) < 1):
        raise argparse.ArgumentTypeError(f"arm {name!r}: needs at least one engine of each kind")
    return spec


_PULL_LOG = re.compile(r"pulled (\d+) blocks \(([\d.]+) MiB\) in ([\d.]+) ms")
# The engines' first-output histogram, per pool: the engine's share of TTFT, per leg.
_FIRST_OUTPUT = "pdserve_engine_time_to_first_output_seconds"
_FRONTEND_TTFT = "pdserve_time_to_first_token_seconds"
# vLLM's own timings inside pdserve's engines, per pool (counters `vllm_ttft_count_colocated`, ...).
_ENGINE_TIMINGS = {"vllm_ttft": "pdserve_engine_vllm_time_to_first_token_seconds",
                   "queue": "pdserve_engine_queue_time_seconds",
                   "prefill": "pdserve_engine_prefill_time_seconds"}
# The same timings on plain `vllm serve`'s /metrics (counters `vllm_ttft_count`, ...).
_VLLM_TIMINGS = {"vllm_ttft": "vllm:time_to_first_token_seconds",
                 "queue": "vllm:request_queue_time_seconds",
                 "prefill": "vllm:request_prefill_time_seconds"}
TIMINGS = tuple(_ENGINE_TIMINGS)
_FIRST_OUTPUT_LE = ("0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.5")
POOLS = ("prefill", "decode", "colocated")


# The mock engine's timings for CPU runs of the scripts, after one H200 (Llama-8B shape): prefill
# ~40k tokens/s, a decode step of 6 ms plus 27 us per running request (5.0 ms at batch 1, 8.5 at
# 128), 50,000 blocks of 16 tokens (~800k tokens: ~100 GiB of KV at 128 KiB per token).
_MOCK_ENGINE = {"prefill_tokens_per_s": 40000, "decode_step_s": 0.006, "decode_step_per_seq_s": 0.000027,
                "num_kv_blocks": 50000}


def pdserve_args(model: str, mock: bool, knobs: bool = True) -> list[str]:
    """`pdserve serve` flags for ENGINE (or the mock engine when testing the script on a CPU);
    without `knobs`, those `pdserve bench tune` sets per candidate (max_num_seqs and, on real
    engines, max_num_batched_tokens) are left out."""
    seqs = ["--max-num-seqs", str(ENGINE["max_num_seqs"])] if knobs else []
    if mock:
        timings = {"max_model_len": ENGINE["max_model_len"], **_MOCK_ENGINE}
        return ["--model", model, "--engine", "mock", "--served-model-name", "m", *seqs,
                *(arg for key, value in timings.items() for arg in ("--set", f"engine.mock.{key}={value}")),
                *(arg for pool in ("prefill", "decode", "colocated")
                  for arg in ("--set", f"pools.{pool}.num_cpus=0.1"))]
    return [
        "--model", model, "--served-model-name", "m", "--load-format", "dummy",
        "--max-model-len", str(ENGINE["max_model_len"]), *seqs,
        *(["--set", f"engine.max_num_batched_tokens={ENGINE['max_num_batched_tokens']}"] if knobs else []),
        "--set", f"engine.gpu_memory_utilization={ENGINE['gpu_memory_utilization']}",
        "--set", "engine.enforce_eager=false", "--set", "engine.enable_prefix_caching=true",
        "--set", f"engine.seed={ENGINE['seed']}",
    ]  # fmt: skip


def vllm_command(model: str, port: int) -> list[str]:
    """A plain vLLM OpenAI server with ENGINE's settings (chunked prefill is vLLM v1's default)."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", "m", "--load-format", "dummy", "--port", str(port),
        "--max-model-len", str(ENGINE["max_model_len"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
        "--gpu-memory-utilization", str(ENGINE["gpu_memory_utilization"]),
        "--enable-prefix-caching", "--seed", str(ENGINE["seed"]),
    ]  # fmt: skip


def serve_command(spec: ArmSpec, model: str, mock: bool, gpus: list[str], port: int,
                  step_trace_root: Path | str | None = None,
                  slo_ms: tuple[float, float] | None = None,
                  settings: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """`pdserve serve` of a pdserve arm (xPyD or colocated-N) on the first
    `spec.num_gpus` of `gpus` (CUDA device ids), and the environment it needs. With
    `step_trace_root` every engine writes its steps to ROOT/ARM-steps/ (for the record). An
    adaptive xPyD routes against `slo_ms` (TTFT, TPOT), as `pdserve bench tune` serves one.
    `settings` (KEY=VALUE) go to `pdserve serve --set` after the arm's own."""
    if spec.kind == "disagg":
        mode = ["--mode", "disaggregated", "--prefill", str(spec.prefill), "--decode", str(spec.decode),
                "--transport", spec.transport]
        if spec.adaptive:
            mode += ["--adaptive", *(["--ttft-ms", f"{slo_ms[0]:g}", "--tpot-ms", f"{slo_ms[1]:g}"]
                                     if slo_ms else [])]
    elif spec.kind == "colocated":
        mode = ["--mode", "colocated", "--replicas", str(spec.engines)]
    else:
        raise ValueError(f"arm {spec.name}: plain vLLM engines are served by vllm_command")
    args = [*pdserve_args(model, mock), *mode]
    if step_trace_root:
        args += ["--set", f"engine.step_trace_dir={step_trace_root}/{spec.name}-steps"]
    args += [arg for setting in settings for arg in ("--set", setting)]
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), *args]
    env = {} if mock else {"CUDA_VISIBLE_DEVICES": ",".join(gpus[: spec.num_gpus])}
    return command, env


def proxy_command(port: int, backends: list[str]) -> list[str]:
    """The round-robin proxy in front of a vllm-N arm's engines."""
    return [sys.executable, "-m", "pdserve.bench.rr_proxy", "--port", str(port),
            *(arg for backend in backends for arg in ("--backend", backend))]


def per_request(result: dict) -> dict[str, list]:
    """TTFT and TPOT (ms) of each request, whether it completed, and its prompt's tokens, from a
    bench result JSON, in the workload's request order (request i of one arm is request i of every
    other arm at the same seed). A one-token output has no TPOT: 0, as `vllm bench serve` counts it
    (the Mooncake-shaped outputs include such requests)."""
    ttft, tpot, ok = [], [], []
    for t, latency, n, error in zip(
        result["ttfts"], result["latencies"], result["output_lens"], result["errors"], strict=True
    ):
        good = bool(not error and t is not None and latency is not None and n and n >= 1)
        ok.append(good)
        ttft.append(t * 1e3 if good else None)
        tpot.append(((latency - t) / (n - 1) * 1e3 if n > 1 else 0.0) if good else None)
    return {"ttft_ms": ttft, "tpot_ms": tpot, "ok": ok, "input_lens": list(result.get("input_lens") or [])}


def attainment(requests: dict[str, list], tpot_ms: float, ttft_ms: float = TTFT_MS) -> float:
    """Share of all requests (failed ones count as misses) meeting this TTFT and TPOT target."""
    met = sum(
        1
        for ok, t, p in zip(requests["ok"], requests["ttft_ms"], requests["tpot_ms"], strict=True)
        if ok and t <= ttft_ms and p <= tpot_ms
    )
    return met / max(1, len(requests["ok"]))


def engine_counters(metrics_text: str) -> dict[str, float | None]:
    """The KV transfer counters in a pdserve service's /metrics text; per pool its engines'
    first-output histogram (count, sum, and the cumulative counts at a few bounds,
    `first_output_le0.1_prefill`): the engine's share of TTFT, per leg; and per pool the
    frontend's own TTFT (`frontend_ttft_count_colocated`, `frontend_ttft_sum_...`: from the
    ledger's admission, after the body was parsed, to the first token's hand-off). The client's
    TTFT minus the frontend's is HTTP and parsing; the frontend's minus the engine's is routing
    and the way to the engine and back."""
    names = {
        "pulls": "pdserve_kv_transfer_seconds_count",
        "seconds": "pdserve_kv_transfer_seconds_sum",
        "bytes": "pdserve_kv_transfer_bytes_total",
        "failures": "pdserve_kv_transfer_failures_total",
    }
    counters = {key: metric_sum(metrics_text, name) for key, name in names.items()}
    for pool in POOLS:
        count = metric_value(metrics_text, f"{_FIRST_OUTPUT}_count", pool=pool)
        if count is None:
            continue
        counters[f"first_output_count_{pool}"] = count
        counters[f"first_output_sum_{pool}"] = metric_value(metrics_text, f"{_FIRST_OUTPUT}_sum", pool=pool)
        for le in _FIRST_OUTPUT_LE:
            counters[f"first_output_le{le}_{pool}"] = metric_value(
                metrics_text, f"{_FIRST_OUTPUT}_bucket", pool=pool, le=le)
    for pool in POOLS:
        for key, metric in _ENGINE_TIMINGS.items():
            if (count := metric_value(metrics_text, f"{metric}_count", pool=pool)):
                counters[f"{key}_count_{pool}"] = count
                counters[f"{key}_sum_{pool}"] = metric_value(metrics_text, f"{metric}_sum", pool=pool)
        if (count := metric_value(metrics_text, f"{_FRONTEND_TTFT}_count", pool=pool)) is not None:
            counters[f"frontend_ttft_count_{pool}"] = count
            counters[f"frontend_ttft_sum_{pool}"] = metric_value(metrics_text, f"{_FRONTEND_TTFT}_sum",
                                                                 pool=pool)
    return counters


def _samples(metrics_text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text (label values unquoted)."""
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, label_text = series.partition("{")
        labels = dict(item.split("=", 1) for item in label_text.rstrip("}").split(",") if "=" in item)
        yield name, {k: v.strip('"') for k, v in labels.items()}, float(value)


def metric_value(metrics_text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` whose labels include `labels`, or None."""
    return next((value for sample, have, value in _samples(metrics_text)
                 if sample == name and all(have.get(k) == v for k, v in labels.items())), None)


def counter_mean_ms(counters: dict, key: str, suffix: str = "") -> float | None:
    """The mean of a histogram in `counters` (`KEY_countSUFFIX`, `KEY_sumSUFFIX`, seconds), in ms
    (None: no samples)."""
    count = counters.get(f"{key}_count{suffix}")
    return counters[f"{key}_sum{suffix}"] / count * 1e3 if count else None


def first_output_ms(counters: dict, pool: str) -> float | None:
    """The mean engine first output of a pool's requests in `counters`, in ms (None: none)."""
    return counter_mean_ms(counters, "first_output", f"_{pool}")


def counters_line(counters: dict) -> str:
    """KV pulls and each pool's engine first output, for the console."""
    parts = []
    if counters.get("pulls"):
        mean_ms = counters["seconds"] / counters["pulls"] * 1e3
        parts.append(f"{counters['pulls']:.0f} KV pulls, {mean_ms:.1f} ms mean")
    for pool in POOLS:
        if (mean_ms := first_output_ms(counters, pool)) is not None:
            share = counters.get(f"first_output_le0.075_{pool}", 0) / counters[f"first_output_count_{pool}"]
            parts.append(f"{pool} engine first output {mean_ms:.0f} ms mean, {share:.0%} <= 75 ms")
        if (mean := counter_mean_ms(counters, "frontend_ttft", f"_{pool}")) is not None:
            parts.append(f"{pool} frontend TTFT {mean:.1f} ms mean")
        if timings := _timings_text(counters, f"_{pool}"):
            parts.append(f"{pool} engines' vLLM {timings}")
    if timings := _timings_text(counters, ""):
        parts.append(f"vLLM's own {timings}")
    return "; ".join(parts) or "no engine counters"


def _timings_text(counters: dict, suffix: str) -> str:
    """vLLM's TTFT, queue and prefill means (ms) among `counters` (keys ending in `suffix`)."""
    parts = [f"{label} {mean:.1f}"
             for key, label in zip(TIMINGS, ("TTFT", "queue", "prefill"), strict=True)
             if (mean := counter_mean_ms(counters, key, suffix)) is not None]
    return f"{', '.join(parts)} ms mean" if parts else ""


def vllm_counters(metrics_text: str) -> dict[str, float | None]:
    """Plain `vllm serve`'s own TTFT, queue and prefill histograms (count, sum over its series):
    the same vLLM timings pdserve's engines report (engine_counters' `vllm_ttft_*`, `queue_*`,
    `prefill_*` per pool). vLLM's TTFT runs from its input processing to its output processor's
    first token, so a vllm-N arm's client TTFT minus it is vLLM's HTTP, parsing and streaming."""
    return {f"{key}_{part}": metric_sum(metrics_text, f"{metric}_{part}")
            for key, metric in _VLLM_TIMINGS.items() for part in ("count", "sum")}


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every series of a Prometheus sample (all label values), or None if absent."""
    values = [value for sample, _, value in _samples(text) if sample == name]
    return sum(values) if values else None


def delta(after: dict, before: dict) -> dict[str, float | None]:
    return {k: (after[k] - (before.get(k) or 0.0)) if after.get(k) is not None else None for k in after}


def pulls_from_log(log: Path) -> list[list[float]]:
    """[blocks, MiB, ms] of every pull the decode engine logged (pdserve arms)."""
    if not log.exists():
        return []
    return [[float(x) for x in m.groups()] for m in _PULL_LOG.finditer(log.read_text(errors="replace"))]
