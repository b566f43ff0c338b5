"""Prometheus metrics of the serving path.

Each frontend owns a registry (so tests can build many apps in one process). Latencies are
observed by the frontend per request as the client sees them; gauges of engine state are
refreshed from engine stats by the frontend's poller. Every series carries the pool label
(`colocated`, `prefill`, `decode`).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.engine.types import EngineInfo, EngineStats
from pdserve.scheduler.perf_model import PerfModel

# Buckets span a fast GPU (TTFT ~20 ms, TPOT ~5 ms) to the 2-core CPU engine (seconds).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 1.0, 2.5)
# One 2048-token Llama-8B request is 256 MiB: ~0.7 ms over NVLink, ~1 s over a slow network.
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0)
# Finer than TTFT's: an engine's share is tens of milliseconds on a GPU, and its modes matter.
_ENGINE_FIRST_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                         2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds",
                              "Time from request arrival to the first output token.",
                              ["pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              ["pool"], buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Time from request arrival to its last token.",
                             ["pool"], buckets=_E2E_BUCKETS, registry=r)
        def per_leg(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, ["pool"], buckets=_ENGINE_FIRST_BUCKETS, registry=r)

        self.engine_first_output = per_leg(
            "pdserve_engine_time_to_first_output_seconds",
            "Time from a request's arrival at its engine to the engine's first output (per leg: "
            "a disaggregated request counts once in prefill and once in decode, where it is the "
            "KV pull plus one step); pdserve_time_to_first_token_seconds minus this is Ray, the "
            "frontend and, for a decode leg, the prefill leg.")
        self.engine_vllm_ttft = per_leg(
            "pdserve_engine_vllm_time_to_first_token_seconds",
            "vLLM's own time to first token in an engine, per leg: from its input processing to "
            "the first token's output processing. pdserve_engine_time_to_first_output_seconds "
            "minus this is the engine actor's own work.")
        self.engine_queue = per_leg(
            "pdserve_engine_queue_time_seconds",
            "Time a finished request waited in its engine's scheduler before its first step, per leg.")
        self.engine_prefill = per_leg(
            "pdserve_engine_prefill_time_seconds",
            "Time from a finished request's first step in its engine to its first token, per leg "
            "(a decode leg: its KV pull and one step).")
        self.requests = Counter("pdserve_requests_total", "Finished requests by outcome.",
                                ["pool", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens processed.",
                                     ["pool"], registry=r)
        self.output_tokens = Counter("pdserve_generation_tokens_total", "Output tokens produced.",
                                     ["pool"], registry=r)
        self.rejected = Counter("pdserve_requests_rejected_total",
                                "Requests refused before reaching an engine, by HTTP status.",
                                ["status"], registry=r)
        self.running = Gauge("pdserve_requests_running", "Requests running in engines.",
                             ["pool"], registry=r)
        self.waiting = Gauge("pdserve_requests_waiting", "Requests queued in engines.",
                             ["pool"], registry=r)
        self.kv_usage = Gauge("pdserve_kv_cache_usage_ratio", "KV cache blocks in use (0 to 1).",
                              ["pool", "replica"], registry=r)
        self.engine_aborted = Gauge("pdserve_engine_aborted_requests",
                                    "Requests an engine ended early (client gone, abort), "
                                    "cumulative since the engine started.",
                                    ["pool", "replica"], registry=r)
        self.engine_finished = Gauge("pdserve_engine_finished_requests",
                                     "Requests an engine completed, cumulative since it started.",
                                     ["pool", "replica"], registry=r)
        self.engine_info = Gauge("pdserve_engine_info", "One series per engine (value 1).",
                                 ["pool", "replica", "pid", "node"], registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes_total",
                                "KV cache bytes pulled from prefill to decode engines.",
                                ["transport"], registry=r)
        self.kv_seconds = Histogram("pdserve_kv_transfer_seconds",
                                    "Duration of one request's KV pull.", ["transport"],
                                    buckets=_TRANSFER_BUCKETS, registry=r)
        self.kv_failures = Counter("pdserve_kv_transfer_failures_total",
                                   "KV pulls that failed or timed out.", ["transport"], registry=r)
        self._kv_seen: dict[str, tuple[int, int]] = {}  # replica -> (bytes, failures) seen
        self.predicted_ttft = Histogram(
            "pdserve_predicted_ttft_seconds", "TTFT the scheduler predicted when placing a request "
            "(compare with pdserve_time_to_first_token_seconds).", ["pool"],
            buckets=_TTFT_BUCKETS, registry=r)
        self.predicted_tpot = Histogram(
            "pdserve_predicted_tpot_seconds", "TPOT the scheduler predicted when placing a request.",
            ["pool"], buckets=_TPOT_BUCKETS, registry=r)
        self.slo_observed = Gauge(
            "pdserve_slo_observed_seconds", "TTFT/TPOT at the SLO percentile over the scheduler's "
            "window, by the pool that served that phase.", ["pool", "metric"], registry=r)
        self.slo_attainment = Gauge(
            "pdserve_slo_attainment_ratio", "Share of the window's requests within the target.",
            ["pool", "metric"], registry=r)
        self.scheduler_model = Gauge(
            "pdserve_scheduler_model", "The scheduler's performance model per pool, as refitted "
            "from what requests show (param: prefill_tokens_per_s, prefill_overhead_seconds, "
            "decode_step_seconds, decode_step_per_seq_seconds, pull_seconds_per_1k_tokens: a "
            "decode leg's time to its first token, i.e. KV pull plus any wait for the engine).",
            ["pool", "param"], registry=r)
        self.pool_replicas = Gauge("pdserve_pool_replicas", "Engines serving in each pool.",
                                   ["pool"], registry=r)
        self.pool_replicas_changing = Gauge(
            "pdserve_pool_replicas_changing", "Engines starting or draining, by pool.",
            ["pool", "state"], registry=r)
        self.scaling_decisions = Counter(
            "pdserve_scaling_decisions_total", "Autoscaler evaluations by pool, direction "
            "(up/down/none) and reason.", ["pool", "direction", "reason"], registry=r)
        self.engines_up = Gauge("pdserve_engines_healthy", "Engines answering stats calls.",
                                ["pool"], registry=r)
        self.engine_restarts = Counter(
            "pdserve_engine_restarts_total", "Engines replaced, by pool and why the old one went "
            "(died: the actor or its engine exited; hung: no progress within "
            "serving.liveness_timeout_s; start_failed: a replacement did not start).",
            ["pool", "reason"], registry=r)
        self.migrated = Counter(
            "pdserve_requests_migrated_total", "Requests that continued on another engine after "
            "theirs died, by pool.", ["pool"], registry=r)

    def observe_request(self, pool: str, ttft_s: float | None, tpot_s: float | None,
                        e2e_s: float, prompt_tokens: int, output_tokens: int,
                        finish_reason: str) -> None:
        if ttft_s is not None:
            self.ttft.labels(pool).observe(ttft_s)
        if tpot_s is not None:
            self.tpot.labels(pool).observe(tpot_s)
        self.e2e.labels(pool).observe(e2e_s)
        self.requests.labels(pool, finish_reason).inc()
        self.prompt_tokens.labels(pool).inc(prompt_tokens)
        self.output_tokens.labels(pool).inc(output_tokens)

    def update_engines(self, stats: Iterable[EngineStats], pools: Iterable[str]) -> None:
        running = {pool: 0 for pool in pools}
        waiting = dict(running)
        healthy = dict(running)
        for s in stats:
            running[s.pool] = running.get(s.pool, 0) + s.num_running
            waiting[s.pool] = waiting.get(s.pool, 0) + s.num_waiting
            healthy[s.pool] = healthy.get(s.pool, 0) + 1
            self.kv_usage.labels(s.pool, s.replica_id).set(s.kv_cache_usage)
            self.engine_aborted.labels(s.pool, s.replica_id).set(s.num_aborted_total)
            self.engine_finished.labels(s.pool, s.replica_id).set(s.num_finished_total)
            self._observe_transfers(s)
            for histogram, samples in ((self.engine_first_output, s.first_output_seconds),
                                       (self.engine_vllm_ttft, s.vllm_ttft_seconds),
                                       (self.engine_queue, s.queue_seconds),
                                       (self.engine_prefill, s.prefill_seconds)):
                for seconds in samples:
                    histogram.labels(s.pool).observe(seconds)
        for pool in running:
            self.running.labels(pool).set(running[pool])
            self.waiting.labels(pool).set(waiting[pool])
            self.engines_up.labels(pool).set(healthy[pool])

    def _observe_transfers(self, s: EngineStats) -> None:
        """Engines report cumulative totals; counters advance by what is new since last poll."""
        if not s.kv_transport:
            return
        seen_bytes, seen_failures = self._kv_seen.get(s.replica_id, (0, 0))
        # Totals below what we saw mean the engine restarted: count its totals afresh.
        new_bytes = s.kv_transfer_bytes_total - (seen_bytes if s.kv_transfer_bytes_total >= seen_bytes else 0)
        new_failures = s.kv_transfer_failures_total - (
            seen_failures if s.kv_transfer_failures_total >= seen_failures else 0)
        self._kv_seen[s.replica_id] = (s.kv_transfer_bytes_total, s.kv_transfer_failures_total)
        self.kv_bytes.labels(s.kv_transport).inc(new_bytes)
        self.kv_failures.labels(s.kv_transport).inc(new_failures)
        for seconds in s.kv_transfer_seconds:
            self.kv_seconds.labels(s.kv_transport).observe(seconds)

    def observe_slo(self, pool: str, summary) -> None:
        """Gauges from the SLO tracker's window (`pdserve.scheduler.slo.WindowSummary`)."""
        for metric, value, attained in (("ttft", summary.ttft_p_s, summary.ttft_attainment),
                                        ("tpot", summary.tpot_p_s, summary.tpot_attainment)):
            if value is not None:
                self.slo_observed.labels(pool, metric).set(value)
            if attained is not None:
                self.slo_attainment.labels(pool, metric).set(attained)

    def observe_model(self, pool: str, model: PerfModel) -> None:
        """Gauges of the scheduler's current model of `pool` (what routing and admission use)."""
        for param, value in (
                ("prefill_tokens_per_s", model.prefill_tokens_per_s),
                ("prefill_overhead_seconds", model.prefill_overhead_s),
                ("decode_step_seconds", model.decode_step_s),
                ("decode_step_per_seq_seconds", model.decode_step_per_seq_s),
                ("pull_seconds_per_1k_tokens", model.transfer_s(1000))):
            self.scheduler_model.labels(pool, param).set(value)

    def register_engines(self, infos: Iterable[EngineInfo]) -> None:
        for info in infos:
            self.engine_info.labels(info.pool, info.replica_id, str(info.pid), info.node_ip).set(1)

    def forget_engine(self, info: EngineInfo) -> None:
        """The engine is gone: drop its series (a replacement registers its own)."""
        for gauge, labels in ((self.engine_info, (info.pool, info.replica_id, str(info.pid),
                                                  info.node_ip)),
                              (self.kv_usage, (info.pool, info.replica_id)),
                              (self.engine_aborted, (info.pool, info.replica_id)),
                              (self.engine_finished, (info.pool, info.replica_id))):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
