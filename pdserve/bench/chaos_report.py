"""What a chaos soak observed, and the report and verdict made of it: plain values, no I/O.

`pdserve bench chaos` (chaos.py) drives a service, kills its engines and polls it; everything it sees
becomes one of the values here (a Prometheus scrape -> `MetricsSnapshot`, a /health answer ->
`HealthSample`, a request -> `RequestRecord`, a kill -> `Kill`). `build_report` turns a whole
`SoakRun` into the JSON-ready report, `verdict` says why the service did not survive (empty: it
did), `format_table` prints the summary. The tests drive these with hand-written values.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

# /health statuses of the self-healing contract, best first; anything else (an older service's "ok",
# "unreachable" when it did not answer) ranks after them.
HEALTH_ORDER = ("ready", "degraded", "down")
UNREACHABLE = "unreachable"
# Error messages are grouped after masking what differs per request (ids, pids) and truncated:
# the report counts kinds of failure, it does not keep every body.
_ERROR_CHARS = 160
_ID_PATTERN = re.compile(r"\b(?=[0-9a-f-]*\d)[0-9a-f]{4,}(?:-[0-9a-f]+)*\b|\d{4,}")
MAX_EXAMPLES = 5
_LABEL_PATTERN = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# --- /metrics ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One Prometheus sample: `name{labels} value`."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition; comments and malformed lines are skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, brace, label_text = series.partition("{")
        try:
            number = float(value)
        except ValueError:
            continue
        labels = {key: value.replace('\\"', '"').replace("\\\\", "\\")
                  for key, value in _LABEL_PATTERN.findall(label_text)}
        samples.append(Sample(name.strip(), labels if brace else {}, number))
    return samples


@dataclass(frozen=True, slots=True)
class EngineSeries:
    """One live engine as /metrics lists it (`pdserve_engine_info`)."""

    pool: str
    replica: str
    pid: int
    node: str


def engine_series(samples: Sequence[Sample]) -> tuple[EngineSeries, ...]:
    """Engines with a `pdserve_engine_info` series of value 1 (a series with no usable pid is skipped)."""
    engines = []
    for s in samples:
        if s.name != "pdserve_engine_info" or s.value == 0:
            continue
        try:
            pid = int(s.labels.get("pid", ""))
        except ValueError:
            continue
        engines.append(EngineSeries(s.labels.get("pool", ""), s.labels.get("replica", ""), pid,
                                    s.labels.get("node", "")))
    return tuple(engines)


def values_by(samples: Sequence[Sample], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """`name`'s values keyed by the given labels' values (summed when other labels differ)."""
    values: dict[tuple[str, ...], float] = {}
    for s in samples:
        if s.name == name:
            key = tuple(s.labels.get(label, "") for label in labels)
            values[key] = values.get(key, 0.0) + s.value
    return values


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """The parts of one /metrics scrape the soak reads."""

    engines: tuple[EngineSeries, ...] = ()
    restarts: Mapping[tuple[str, ...], float] = field(default_factory=dict)  # (pool, reason)
    migrated: Mapping[tuple[str, ...], float] = field(default_factory=dict)  # (pool,)
    kv_usage: Mapping[tuple[str, ...], float] = field(default_factory=dict)  # (pool, replica)
    running: Mapping[tuple[str, ...], float] = field(default_factory=dict)  # (pool,)

    @classmethod
    def from_text(cls, text: str) -> MetricsSnapshot:
        samples = parse_metrics(text)
        return cls(
            engines=engine_series(samples),
            restarts=values_by(samples, "pdserve_engine_restarts_total", "pool", "reason"),
            migrated=values_by(samples, "pdserve_requests_migrated_total", "pool"),
            kv_usage=values_by(samples, "pdserve_kv_cache_usage_ratio", "pool", "replica"),
            running=values_by(samples, "pdserve_requests_running", "pool"),
        )

    def engines_per_pool(self, dead_pids: frozenset[int] = frozenset()) -> dict[str, int]:
        return dict(Counter(e.pool for e in self.engines if e.pid not in dead_pids))

    def kv_usage_of_live(self, dead_pids: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """KV usage of each listed engine, but those known dead (a stale series outlives its process
        on a service that keeps dead engines' series)."""
        return [{"pool": e.pool, "replica": e.replica, "pid": e.pid,
                 "kv_usage": self.kv_usage.get((e.pool, e.replica))}
                for e in self.engines if e.pid not in dead_pids]

    def idle(self, dead_pids: frozenset[int] = frozenset()) -> bool:
        """Nothing running in any pool and no KV in use on any live engine."""
        busy_kv = any((row["kv_usage"] or 0.0) > 0 for row in self.kv_usage_of_live(dead_pids))
        return not busy_kv and not any(v > 0 for v in self.running.values())


def counter_delta(start: Mapping[tuple[str, ...], float],
                  end: Mapping[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    """How much each counter grew (a series first seen at the end grew from 0); unchanged ones left out."""
    return {key: value - start.get(key, 0.0) for key, value in end.items()
            if value - start.get(key, 0.0) != 0}


# --- /health -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthSample:
    """One poll at `t` s into the soak: /health's answer and the engine pids /metrics listed with it."""

    t: float
    http_status: int | None  # None: no answer
    status: str
    serving: Mapping[str, int] = field(default_factory=dict)  # /health's pools.*.serving
    engines: Mapping[str, int] = field(default_factory=dict)  # /metrics' engine series per pool
    reason: str | None = None
    pids: frozenset[int] | None = None  # None: /metrics not scraped or not answering

    @property
    def ready(self) -> bool:
        return self.status == "ready"


def health_sample(t: float, http_status: int | None, body: Any, metrics: MetricsSnapshot | None = None,
                  dead_pids: frozenset[int] = frozenset()) -> HealthSample:
    """A /health answer as a sample; extra keys are ignored, a missing or odd body tolerated.

    The engines counted per pool leave out `dead_pids` (engines the soak killed: a service that keeps
    a dead engine's series would otherwise show it serving); `pids` keeps every listed pid.
    """
    body = body if isinstance(body, dict) else {}
    if http_status is None:
        status = UNREACHABLE
    else:
        status = str(body.get("status") or f"http-{http_status}")
    serving = {}
    pools = body.get("pools")
    if isinstance(pools, dict):
        for pool, state in pools.items():
            if isinstance(state, dict) and isinstance(state.get("serving"), int | float):
                serving[str(pool)] = int(state["serving"])
    reason = body.get("reason")
    return HealthSample(
        t, http_status, status, serving,
        metrics.engines_per_pool(dead_pids) if metrics else {},
        str(reason) if reason is not None else None,
        frozenset(e.pid for e in metrics.engines) if metrics else None,
    )


def worst_status(statuses: Sequence[str]) -> str | None:
    """The worst of some statuses: ready < degraded < down < anything else (unreachable, unknown)."""
    if not statuses:
        return None
    rank = {status: i for i, status in enumerate(HEALTH_ORDER)}
    return max(statuses, key=lambda s: rank.get(s, len(HEALTH_ORDER)))


# --- kills and healing ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kill:
    """One engine process SIGKILLed at `t` s into the soak."""

    t: float
    pool: str
    replica: str
    pid: int
    node: str


def heal_time(kill: Kill, samples: Sequence[HealthSample]) -> float | None:
    """Seconds from the kill to the first `ready` after the service noticed it; None: never healed.

    A `ready` seen before the service noticed the death (its engine checks run about once a second)
    says nothing, so healing counts from the first sample that shows the kill: a status other than
    ready, or the killed pid gone from /metrics. A service that replaces the engine between two polls
    is noticed and healed at the same sample (the pid gone, status ready).
    """
    noticed = False
    for sample in sorted(samples, key=lambda s: s.t):
        if sample.t <= kill.t:
            continue
        noticed = noticed or not sample.ready or (sample.pids is not None and kill.pid not in sample.pids)
        if noticed and sample.ready:
            return sample.t - kill.t
    return None


def heal_summary(kills: Sequence[Kill], samples: Sequence[HealthSample]) -> dict[str, Any]:
    times = [heal_time(kill, samples) for kill in kills]
    healed = [t for t in times if t is not None]
    return {
        "per_kill_s": times,
        "p50_s": statistics.median(healed) if healed else None,
        "max_s": max(healed) if healed else None,
        "unhealed": len(times) - len(healed),
    }


# --- requests ------------------------------------------------------------------------------------------


class Outcome(Enum):
    COMPLETED = "completed"
    FAILED = "failed"  # an HTTP error, an SSE error event, a broken stream
    HUNG = "hung"  # no completion within the request timeout


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request the soak sent: times in s into the soak (a hung one ends at its timeout)."""

    prompt_index: int
    stream: bool
    sent_s: float
    ended_s: float
    outcome: Outcome
    text: str = ""
    error: str = ""


def error_key(message: str) -> str:
    """The message with per-request ids and pids masked, truncated: failures of one kind count together."""
    masked = _ID_PATTERN.sub("#", " ".join(message.split()))
    return masked if len(masked) <= _ERROR_CHARS else masked[:_ERROR_CHARS] + "..."


def mismatches(records: Sequence[RequestRecord], prompts: Sequence[str],
               references: Mapping[str, str]) -> tuple[int, list[dict[str, Any]]]:
    """Completed requests whose text differs from their prompt's reference: the count and a few examples."""
    count, examples = 0, []
    for record in records:
        if record.outcome is not Outcome.COMPLETED:
            continue
        prompt = prompts[record.prompt_index]
        expected = references.get(prompt)
        if expected is None or record.text == expected:
            continue
        count += 1
        if len(examples) < MAX_EXAMPLES:
            examples.append({"prompt_index": record.prompt_index, "stream": record.stream,
                             "sent_s": round(record.sent_s, 3), "prompt": prompt[:80],
                             "expected": expected[:200], "got": record.text[:200]})
    return count, examples


def missing_references(prompts: Sequence[str], references: Mapping[str, str]) -> list[int]:
    """Indexes of the prompts a reference file has no text for."""
    return [i for i, prompt in enumerate(prompts) if prompt not in references]


# --- the report ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SoakRun:
    """Everything one soak observed; `config` is already JSON-ready (flags, URL, /health at start)."""

    config: Mapping[str, Any]
    prompts: Sequence[str]
    references: Mapping[str, str]
    records: Sequence[RequestRecord]
    kills: Sequence[Kill]
    skipped_kills: Sequence[Mapping[str, Any]]
    samples: Sequence[HealthSample]
    metrics_start: MetricsSnapshot
    metrics_end: MetricsSnapshot
    settle: Mapping[str, Any]
    duration_s: float  # of the load: no request was sent nor engine killed after it


def build_report(run: SoakRun, unrecoverable: re.Pattern[str], bucket_s: float = 5.0) -> dict[str, Any]:
    """The JSON report: counts, failures by kind, mismatches, metrics deltas, kills and healing, timeline.

    A failed request is `lost` unless its error matches `unrecoverable` (the service said no live engine
    could continue it): those are counted apart and do not fail the verdict.
    """
    by_outcome = Counter(r.outcome for r in run.records)
    failed = [r for r in run.records if r.outcome is Outcome.FAILED]
    unrecoverable_failures = [r for r in failed if unrecoverable.search(r.error)]
    mismatched, examples = mismatches(run.records, run.prompts, run.references)
    dead = frozenset(k.pid for k in run.kills)
    restarts: dict[str, dict[str, float]] = {}
    for (pool, reason), delta in counter_delta(run.metrics_start.restarts, run.metrics_end.restarts).items():
        restarts.setdefault(pool, {})[reason] = delta
    migrated = {key[0]: delta for key, delta in
                counter_delta(run.metrics_start.migrated, run.metrics_end.migrated).items()}
    report = {
        "config": dict(run.config),
        "duration_s": round(run.duration_s, 3),
        "sent": len(run.records),
        "completed": by_outcome[Outcome.COMPLETED],
        "failed": len(failed),
        "hung": by_outcome[Outcome.HUNG],
        "lost": len(failed) - len(unrecoverable_failures),
        "unrecoverable": len(unrecoverable_failures),
        "mismatched": mismatched,
        "mismatch_examples": examples,
        "failures_by_error": dict(Counter(error_key(r.error) for r in failed).most_common()),
        "unrecoverable_by_error": dict(Counter(error_key(r.error) for r in unrecoverable_failures)),
        "migrated": migrated,
        "restarts": restarts,
        "kills": [asdict(k) | {"t": round(k.t, 3)} for k in run.kills],
        "skipped_kills": list(run.skipped_kills),
        "heal": heal_summary(run.kills, run.samples),
        "kv_usage_end": run.metrics_end.kv_usage_of_live(dead),
        "settle": dict(run.settle),
        "timeline": timeline(run.records, run.samples, run.duration_s, bucket_s),
        "health_changes": health_changes(run.samples),
    }
    report["verdict"] = verdict(report)
    return report


def timeline(records: Sequence[RequestRecord], samples: Sequence[HealthSample], end_s: float,
             bucket_s: float) -> list[dict[str, Any]]:
    """Per bucket: requests sent / completed / failed / hung (by when they ended), engines serving per
    pool (the bucket's last poll: /health's count where it gives one, else /metrics' series) and the
    worst health status polled in it."""
    last_end = max([end_s, *(r.ended_s for r in records), *(s.t for s in samples)])
    count = max(1, int(last_end // bucket_s) + 1)
    buckets: list[dict[str, Any]] = [
        {"t": round(i * bucket_s, 3), "sent": 0, "completed": 0, "failed": 0, "hung": 0,
         "serving": {}, "health": None} for i in range(count)]
    for r in records:
        buckets[min(count - 1, int(r.sent_s // bucket_s))]["sent"] += 1
        buckets[min(count - 1, int(r.ended_s // bucket_s))][r.outcome.value] += 1
    in_bucket: dict[int, list[HealthSample]] = {}
    for s in sorted(samples, key=lambda s: s.t):
        in_bucket.setdefault(min(count - 1, int(s.t // bucket_s)), []).append(s)
    for index, polled in in_bucket.items():
        last = polled[-1]
        buckets[index]["serving"] = {**last.engines, **last.serving}
        buckets[index]["health"] = worst_status([s.status for s in polled])
    return buckets


def health_changes(samples: Sequence[HealthSample]) -> list[dict[str, Any]]:
    """The polls at which the health status or an engine count changed (and the first): the exact steps
    the 5 s timeline blurs, small enough to keep for a long soak."""
    changes: list[dict[str, Any]] = []
    for s in sorted(samples, key=lambda s: s.t):
        state = {"status": s.status, "serving": {**s.engines, **s.serving}}
        if not changes or {k: changes[-1][k] for k in state} != state:
            changes.append({"t": round(s.t, 3), **state})
    return changes


def verdict(report: Mapping[str, Any]) -> list[str]:
    """Why the service did not survive the soak; empty when it did."""
    reasons = []
    for key, what in (("hung", "hung"), ("mismatched", "differed from the reference"),
                      ("lost", "were lost (failed without 'no live engine')")):
        if report[key]:
            reasons.append(f"{report[key]} request(s) {what}")
    busy = [f"{row['replica']}={row['kv_usage']:g}" for row in report["kv_usage_end"]
            if (row["kv_usage"] or 0.0) > 0]
    if busy:
        reasons.append(f"KV cache not back to 0 after the soak: {', '.join(busy)}")
    return reasons


def exit_code(report: Mapping[str, Any]) -> int:
    """0: the service survived; 3: it did not (1 is left for a soak that could not run)."""
    return 3 if report["verdict"] else 0


def format_table(report: Mapping[str, Any]) -> str:
    heal = report["heal"]
    fmt = (lambda v: "-" if v is None else f"{v:.1f}")
    rows = [
        ("requests sent", report["sent"]),
        ("completed", report["completed"]),
        ("failed: lost", report["lost"]),
        ("failed: no live engine", report["unrecoverable"]),
        ("hung", report["hung"]),
        ("mismatched", report["mismatched"]),
        ("engines killed", len(report["kills"])),
        ("time to heal p50 / max (s)", f"{fmt(heal['p50_s'])} / {fmt(heal['max_s'])}"),
        ("kills never healed", heal["unhealed"]),
        ("migrated", _flat(report["migrated"])),
        ("restarts", _flat({f"{p}/{r}": v for p, d in report["restarts"].items() for r, v in d.items()})),
        ("KV usage at the end", _flat({row["replica"]: row["kv_usage"] for row in report["kv_usage_end"]})),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    for message, count in list(report["failures_by_error"].items())[:MAX_EXAMPLES]:
        lines.append(f"  {count:>5} x {message}")
    lines.append("verdict: " + ("survived" if not report["verdict"] else "; ".join(report["verdict"])))
    return "\n".join(lines)


def _flat(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}"
                     for k, v in values.items()) or "-"
