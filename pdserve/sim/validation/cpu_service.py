"""The CPU service the simulator's validation profiles: its arms, its KV, its engines' batch budget.

`benchmarks/research/sim_profile_cpu.py` starts `pdserve serve` with one of `ARMS` (the same flags
as benchmarks/cpu_compare.py, so the profile describes the engines the comparison measured),
records its profile and measures it under load. The profile must carry the engines' own
`max_num_batched_tokens`, read from their start-up lines (`engine_batched_tokens`).
"""

from __future__ import annotations

import re

ARMS = {
    "colocated": ["--mode", "colocated", "--replicas", "1"],
    "disaggregated": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                      "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5"],
}
# The same 1P1D with each engine bound to a core of its own (the simulator's premise: an engine
# owns its device); unbound, both engines' threads share both cores.
ARMS["disaggregated-pinned"] = [*ARMS["disaggregated"], "--set", "pools.prefill.cpu_threads=0",
                                "--set", "pools.decode.cpu_threads=1"]
# 1 GiB of KV per engine (pdserve's CPU default, as in the comparison) / 5.9 MB per 128-token block.
NUM_KV_BLOCKS = 182


def engine_batched_tokens(log: str) -> int:
    """The max_num_batched_tokens every engine of the service runs with, from vLLM's start-up
    line in the service log (pdserve leaves it to vLLM's default unless configured: 2048 on the
    CPU backend). The profile must carry the engine's own value: the simulator batches prompts
    up to it, and the profile's former default (4096) let a simulated prefill engine send
    decode twice the bursts the real one did (session 9: 1P1D TPOT +55-73% at 2 req/s)."""
    found = set(re.findall(r"max_num_batched_tokens=(\d+)", log))
    if len(found) != 1:
        raise RuntimeError(f"cannot tell the engines' max_num_batched_tokens from the log: {found}")
    return int(found.pop())
