"""Issue 31's grid ("where disaggregation wins"): the workloads the GPU proof measures, the rates it
probes, and how each arm's knee is bracketed.

Lifecycle: `benchmarks/gpu/proof.py run --arm A --workloads isl8k isl16k` starts arm A once and,
for each named `GridWorkload`, asks `next_index` which rate of the workload's `RateLattice` to probe
given the probes so far, runs that probe (`pdserve bench serve` with `bench_flags` at that rate,
`num_prompts` requests, seed `seed(rate)`), and stops when every TPOT target's knee is bracketed to
one lattice step, the lattice ends, or the workload's share of the time budget would be overrun
(`probe_seconds`). Nothing here touches a process, the network or a clock: the same calls are unit
tested and can replay recorded probes.

Why a bisection and not a fixed grid of rates: the knees move with the workload (8k and 16k prompts
put them at a few req/s per GPU, 2k near 10), and the device lends ten minutes a call, ~150 s of
which one arm's start takes; a fixed 2 req/s grid wide enough for every arm costs ~10 probes per
arm and workload, a bisection ~5 for the tight targets it serves first.

Why a lattice (rates `unit * 2**(k / steps_per_octave)` per GPU, rounded to 3 digits) and not free
midpoints: every arm of the same GPU count then probes from the same rate set, and with the same
start and the same pass/fail outcomes the same rates, so a pdserve arm and the plain-vLLM arm of its
GPU count meet the same seeded arrivals at the same rates and their requests can be compared one to
one (pdserve.bench.grid_summary's TTFT overhead). Four steps per octave (19%) place a knee within a
factor 1.19 in about two probes per octave bracketed; `--steps-per-octave 8` halves that for one
more probe per knee.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from pdserve.bench.arms import ATTAINMENT, ENGINE, ISL, OSL, TTFT_MS, arm_spec

MAX_MODEL_LEN = int(ENGINE["max_model_len"])
# Seconds a probe costs beyond its arrivals and drain: the bench client's start (Python, the
# tokenizer: ~1-4 s), the prompts, the /metrics reads before and after.
CLIENT_OVERHEAD_S = 5.0


@dataclass(frozen=True, slots=True)
class GridWorkload:
    """One workload of the grid: its requests (bench flags), its TTFT target, and where to probe."""

    name: str
    ttft_ms: float
    dataset: str  # "random" (every prompt input_len, every output output_len) or a workloads shape
    input_len: int  # random: each prompt's tokens; a shape: the longest prompt it sends
    output_len: int  # random: each output's tokens; a shape: the longest output it sends
    rate_unit: float  # req/s per GPU at lattice index 0: every arm's first probe
    arrival_s: float  # seconds of arrivals per probe ...
    min_prompts: int  # ... but at least this many requests (attainment steps of 1 / min_prompts)
    drain_s: float  # after the last arrival until its request ends, near the knee (estimate)
    seed_base: int  # seeds of distinct workloads never meet: no prompt prefix shared across them
    note: str

    def bench_flags(self) -> list[str]:
        """`pdserve bench serve` flags of this workload's requests (the rate, count, seed apart)."""
        if self.dataset == "random":
            return ["--dataset-name", "random", "--random-input-len", str(self.input_len),
                    "--random-output-len", str(self.output_len), "--random-range-ratio", "0"]
        # A shape's lengths are cut so prompt + output fit the engines' context.
        return ["--dataset-name", self.dataset, "--max-model-len", str(MAX_MODEL_LEN)]

    def seed(self, rate: float) -> int:
        """The probe's seed: a function of workload and rate only, so every arm meets the same
        prompts and arrivals at a rate; distinct rates differ, so no probe hits the prefix cache
        with an earlier one's prompts. `isl2k` keeps issue 9's seeds (rate x 1000)."""
        return self.seed_base + round(rate * 1000)

    def num_prompts(self, rate: float, arrival_s: float | None = None, min_prompts: int | None = None) -> int:
        arrival_s = self.arrival_s if arrival_s is None else arrival_s
        min_prompts = self.min_prompts if min_prompts is None else min_prompts
        return max(min_prompts, round(rate * arrival_s))

    def as_dict(self) -> dict:
        return asdict(self)


