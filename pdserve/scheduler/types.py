"""Values the scheduler shares with its callers: pool names, pool signals."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What the autoscaling policy sees of one pool at one evaluation (RequestLedger.signals)."""

    pool: str  # "prefill", "decode" or "colocated"
    replicas: int  # engines serving (not draining), starting ones included
    starting: int = 0  # of `replicas`, not ready yet
    samples: int = 0  # requests behind the percentiles
    ttft_s: float | None = None  # observed at the SLO percentile over the window
    tpot_s: float | None = None
    # The larger of arriving prompt tokens/s over the pool's modelled prefill capacity and the
    # measured share of time its engines had a prompt in prefill.
    prefill_utilization: float = 0.0
    decode_utilization: float = 0.0  # running batch over the batch that meets the TPOT target
    kv_usage: float = 0.0  # mean over the pool's engines, 0..1
