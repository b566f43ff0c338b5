"""Simulator validation: the simulator's predictions held against measured serving runs, and scored.

The programs that drive these live in `benchmarks/research/` (sim_validate*.py, sim_refit_profile.py,
sim_profile_cpu.py, actor_replay.py); the logic their tests check lives here.

- `measured_runs`: a measured `pdserve bench serve` run as a simulator workload, its metrics, and the
  comparison (one simulation, or the median over step-noise seeds; repeats pooled).
- `refit`: a profile's step model refitted on a window of its step trace (the profile's own steps,
  some runs' steps, a stretch of the trace), and a prefill engine's handoff fitted on other runs.
- `score`: cells within the tolerance, the repeat spread from measured values only, the mean of repeats.
- `repeats`: every held-out validation of a CPU profile folder with repeats, and their summary.
- `gpu_runs`: the GPU arms of `benchmarks/gpu/proof.py` as `pdserve sim run` flags, the medians over
  seeds, and the goodput table.
- `actor_replay`: one engine's requests, as its actor took them, replayed through one simulated engine.
- `cpu_service`: the CPU service the validation profiles (its arms, its KV, its engines' batch budget).
"""