# Units and probe sizes from the H200 calibration (one vLLM engine, Llama-8B shape: prefill ~45k
# tokens/s at 2k, TTFT 210 ms at 8k; decode 5.0 ms at batch 1, 8.5 at 128) and issue 9's knees
# (2k: 4-12 req/s per GPU). TTFT targets: 500 ms at 2k (issue 9's), 2 s at 8k and 16k (one 16k
# prefill alone takes ~0.5 s: 2 s leaves room for a queue of a few), 2 s for the Mooncake shape too
# (its median prompt, ~6.9k tokens, is an 8k-class prompt; its tail reaches 32k, ~1.3 s alone: the
# 10% the attainment goal forgives).
WORKLOADS: dict[str, GridWorkload] = {w.name: w for w in (
    GridWorkload("isl2k", TTFT_MS, "random", ISL, OSL, rate_unit=4.0, arrival_s=10.0, min_prompts=60,
                 drain_s=6.0, seed_base=0, note="issue 9's workload: random token ids, 2048 in, 256 out"),
    GridWorkload("isl8k", 2000.0, "random", 8192, OSL, rate_unit=1.5, arrival_s=12.0, min_prompts=36,
                 drain_s=8.0, seed_base=1_000_000, note="random token ids, 8192 in, 256 out"),
    GridWorkload("isl16k", 2000.0, "random", 16384, OSL, rate_unit=0.75, arrival_s=15.0, min_prompts=24,
                 drain_s=9.0, seed_base=2_000_000, note="random token ids, 16384 in, 256 out"),
    GridWorkload("mooncake", 2000.0, "summarization", 32768, 2048, rate_unit=0.75, arrival_s=12.0,
                 min_prompts=24, drain_s=20.0, seed_base=3_000_000,
                 note="Mooncake conversation trace's shape (pdserve.bench.workloads.SUMMARIZATION: "
                      "log-normal inputs, median 6,909, mean 12,035, cut at 32,768; outputs median 208, "
                      "mean 343, up to 2,048), random token ids, Poisson arrivals at the probe's rate; "
                      "no prefix shared between requests (the trace's block reuse is not modelled)"),
)}


@dataclass(frozen=True, slots=True)
class RateLattice:
    """The total rates an arm may probe on one workload: index k is `unit * 2**(k / steps)` req/s
    (unit = the workload's per-GPU unit x the arm's GPUs), from `low_octaves` below the unit to
    `high_octaves` above it."""

    unit: float
    steps_per_octave: int = 4
    low_octaves: int = 3
    high_octaves: int = 3

    def __post_init__(self) -> None:
        if self.unit <= 0 or self.steps_per_octave < 1:
            raise ValueError(f"need unit > 0 and steps_per_octave >= 1, got {self.unit}, "
                             f"{self.steps_per_octave}")

    @property
    def low(self) -> int:
        return -self.low_octaves * self.steps_per_octave

    @property
    def high(self) -> int:
        return self.high_octaves * self.steps_per_octave

    def rate(self, index: int) -> float:
        return float(f"{self.unit * 2 ** (index / self.steps_per_octave):.3g}")


@dataclass(frozen=True, slots=True)
class Bracket:
    """Where a target's knee lies among the probes: `passed` the highest point that met the
    attainment goal below every failing one, `failed` the lowest that did not (None: none such).
    Passes above a failure (noise) are ignored: the goodput is the bracket's lower end."""

    passed: float | None
    failed: float | None


def bracket(outcomes: Mapping[float, bool]) -> Bracket:
    """The knee's bracket from {point: met the goal} (points: lattice indices or rates)."""
    failed = min((point for point, ok in outcomes.items() if not ok), default=None)
    passed = max((point for point, ok in outcomes.items() if ok and (failed is None or point < failed)),
                 default=None)
    return Bracket(passed, failed)


def passes(attainment: float) -> bool:
    return attainment >= ATTAINMENT


def next_index(probes: Mapping[int, Mapping[str, float]], targets: Sequence[str],
               lattice: RateLattice, prior: Mapping[str, int] | None = None) -> int | None:
    """The lattice index to probe next, given {index: {TPOT target: attainment}} so far, or None
    when every target's knee is bracketed to one step (or lies beyond the lattice's ends).

    Targets are served in the order given (tightest TPOT first: those cells come first when the
    time runs out): a target that failed everywhere is followed an octave down, one that passed
    everywhere an octave up, and a bracket wider than one step is halved. `prior` ({target: the
    index an earlier run of the arm placed the knee at}, `prior_knees`) only changes where a
    bracket is sought: first at the earlier knee, then a step above it, so a knee that did not
    move is bracketed in two probes instead of five or six. The bracket is still this run's own:
    a pass and a failure one step apart."""
    prior = prior or {}
    if not probes:
        return prior.get(targets[0], 0) if targets else 0
    step = lattice.steps_per_octave
    for target in targets:
        knee = bracket({index: passes(attained[target]) for index, attained in probes.items()})
        if (seen := prior.get(target)) is not None:
            low = lattice.low - 1 if knee.passed is None else knee.passed
            high = lattice.high + 1 if knee.failed is None else knee.failed
            inside = [i for i in (seen, seen + 1) if low < i < high and i not in probes]
            if inside:
                return inside[0]
        if knee.passed is None:
            assert knee.failed is not None
            if knee.failed > lattice.low:
                return max(lattice.low, int(knee.failed) - step)
        elif knee.failed is None:
            if knee.passed < lattice.high:
                return min(lattice.high, int(knee.passed) + step)
        elif knee.failed - knee.passed > 1:
            return int(knee.passed + knee.failed) // 2
    return None


