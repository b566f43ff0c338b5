"""Benchmark harness: measure any OpenAI-compatible endpoint the way `vllm bench serve` does.

Package map (each module's docstring gives its lifecycle):

- `workloads`: seeded request generators (random lengths, chat/code/summarization shapes with cited
  statistics, Mooncake trace replay with shared prefixes); prompts as text or token ids.
- `tokenizer`: the small tokenizer protocol the harness needs, and an offline Hugging Face loader.
- `arrivals`: arrival schedules (all at once, Poisson, gamma burstiness, trace timestamps).
- `client`: async streaming client for /v1/completions and /v1/chat/completions, SSE parsing, per-request
  timelines.
- `metrics`: TTFT/TPOT/ITL/E2EL statistics, throughputs and goodput as vllm computes them, plus SLO
  attainment; pure functions.
- `runner`: one run (warm-ups, schedule, concurrency cap, progress bar) -> `BenchmarkResult`.
- `report` / `plots`: vllm-compatible result JSON, per-request CSV, text summary, PNG plots.
- `sweep`: attainment vs request rate, goodput search (pure policy + driver), endpoint comparison.
- `cli` / `cli_args`: `pdserve bench {serve,sweep,compare}` and `python -m pdserve.bench.cli`.
- `arms` / `arm_summary`: the GPU proof's serving arms by name (xPyD, colocated-N, vllm-N), the commands
  that serve them, their /metrics counters; the per-GPU goodput table over their records
  (`benchmarks/gpu/proof.py` drives them). `rr_proxy`: the round-robin proxy of a plain-vLLM arm.
- `grid` / `grid_summary`: issue 31's grid (workloads, the rate lattice and its bisection, the slices
  of `benchmarks/gpu/grid.sh`); its cells over runs of several sessions (goodput per GPU with its
  spread, the best pdserve arm, the TTFT overhead over plain vLLM request by request), and the merge.
- `ttft_breakdown`: where a served request's TTFT goes, from the engines' step traces and the client's times.

Importing the package imports nothing heavy; the modules pull numpy, aiohttp, matplotlib and tqdm (the
`bench` extra) and transformers (for tokenizers) when used.
"""
