"""Pool-aware tuning: which split of N engines into prefill and decode pools, and which engine knobs,
give the most goodput under the SLO.

vLLM's `benchmarks/auto_tune` searches `max_num_seqs` x `max_num_batched_tokens` for one server. Here
the deployment is a dimension too: with a budget of N engines (GPUs), colocated xN and every xPyD with
x + y = N, each crossed with a small knob grid.

Lifecycle of `run_tuning`:
1. `plan_candidates` orders the candidates: deployment by deployment, and inside a deployment each
   `max_num_batched_tokens` value is a *series* over ascending `max_num_seqs`;
2. for each candidate in order: reuse its trial when one was recorded earlier (`--resume`), skip it when
   its series already dropped (`series_dropped`: goodput fell below the series' best by more than
   `prune_drop`, or a start failed after a success: larger batches will not bring it back), else call
   the injected `evaluate` (the CLI starts `pdserve serve`, runs the goodput search, stops it);
3. every trial (ok, failed or pruned) goes to `on_trial` at once, so a crash loses at most the
   candidate in progress; `rank_trials` orders the outcome by goodput per GPU.

Everything here is pure or takes the evaluator as a parameter, so the search is unit tested without a
server and a recorded JSON replays to the same decisions.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

TUNE_FORMAT_VERSION = 1


class DeploymentMode(str, Enum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True, slots=True)
class Deployment:
    """How engines are pooled: `replicas` colocated engines, or `prefill` + `decode` engines;
    `adaptive`: the decode engines also prefill while the prefill pool is behind
    (`pdserve serve --adaptive`, which routes against the SLO targets)."""

    mode: DeploymentMode
    replicas: int = 0
    prefill: int = 0
    decode: int = 0
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.mode is DeploymentMode.COLOCATED and (self.replicas < 1 or self.prefill or self.decode):
            raise ValueError("a colocated deployment needs replicas >= 1 and no prefill/decode pools")
        if self.mode is DeploymentMode.DISAGGREGATED and (
            self.prefill < 1 or self.decode < 1 or self.replicas
        ):
            raise ValueError("a disaggregated deployment needs prefill >= 1 and decode >= 1")
        if self.adaptive and self.mode is not DeploymentMode.DISAGGREGATED:
            raise ValueError("only a disaggregated deployment can be adaptive")

    @classmethod
    def colocated(cls, replicas: int) -> Deployment:
        return cls(DeploymentMode.COLOCATED, replicas=replicas)

    @classmethod
    def disaggregated(cls, prefill: int, decode: int, adaptive: bool = False) -> Deployment:
        return cls(DeploymentMode.DISAGGREGATED, prefill=prefill, decode=decode, adaptive=adaptive)

    @classmethod
    def parse(cls, spec: str, default_engines: int | None = None) -> Deployment:
        """"3P1D" (3 prefill, 1 decode), "1P1D-adaptive", "colocated:4", or "colocated"
        (= colocated:default_engines)."""
        text = spec.strip()
        if match := re.fullmatch(r"(\d+)[pP](\d+)[dD](-adaptive)?", text):
            return cls.disaggregated(int(match[1]), int(match[2]), bool(match[3]))
        name, _, count = text.partition(":")
        if name.lower() == "colocated":
            if count:
                if not count.isdigit():
                    raise ValueError(f"invalid deployment {spec!r}: colocated:N needs an integer N")
                return cls.colocated(int(count))
            if default_engines is None:
                raise ValueError(f"deployment {spec!r} needs :N or a total engine count")
            return cls.colocated(default_engines)
        raise ValueError(f"invalid deployment {spec!r}: use xPyD (e.g. 3P1D), xPyD-adaptive or "
                         "colocated[:N]")

    @property
    def num_engines(self) -> int:
        return self.replicas + self.prefill + self.decode

    @property
    def name(self) -> str:
        if self.mode is DeploymentMode.COLOCATED:
            return f"colocated:{self.replicas}"
        return f"{self.prefill}P{self.decode}D" + ("-adaptive" if self.adaptive else "")

    def serve_args(self) -> list[str]:
        """`pdserve serve` flags that build this deployment."""
        if self.mode is DeploymentMode.COLOCATED:
            return ["--mode", "colocated", "--replicas", str(self.replicas)]
        return ["--mode", "disaggregated", "--prefill", str(self.prefill), "--decode", str(self.decode),
                *(["--adaptive"] if self.adaptive else [])]


def deployments_for_budget(num_engines: int) -> list[Deployment]:
    """Colocated xN, then every xPyD with x + y = N, most prefill engines first, then each split
    adaptive (its decode engines also prefill while its prefill pool is behind)."""
    if num_engines < 1:
        raise ValueError(f"the engine budget must be >= 1, got {num_engines}")
    splits = [(p, num_engines - p) for p in range(num_engines - 1, 0, -1)]
    return [Deployment.colocated(num_engines),
            *(Deployment.disaggregated(p, d) for p, d in splits),
            *(Deployment.disaggregated(p, d, adaptive=True) for p, d in splits)]


@dataclass(frozen=True, slots=True)
class EngineKnobs:
    """Engine settings under search; None keeps the engine's default."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def serve_args(self) -> list[str]:
        args = []
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens is not None:
            args += ["--set", f"engine.max_num_batched_tokens={self.max_num_batched_tokens}"]
        return args

    @property
    def name(self) -> str:
        seqs = "default" if self.max_num_seqs is None else self.max_num_seqs
        tokens = "default" if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        return f"seqs={seqs},tokens={tokens}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the search: a deployment with engine knobs (every engine of it gets the knobs)."""

    deployment: Deployment
    knobs: EngineKnobs

    @property
    def key(self) -> str:
        """Stable identity across runs (the `--resume` lookup key)."""
        return f"{self.deployment.name}/{self.knobs.name}"

    @property
    def slug(self) -> str:
        """The key as a file name part: "colocated-4-seqs-64-tokens-default"."""
        return re.sub(r"[^A-Za-z0-9]+", "-", self.key).strip("-")

    @property
    def series(self) -> tuple[str, int | None]:
        """Candidates that differ only in max_num_seqs form a series, pruned together."""
        return (self.deployment.name, self.knobs.max_num_batched_tokens)


