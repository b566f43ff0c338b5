"""Drive a RequestLedger with scripted requests on chosen engines, through its lifecycle events."""

from __future__ import annotations

import itertools

from pdserve.engine.types import Leg
from pdserve.scheduler.ledger import Admission, RequestLedger
from pdserve.scheduler.routing import Placement

_IDS = itertools.count()  # request ids unique across every Script over a ledger


class Script:
    def __init__(self, ledger: RequestLedger, decode: str = "decode-0") -> None:
        self.ledger = ledger
        self.decode = decode

    def admit(self, prefill: str | None, tokens: int, max_tokens: int, now: float,
              decode: str | None = None) -> Admission:
        placement = Placement(decode or self.decode, prefill, 0.0, 0.0, "scripted")
        return self.ledger.admit(f"s{next(_IDS)}", range(tokens), max_tokens, now,
                                 placement=placement)

    def prefill(self, replica: str, tokens: int, start: float, end: float | None = None,
                observe: bool = False) -> Admission:
        """A prefill leg on `replica` from `start`; at `end`, its first token (`observe`: the
        prefill fit takes it) or its end without one."""
        adm = self.admit(replica, tokens, 1, start)
        self.ledger.leg_started(adm, Leg.PREFILL, start)
        if end is not None:
            if observe:
                self.ledger.leg_output(adm, Leg.PREFILL, end, 1, finished=True)
            self.ledger.leg_finished(adm, Leg.PREFILL, end, "length" if observe else None)
            self.ledger.request_finished(adm, end, 1 if observe else 0, "length")
        return adm

    def pull(self, tokens: int, start: float, seconds: float, prefill: str = "prefill-0") -> None:
        """A decode leg whose KV pull (its first output) took `seconds`."""
        adm = self.admit(prefill, tokens, 2, start)
        self.ledger.leg_started(adm, Leg.DECODE, start)
        self.ledger.leg_output(adm, Leg.DECODE, start + seconds, 1)
        self.ledger.leg_finished(adm, Leg.DECODE, start + seconds, "length")
        self.ledger.request_finished(adm, start + seconds, 2, "length")

    def finished(self, now: float, ttft_s: float, tpot_s: float,
                 ttft_pool: str = "prefill", tpot_pool: str = "decode") -> None:
        """A request's client-side timings, as the SLO tracker records them."""
        self.ledger.observe_ttft(ttft_pool, now, ttft_s)
        self.ledger.observe_tpot(tpot_pool, now, tpot_s)