def prior_knees(sweeps: Sequence[Mapping], targets: Sequence[str], lattice: RateLattice) -> dict[str, int]:
    """{target: knee index} from earlier sweeps of one arm on one workload (records' `sweeps`
    entries) probed on the same lattice: per target the bracket's passing end, the median over
    the sweeps that bracketed it (rounded down). Sweeps on another lattice are left out."""
    same = [s for s in sweeps
            if s.get("lattice") == {"unit": lattice.unit, "steps_per_octave": lattice.steps_per_octave}]
    knees: dict[str, int] = {}
    for target in targets:
        found = sorted(int(knee.passed) for s in same
                       if (knee := bracket({row["index"]: passes(row["attainment"][target])
                                            for row in s["rates"] if row.get("index") is not None})).passed
                       is not None and knee.failed is not None)
        if found:
            knees[target] = found[(len(found) - 1) // 2]
    return knees


def probe_seconds(workload: GridWorkload, rate: float, prompts: int) -> float:
    """What a probe is expected to take: its arrivals, the drain, the client's own start."""
    return prompts / rate + workload.drain_s + CLIENT_OVERHEAD_S


# --- slices: what one device call of benchmarks/gpu/grid.sh runs -------------------------------

# Probes a workload's sweep is planned at: its tight targets' knees bracketed from the first probe
# (an octave out, two halvings each), the looser ones sharing most of those probes.
PLANNED_PROBES = 6
WARM_UP_S = 15.0  # proof.py's warm-up: 24 prompts of 2048 tokens at 8 req/s, and the client's start


@dataclass(frozen=True, slots=True)
class SliceGroup:
    """Arms started together (side by side on disjoint GPUs), each sweeping `workloads` in order."""

    workloads: tuple[str, ...]
    arms: tuple[str, ...]


def parse_slice(text: str) -> list[SliceGroup]:
    """`WORKLOAD[+WORKLOAD...]:ARM[/ARM...][,ARM[/ARM...]...]`: the workloads each arm sweeps
    against one start of it; `,` runs arms one after another, `/` side by side on disjoint GPUs,
    e.g. `isl8k+isl16k:1P1D,colocated-2` or `isl2k:colocated-1/vllm-1`."""
    workloads_text, sep, arms_text = text.partition(":")
    workloads = tuple(w for w in workloads_text.split("+") if w)
    if not sep or not workloads or not arms_text:
        raise ValueError(f"slice {text!r}: expected WORKLOAD[+WORKLOAD]:ARM[,ARM][/ARM]")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"slice {text!r}: unknown workload(s) {unknown}; one of {', '.join(WORKLOADS)}")
    groups = [SliceGroup(workloads, tuple(group.split("/"))) for group in arms_text.split(",")]
    for arm in (arm for group in groups for arm in group.arms):
        try:
            arm_spec(arm)
        except argparse.ArgumentTypeError as exc:  # it names the forms allowed
            raise ValueError(f"slice {text!r}: {exc}") from None
    return groups


def assign_gpus(arms: Sequence[str], visible: Sequence[str]) -> list[list[str]]:
    """Consecutive disjoint GPUs of `visible` for arms that run side by side."""
    assigned, first = [], 0
    for arm in arms:
        count = arm_spec(arm).num_gpus
        if first + count > len(visible):
            raise ValueError(f"arms {'/'.join(arms)} need {first + count} GPUs, {len(visible)} visible")
        assigned.append(list(visible[first:first + count]))
        first += count
    return assigned


def estimate_arm_s(workloads: Sequence[str], num_gpus: int, start_s: float) -> float:
    """An arm's expected seconds: its start, the warm-up, PLANNED_PROBES probes per workload at the
    workload's first rate (`probe_seconds`)."""
    total = start_s + WARM_UP_S
    for name in workloads:
        workload = WORKLOADS[name]
        rate = workload.rate_unit * num_gpus
        total += PLANNED_PROBES * probe_seconds(workload, rate, workload.num_prompts(rate))
    return total
