"""The chaos soak's pure logic: /metrics and /health parsing, time to heal, the report's counts and
verdict, reference comparison, the soak's schedules (pdserve.bench.chaos_report, pdserve.bench.chaos)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pdserve.bench.chaos import chaos_prompts, kill_times, pick_victim, poisson_arrivals
from pdserve.bench.chaos_report import (
    EngineSeries,
    HealthSample,
    Kill,
    MetricsSnapshot,
    Outcome,
    RequestRecord,
    SoakRun,
    build_report,
    error_key,
    exit_code,
    format_table,
    heal_summary,
    heal_time,
    health_changes,
    health_sample,
    mismatches,
    missing_references,
    parse_metrics,
    timeline,
)

pytestmark = pytest.mark.unit

UNRECOVERABLE = re.compile(r"no live engine|no engine can take")

METRICS = """\
# HELP pdserve_engine_info One series per engine (value 1).
# TYPE pdserve_engine_info gauge
pdserve_engine_info{node="10.0.0.1",pid="1234",pool="decode",replica="decode-0"} 1.0
pdserve_engine_info{node="10.0.0.1",pid="1300",pool="decode",replica="decode-1"} 1.0
pdserve_engine_info{node="10.0.0.2",pid="99",pool="prefill",replica="prefill-0"} 1.0
pdserve_engine_info{node="10.0.0.1",pid="55",pool="prefill",replica="prefill-old"} 0.0
pdserve_engine_info{node="10.0.0.1",pid="",pool="prefill",replica="odd"} 1.0
# TYPE pdserve_engine_restarts_total counter
pdserve_engine_restarts_total{pool="decode",reason="died"} 2.0
pdserve_engine_restarts_created{pool="decode",reason="died"} 1.7e9
pdserve_requests_migrated_total{pool="decode"} 5.0
pdserve_kv_cache_usage_ratio{pool="decode",replica="decode-0"} 0.25
pdserve_kv_cache_usage_ratio{pool="decode",replica="decode-1"} 0.0
pdserve_requests_running{pool="decode"} 3.0
pdserve_requests_total{outcome="error",detail="a \\"quoted\\", comma"} 4.0
"""


def test_metrics_text_gives_live_engines_with_their_pids_and_the_counters():
    snapshot = MetricsSnapshot.from_text(METRICS)
    assert snapshot.engines == (
        EngineSeries("decode", "decode-0", 1234, "10.0.0.1"),
        EngineSeries("decode", "decode-1", 1300, "10.0.0.1"),
        EngineSeries("prefill", "prefill-0", 99, "10.0.0.2"),
    )
    assert snapshot.restarts == {("decode", "died"): 2.0}
    assert snapshot.migrated == {("decode",): 5.0}
    assert snapshot.kv_usage[("decode", "decode-0")] == 0.25
    assert snapshot.engines_per_pool() == {"decode": 2, "prefill": 1}
    assert not snapshot.idle()


def test_label_values_with_quotes_and_commas_parse():
    sample = [s for s in parse_metrics(METRICS) if s.name == "pdserve_requests_total"][0]
    assert sample.labels == {"outcome": "error", "detail": 'a "quoted", comma'}
    assert sample.value == 4.0


def test_a_killed_engines_stale_series_does_not_count_as_busy():
    snapshot = MetricsSnapshot.from_text(METRICS.replace('pdserve_requests_running{pool="decode"} 3.0', ""))
    assert not snapshot.idle()
    assert snapshot.idle(dead_pids=frozenset({1234}))
    live = snapshot.kv_usage_of_live(frozenset({1234}))
    assert [row["replica"] for row in live] == ["decode-1", "prefill-0"]


def test_health_answers_of_the_contract_and_of_odd_services():
    body = {"status": "degraded", "reason": "decode below size", "extra": 1,
            "pools": {"prefill": {"serving": 1, "target": 1, "starting": 0},
                      "decode": {"serving": 1, "target": 2, "starting": 1}}}
    sample = health_sample(3.0, 200, body, MetricsSnapshot.from_text(METRICS))
    assert (sample.status, sample.reason, sample.ready) == ("degraded", "decode below size", False)
    assert sample.serving == {"prefill": 1, "decode": 1}
    assert sample.engines == {"decode": 2, "prefill": 1}
    assert sample.pids == frozenset({1234, 1300, 99})
    assert health_sample(1.0, 200, {"status": "ready", "pools": {}}).ready
    assert health_sample(1.0, None, None).status == "unreachable"
    assert health_sample(1.0, 503, "not json").status == "http-503"
    assert health_sample(1.0, 200, {"status": "ok"}).ready is False  # an older service's answer


def sample(t, status, pids=None):
    return HealthSample(t, 200 if status != "down" else 503, status,
                        pids=frozenset(pids) if pids is not None else None)


KILL = Kill(10.0, "decode", "decode-0", 1234, "10.0.0.1")


def test_heal_time_runs_from_the_kill_to_the_first_ready_after_the_service_noticed():
    samples = [sample(9.5, "ready"), sample(10.2, "ready"),  # not noticed yet
               sample(10.7, "degraded"), sample(11.2, "degraded"), sample(13.5, "ready")]
    assert heal_time(KILL, samples) == pytest.approx(3.5)


def test_a_replacement_between_two_polls_heals_when_the_pid_is_gone():
    samples = [sample(10.4, "ready", {1234, 1300}), sample(10.9, "ready", {777, 1300})]
    assert heal_time(KILL, samples) == pytest.approx(0.9)


def test_once_noticed_the_first_ready_heals_even_if_the_dead_pid_is_still_listed():
    samples = [sample(10.5, "ready", {1234}), sample(11.0, "degraded", {1234}), sample(12.0, "ready", {1234})]
    assert heal_time(KILL, samples) == pytest.approx(2.0)


def test_a_kill_never_followed_by_ready_has_no_heal_time():
    samples = [sample(10.5, "down"), sample(20.0, "degraded"), sample(30.0, "ok")]
    assert heal_time(KILL, samples) is None
    later = Kill(20.0, "prefill", "prefill-0", 99, "10.0.0.2")
    summary = heal_summary([KILL, later], [sample(11, "down"), sample(14, "ready"), sample(21, "down")])
    assert summary == {"per_kill_s": [4.0, None], "p50_s": 4.0, "max_s": 4.0, "unhealed": 1}


def record(index, outcome, text="", error="", sent=1.0, ended=2.0):
    return RequestRecord(index, True, sent, ended, outcome, text, error)


def test_only_completed_requests_are_compared_with_their_prompts_reference():
    prompts = ["p0", "p1"]
    references = {"p0": " a b", "p1": " c d"}
    records = [record(0, Outcome.COMPLETED, " a b"), record(1, Outcome.COMPLETED, " c X"),
               record(1, Outcome.FAILED, " c", "died"), record(0, Outcome.HUNG)]
    count, examples = mismatches(records, prompts, references)
    assert count == 1
    assert examples[0] | {"sent_s": None} == {"prompt_index": 1, "stream": True, "sent_s": None,
                                              "prompt": "p1", "expected": " c d", "got": " c X"}
    assert missing_references(["p0", "p1", "p2"], references) == [2]


def test_error_messages_group_without_their_request_ids():
    first = error_key("The engine serving this request died or failed; retry (request id cmpl-3f9a2b7c1d).")
    second = error_key("The engine serving this request died or failed; retry (request id cmpl-81c0ffee42).")
    assert first == second and "#" in first and "died" in first
    assert len(error_key("x" * 1000)) < 200


def run_of(records, kills=(), samples=(), kv_end=0.0, references=None):
    start = MetricsSnapshot(restarts={("decode", "died"): 1.0}, migrated={("decode",): 2.0})
    end = MetricsSnapshot(
        engines=(EngineSeries("decode", "decode-0", 777, "n"), EngineSeries("decode", "decode-9", 1234, "n")),
        restarts={("decode", "died"): 3.0, ("prefill", "hung"): 1.0}, migrated={("decode",): 5.0},
        kv_usage={("decode", "decode-0"): kv_end, ("decode", "decode-9"): 0.5})
    prompts = ["p0", "p1"]
    return SoakRun({"url": "u"}, prompts, references or {"p0": "A", "p1": "B"}, records, kills, [],
                   samples, start, end, {"ready_and_idle": True}, 12.0)


def test_report_counts_add_up_and_a_clean_soak_exits_0():
    records = [record(0, Outcome.COMPLETED, "A"), record(1, Outcome.COMPLETED, "B", ended=7.0),
               record(0, Outcome.FAILED, error="HTTP 503: no engine can take requests in pool 'decode'")]
    report = build_report(run_of(records, [KILL], [sample(11, "down"), sample(13, "ready")]), UNRECOVERABLE)
    assert (report["sent"], report["completed"], report["failed"], report["hung"]) == (3, 2, 1, 0)
    assert report["sent"] == report["completed"] + report["failed"] + report["hung"]
    assert (report["lost"], report["unrecoverable"], report["mismatched"]) == (0, 1, 0)
    assert report["restarts"] == {"decode": {"died": 2.0}, "prefill": {"hung": 1.0}}
    assert report["migrated"] == {"decode": 3.0}
    assert report["kills"] == [
        {"t": 10.0, "pool": "decode", "replica": "decode-0", "pid": 1234, "node": "10.0.0.1"}]
    assert report["heal"]["per_kill_s"] == [3.0]
    # The killed pid's stale series (decode-9 here) is left out of the KV check.
    assert report["kv_usage_end"] == [{"pool": "decode", "replica": "decode-0", "pid": 777, "kv_usage": 0.0}]
    assert report["verdict"] == [] and exit_code(report) == 0
    json.dumps(report)  # JSON-ready as it is
    assert "survived" in format_table(report)


@pytest.mark.parametrize(("records", "kv_end", "reason"), [
    ([record(0, Outcome.HUNG)], 0.0, "1 request(s) hung"),
    ([record(0, Outcome.COMPLETED, "wrong")], 0.0, "differed from the reference"),
    ([record(0, Outcome.FAILED, error="The engine serving this request died")], 0.0, "were lost"),
    ([record(0, Outcome.COMPLETED, "A")], 0.125, "KV cache not back to 0"),
])
def test_a_hang_a_mismatch_a_lost_request_or_leftover_kv_fails_the_soak(records, kv_end, reason):
    report = build_report(run_of(records, [KILL], kv_end=kv_end), UNRECOVERABLE)
    assert len(report["verdict"]) == 1 and reason in report["verdict"][0]
    assert exit_code(report) == 3
    assert "survived" not in format_table(report)


def test_timeline_buckets_requests_by_when_they_ended_and_takes_the_worst_health():
    records = [record(0, Outcome.COMPLETED, sent=1.0, ended=2.0),
               record(0, Outcome.FAILED, sent=3.0, ended=6.0),
               record(0, Outcome.HUNG, sent=4.0, ended=14.0)]
    samples = [HealthSample(0.5, 200, "ready", {"decode": 2}, {"decode": 2}),
               HealthSample(5.5, 503, "down", {}, {"decode": 1}),
               HealthSample(9.5, 200, "degraded", {"decode": 1}, {"decode": 1})]
    buckets = timeline(records, samples, end_s=10.0, bucket_s=5.0)
    assert [b["t"] for b in buckets] == [0.0, 5.0, 10.0]
    assert [(b["sent"], b["completed"], b["failed"], b["hung"]) for b in buckets] == [
        (3, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)]
    assert [b["health"] for b in buckets] == ["ready", "down", None]
    assert [b["serving"] for b in buckets] == [{"decode": 2}, {"decode": 1}, {}]


def test_prompts_are_distinct_deterministic_and_of_varied_lengths():
    prompts = chaos_prompts(16, seed=0, max_words=200)
    assert prompts == chaos_prompts(16, seed=0, max_words=200)
    assert len(set(prompts)) == 16
    lengths = [len(p.split()) for p in prompts]
    assert min(lengths) < 20 and max(lengths) > 60


def test_arrivals_and_kills_follow_their_schedules():
    arrivals = poisson_arrivals(4.0, 500.0, np.random.default_rng(1))
    assert all(0 < t < 500 for t in arrivals) and arrivals == sorted(arrivals)
    assert len(arrivals) / 500 == pytest.approx(4.0, rel=0.1)
    kills = kill_times(10.0, 20.0, 300.0, np.random.default_rng(1))
    assert kills[0] == 10.0 and all(t < 300 for t in kills)
    assert kill_times(10.0, 20.0, 300.0, np.random.default_rng(1), max_kills=2) == kills[:2]
    assert kill_times(10.0, 20.0, 5.0, np.random.default_rng(1)) == []


def test_the_victim_is_a_live_local_engine_of_the_chosen_pools():
    engines = MetricsSnapshot.from_text(METRICS).engines
    rng = np.random.default_rng(0)
    local = {"10.0.0.1"}.__contains__
    picks = {pick_victim(engines, ["decode", "prefill"], local, lambda pid: pid != 1300, rng)
             for _ in range(20)}
    assert picks == {engines[0]}  # decode-1 is dead, prefill-0 on another node
    assert pick_victim(engines, ["prefill"], local, lambda pid: True, rng) is None
    assert pick_victim(engines, ["prefill"], lambda node: True, lambda pid: True, rng).pid == 99


def test_health_changes_keep_only_the_polls_where_something_changed():
    polls = [(0.5, "ready", 2), (1.0, "ready", 2), (1.5, "degraded", 1), (2.0, "degraded", 1),
             (2.5, "ready", 2)]
    samples = [HealthSample(t, 200, status, {"decode": n}) for t, status, n in polls]
    assert health_changes(samples) == [
        {"t": 0.5, "status": "ready", "serving": {"decode": 2}},
        {"t": 1.5, "status": "degraded", "serving": {"decode": 1}},
        {"t": 2.5, "status": "ready", "serving": {"decode": 2}}]