def _default_last(value: int | None) -> tuple[bool, int]:
    # The engine's default (vLLM: 256 seqs, a budget of thousands of tokens) is usually the largest.
    return (value is None, value or 0)


def plan_candidates(
    deployments: Sequence[Deployment],
    max_num_seqs: Sequence[int | None] = (None,),
    max_num_batched_tokens: Sequence[int | None] = (None,),
) -> list[Candidate]:
    """Every deployment x knob combination, in search order (duplicates dropped).

    Within a deployment, each max_num_batched_tokens value is a series over ascending max_num_seqs
    (engine default last), so pruning cuts off the large end of a series that has started to lose.
    """
    seqs = sorted(set(max_num_seqs), key=_default_last)
    tokens = sorted(set(max_num_batched_tokens), key=_default_last)
    if not deployments or not seqs or not tokens:
        raise ValueError("need at least one deployment and one value of each knob")
    plan: list[Candidate] = []
    for deployment in dict.fromkeys(deployments):
        for budget in tokens:
            plan += [Candidate(deployment, EngineKnobs(s, budget)) for s in seqs]
    return plan


@dataclass(frozen=True, slots=True)
class Probe:
    """One rate a goodput search tried: the share of requests meeting every target (`attainment`) and
    each target alone (`by_target`, e.g. (("ttft", 0.8), ("tpot", 1.0))): which SLO gave way first."""

    request_rate: float
    attainment: float
    by_target: tuple[tuple[str, float], ...] = ()


class TrialStatus(str, Enum):
    OK = "ok"  # the goodput search ran (its best rate may be 0: no probed rate met the SLO)
    FAILED = "failed"  # the service did not start or the benchmark could not run
    PRUNED = "pruned"  # skipped: its series had already dropped


@dataclass(frozen=True, slots=True)
class Trial:
    """The outcome of one candidate: max goodput (req/s) over `num_gpus`, and every (rate, attainment)
    probe of its search."""

    candidate: Candidate
    status: TrialStatus
    num_gpus: int
    max_goodput_rate: float = 0.0
    probes: tuple[Probe, ...] = ()
    error: str | None = None
    start_s: float | None = None  # service start to healthy
    wall_s: float | None = None  # whole trial, start to stop
    load_1m: float | None = None  # host load average when it ended (shared hosts: a noise indicator)

    @property
    def goodput_per_gpu(self) -> float:
        return self.max_goodput_rate / self.num_gpus


