"""Latency targets: the one form they take everywhere in pdserve.

The config (`slo.ttft_ms`, `slo.tpot_ms`), the router and autoscaler, the simulator and the
benchmark harness's goodput (`--goodput ttft:MS tpot:MS e2el:MS`, as `vllm bench serve`) all hold
a `SloTargets`: milliseconds as given (None: no target on that metric) and the percentile of
requests the targets hold for; `ttft_s` / `tpot_s` are the same targets in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True, kw_only=True)
class SloTargets:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    percentile: float = 90.0  # the share of requests the targets hold for (the autoscaler's)

    def __post_init__(self) -> None:
        for name, value in self.items():
            if value < 0:
                raise ValueError(f"SLO {name} must be non-negative, got {value}")

    @classmethod
    def from_s(cls, ttft_s: float, tpot_s: float, percentile: float = 90.0) -> SloTargets:
        """TTFT and TPOT targets given in seconds."""
        return cls(ttft_ms=ttft_s * 1000, tpot_ms=tpot_s * 1000, percentile=percentile)

    @classmethod
    def from_config(cls, slo: Any) -> SloTargets | None:
        """The deployment's targets from the config's `slo` section; None unless TTFT and TPOT
        are both set (routing, admission and autoscaling need both)."""
        if slo.ttft_ms is None or slo.tpot_ms is None:
            return None
        return cls(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, percentile=slo.percentile)

    @classmethod
    def parse(cls, pairs: Sequence[str]) -> SloTargets:
        """Parse vllm's `--goodput` values: "KEY:VALUE" pairs, keys ttft/tpot/e2el, values in ms."""
        targets: dict[str, float] = {}
        for pair in pairs:
            name, sep, value = pair.partition(":")
            if not sep or name not in SLO_NAMES:
                raise ValueError(
                    f"invalid SLO {pair!r}: use KEY:VALUE with KEY one of {', '.join(SLO_NAMES)} "
                    "and VALUE in milliseconds"
                )
            try:
                targets[name] = float(value)
            except ValueError:
                raise ValueError(f"invalid SLO {pair!r}: {value!r} is not a number of milliseconds") from None
        return cls(**{f"{name}_ms": value for name, value in targets.items()})

    @property
    def ttft_s(self) -> float:
        assert self.ttft_ms is not None, "no TTFT target"
        return self.ttft_ms / 1000

    @property
    def tpot_s(self) -> float:
        assert self.tpot_ms is not None, "no TPOT target"
        return self.tpot_ms / 1000

    def items(self) -> list[tuple[str, float]]:
        """(metric name, target ms) for the targets that are set, in ttft/tpot/e2el order."""
        values = (self.ttft_ms, self.tpot_ms, self.e2el_ms)
        return [(name, value) for name, value in zip(SLO_NAMES, values, strict=True) if value is not None]

    def as_dict(self) -> dict[str, float]:
        return dict(self.items())

    def __bool__(self) -> bool:
        return bool(self.items())
