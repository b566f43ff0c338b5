"""Where a request's tokens came from: the engines, whether the prompt's KV was pulled (how
many bytes, how long) or recomputed, and every migration. An operator reads it in the
response headers and in one log line per request, so that a deployment silently falling back
to colocated work (pulls failing into recomputes, prompts prefilled on decode engines) shows.

Headers (`Provenance.headers`; a streamed response's are sent before its legs run, so they hold
the placement only, and the log line the rest):

- `x-pdserve-prefill-engine`, `x-pdserve-decode-engine`: the engines (the decode engine the
  request ended on);
- `x-pdserve-path`: `remote` (prefill engine, KV pulled), `local_short_prompt` /
  `local_cached` / `overflow` (prefilled on the decode engine; `overflow`: adaptive
  disaggregation, the prefill pool was behind), `colocated`;
- `x-pdserve-kv`: `pulled`, `recomputed_pull_failed` (the connector recomputed the prompt),
  `recomputed_prefill_failed` (the prefill engine died; the decode engine prefilled),
  `not_needed` (the first token ended the request), or `local`;
- `x-pdserve-kv-bytes`, `x-pdserve-kv-pull-ms`: the pull as the decode engine's connector
  measured it;
- `x-pdserve-migrations`: how many times the request moved to another engine.

The log line goes to the `pdserve.provenance` logger at INFO.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.engine.types import KVPull
from pdserve.scheduler.routing import Placement

logger = logging.getLogger("pdserve.provenance")


@dataclass(slots=True)
class Provenance:
    request_id: str
    path: str  # the placement's reason
    decode: str
    prefill: str | None = None
    prefill_failed: bool = False  # the prefill leg failed; the decode engine prefilled
    first_token_only: bool = False  # the first token ended the request: no decode leg
    pull: KVPull | None = None
    migrations: list[str] = field(default_factory=list)  # the engines it moved to

    @classmethod
    def placed(cls, request_id: str, placement: Placement) -> Provenance:
        return cls(request_id, placement.reason, placement.decode, placement.prefill)

    @property
    def kv(self) -> str:
        if self.prefill is None:
            return "local"
        if self.prefill_failed:
            return "recomputed_prefill_failed"
        if self.first_token_only:
            return "not_needed"
        if self.pull is not None and self.pull.failed:
            return "recomputed_pull_failed"
        return "pulled" if self.pull is not None else "unknown"

    def headers(self) -> dict[str, str]:
        out = {"x-pdserve-decode-engine": self.decode, "x-pdserve-path": self.path,
               "x-pdserve-kv": self.kv, "x-pdserve-migrations": str(len(self.migrations))}
        if self.prefill is not None:
            out["x-pdserve-prefill-engine"] = self.prefill
        if self.pull is not None:
            out["x-pdserve-kv-bytes"] = str(self.pull.nbytes)
            out["x-pdserve-kv-pull-ms"] = f"{self.pull.seconds * 1e3:.3f}"
        return out

    def log(self, reason: str) -> None:
        pull = ("" if self.pull is None else
                f" kv_bytes={self.pull.nbytes} kv_pull_ms={self.pull.seconds * 1e3:.3f}")
        moved = f" migrated_to={','.join(self.migrations)}" if self.migrations else ""
        logger.info("request %s: path=%s prefill=%s decode=%s kv=%s%s%s finished=%s",
                    self.request_id, self.path, self.prefill or "-", self.decode, self.kv, pull,
                    moved, reason)