Evaluate = Callable[[Candidate], Awaitable[Trial]]


@dataclass(frozen=True, slots=True)
class TuneSettings:
    """`prune_drop`: a series stops once a trial's goodput falls below (1 - prune_drop) x the series'
    best so far; None disables pruning. `gpus_per_engine` scales per-GPU numbers (tensor parallel)."""

    prune_drop: float | None = 0.1
    gpus_per_engine: int = 1

    def __post_init__(self) -> None:
        if self.prune_drop is not None and not 0.0 <= self.prune_drop < 1.0:
            raise ValueError(f"prune_drop must be in [0, 1), got {self.prune_drop}")
        if self.gpus_per_engine < 1:
            raise ValueError(f"gpus_per_engine must be >= 1, got {self.gpus_per_engine}")

    def num_gpus(self, candidate: Candidate) -> int:
        return candidate.deployment.num_engines * self.gpus_per_engine


def series_dropped(trials_in_order: Sequence[Trial], prune_drop: float | None) -> bool:
    """Whether a series has dropped: a trial below (1 - prune_drop) x the best goodput before it, or a
    failure after a success. Pruned trials carry no measurement and are ignored."""
    if prune_drop is None:
        return False
    best = 0.0
    for trial in trials_in_order:
        if trial.status is TrialStatus.PRUNED:
            continue
        goodput = trial.max_goodput_rate if trial.status is TrialStatus.OK else 0.0
        if best > 0.0 and goodput < best * (1.0 - prune_drop):
            return True
        best = max(best, goodput)
    return False


def _pruned(candidate: Candidate, settings: TuneSettings) -> Trial:
    return Trial(candidate, TrialStatus.PRUNED, settings.num_gpus(candidate))


