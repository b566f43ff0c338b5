"""Defaults of the KV transfer settings, each defined once: the transports, the connector's config
(pdserve.kv.connector.config) and the deployment's config tree (pdserve.config.schema) all refer
here. A light module (no torch, no grpc), so the config tree can import it.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_NCCL_API",
    "DEFAULT_NCCL_MAX_PAIRS",
    "DEFAULT_NCCL_MAX_PAIRS_PER_SESSION",
    "DEFAULT_PULL_TIMEOUT_S",
    "NCCL_API_CHOICES",
]

# A pinned request's blocks are freed after this long even if no decode worker pulls them, so a
# lost decode request cannot leak prefill KV. 30 s is ~100x a slow CPU pull of a long prompt.
DEFAULT_LEASE_S = 30.0
# A gRPC pull that has not finished after this long is failed by its deadline and the policy
# applies (NCCL pulls are bounded by the pair timeout, 30 s). 60 s: a 256 MiB prompt takes ~1 s
# even at a slow 0.3 GB/s.
DEFAULT_PULL_TIMEOUT_S = 60.0
# How an NCCL pair sends and receives (nccl_pair.resolve_api): "direct" ncclSend/ncclRecv through
# ctypes (a few microseconds of host time per op), "torch" a ProcessGroupNCCL, or "auto": direct
# where the NCCL library loads, else torch. gloo pairs (CPU) always run torch's.
NCCL_API_CHOICES = ("auto", "direct", "torch")
DEFAULT_NCCL_API = "auto"
# Live NCCL pairs a prefill worker holds at once, and per decode session. Each pair holds a
# staging ring on both GPUs (4 x 64 MiB per side by default: nccl_pair.DEFAULT_STAGING_BYTES), so
# 16 pairs bound a prefill GPU's staging at 4 GiB. A decode worker needs one pair per prefill
# worker; 2 per session lets it replace a broken pair before the source has noticed the break.
DEFAULT_NCCL_MAX_PAIRS = 16
DEFAULT_NCCL_MAX_PAIRS_PER_SESSION = 2