async def run_tuning(
    plan: Sequence[Candidate],
    evaluate: Evaluate,
    settings: TuneSettings,
    previous: Mapping[str, Trial] | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> list[Trial]:
    """Evaluate the plan in order (see the module docstring); returns one trial per candidate."""
    previous = previous or {}
    trials: list[Trial] = []
    for candidate in plan:
        series = [t for t in trials if t.candidate.series == candidate.series]
        recorded = previous.get(candidate.key)
        if recorded is not None and recorded.status is not TrialStatus.PRUNED:
            trial = recorded  # measured in an earlier run: reuse, do not re-measure
        elif series_dropped(series, settings.prune_drop):
            trial = _pruned(candidate, settings)
        else:
            trial = await evaluate(candidate)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    return trials


def rank_trials(trials: Sequence[Trial]) -> list[Trial]:
    """Best first: measured trials by goodput per GPU (ties: fewer max_num_seqs, i.e. plan order kept),
    then failed, then pruned."""
    order = {TrialStatus.OK: 0, TrialStatus.FAILED: 1, TrialStatus.PRUNED: 2}
    return sorted(trials, key=lambda t: (order[t.status], -t.goodput_per_gpu))


def best_per_deployment(trials: Sequence[Trial]) -> list[Trial]:
    """The best measured trial of each deployment, in the order the deployments were first tried."""
    best: dict[str, Trial] = {}
    for trial in trials:
        if trial.status is not TrialStatus.OK:
            continue
        name = trial.candidate.deployment.name
        if name not in best or trial.goodput_per_gpu > best[name].goodput_per_gpu:
            best[name] = trial
    return list(best.values())


# --- tables -------------------------------------------------------------------------------------------


def format_ranking(trials: Sequence[Trial]) -> str:
    """The ranked table the tuner prints: one row per candidate."""
    header = ("rank", "deployment", "engines", "max_num_seqs", "max_num_batched_tokens",
              "goodput req/s", "per GPU", "probes", "status")
    rows = []
    for rank, trial in enumerate(rank_trials(trials), start=1):
        knobs = trial.candidate.knobs
        measured = trial.status is TrialStatus.OK
        rows.append((
            str(rank) if measured else "-",
            trial.candidate.deployment.name,
            str(trial.candidate.deployment.num_engines),
            "default" if knobs.max_num_seqs is None else str(knobs.max_num_seqs),
            "default" if knobs.max_num_batched_tokens is None else str(knobs.max_num_batched_tokens),
            f"{trial.max_goodput_rate:.3f}" if measured else "-",
            f"{trial.goodput_per_gpu:.3f}" if measured else "-",
            str(len(trial.probes)),
            trial.status.value if not trial.error else f"{trial.status.value}: {trial.error[:60]}",
        ))
    return _table(header, rows)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
             for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --- JSON (the tuner's record, and what --resume reads) ------------------------------------------------


def trial_to_dict(trial: Trial) -> dict[str, Any]:
    deployment, knobs = trial.candidate.deployment, trial.candidate.knobs
    return {
        "key": trial.candidate.key,
        "deployment": deployment.name,
        "mode": deployment.mode.value,
        "replicas": deployment.replicas,
        "prefill": deployment.prefill,
        "decode": deployment.decode,
        "adaptive": deployment.adaptive,
        "max_num_seqs": knobs.max_num_seqs,
        "max_num_batched_tokens": knobs.max_num_batched_tokens,
        "status": trial.status.value,
        "num_gpus": trial.num_gpus,
        "max_goodput_rate": trial.max_goodput_rate,
        "goodput_per_gpu": trial.goodput_per_gpu,
        "probes": [
            {"request_rate": p.request_rate, "slo_attainment": p.attainment, "by_target": dict(p.by_target)}
            for p in trial.probes
        ],
        "error": trial.error,
        "start_s": trial.start_s,
        "wall_s": trial.wall_s,
        "load_1m": trial.load_1m,
    }


def trial_from_dict(data: Mapping[str, Any]) -> Trial:
    deployment = Deployment(
        DeploymentMode(data["mode"]),
        replicas=data["replicas"],
        prefill=data["prefill"],
        decode=data["decode"],
        adaptive=data.get("adaptive", False),  # records before adaptive deployments: False
    )
    knobs = EngineKnobs(data["max_num_seqs"], data["max_num_batched_tokens"])
    return Trial(
        candidate=Candidate(deployment, knobs),
        status=TrialStatus(data["status"]),
        num_gpus=data["num_gpus"],
        max_goodput_rate=data["max_goodput_rate"],
        probes=tuple(
            Probe(p["request_rate"], p["slo_attainment"], tuple(p.get("by_target", {}).items()))
            for p in data["probes"]
        ),
        error=data.get("error"),
        start_s=data.get("start_s"),
        wall_s=data.get("wall_s"),
        load_1m=data.get("load_1m"),
    )


@dataclass(frozen=True, slots=True)
class TuneRecord:
    """What the tuner writes: the settings that make trials comparable, and the trials so far."""

    settings: Mapping[str, Any]
    trials: Sequence[Trial] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        ranked = [t.candidate.key for t in rank_trials(self.trials) if t.status is TrialStatus.OK]
        return {
            "format_version": TUNE_FORMAT_VERSION,
            "settings": dict(self.settings),
            **dict(self.meta),
            "best": ranked[0] if ranked else None,
            "trials": [trial_to_dict(t) for t in self.trials],
        }


def resumable_trials(saved: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Trial]:
    """Trials of a saved record, by candidate key, if it was made with the same settings.

    Raises ValueError naming the differing settings: a trial measured under another workload or SLO
    is not comparable, so mixing it in would rank apples against oranges.
    """
    if saved.get("format_version") != TUNE_FORMAT_VERSION:
        raise ValueError(f"cannot resume: format version {saved.get('format_version')!r}, "
                         f"this pdserve writes {TUNE_FORMAT_VERSION}")
    old = saved.get("settings", {})
    differing = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if differing:
        details = ", ".join(f"{k}: saved {old.get(k)!r}, now {settings.get(k)!r}" for k in differing)
        raise ValueError(f"cannot resume: settings differ ({details})")
    return {trial.candidate.key: trial for trial in map(trial_from_dict, saved.get("trials", []))}
