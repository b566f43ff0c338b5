"""benchmarks/frontend_scaling.py: its pure helpers (SSE counting, percentiles, scrapes, rows)."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).parents[3] / "benchmarks" / "frontend_scaling.py"
_spec = importlib.util.spec_from_file_location("frontend_scaling", _PATH)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def test_an_event_split_over_chunks_counts_once():
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        total, tail = 0, b""
        for chunk in (stream[:cut], stream[cut:]):
            n, tail = script.count_events(tail, chunk)
            total += n
        assert total == 2, cut


def test_percentiles_interpolate_and_an_empty_sample_has_none():
    assert script.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert script.percentile([1.0, 2.0, 3.0], 90) == pytest.approx(2.8)
    assert script.percentile([], 50) is None


def test_histogram_means_add_every_frontend_and_skip_one_seen_only_once():
    text = ('# HELP x\nm_sum{pool="colocated"} 0.5\nm_count{pool="colocated"} 100\n'
            'm_bucket{le="0.1"} 3\nm_sum{pool="prefill"} 0.25\nm_count{pool="prefill"} 50\n')
    assert script.histogram_totals(text, "m") == (0.75, 150)
    before = {"a": (1.0, 100), "b": (2.0, 10)}
    after = {"a": (1.2, 200), "b": (2.3, 110), "c": (9.0, 9)}  # c: not in the first scrape
    mean_ms, samples = script.mean_ms_between(before, after)
    assert samples == 200 and mean_ms == pytest.approx(2.5)
    assert script.mean_ms_between(before, before) == (None, 0)


def test_processes_count_under_their_role():
    assert script.classify(["ray::Ingress.start"], 5, 1, in_process=False) == "frontend"
    assert script.classify(["ray::EngineActor"], 5, 1, in_process=False) == "engines"
    assert script.classify(["ray::Controller.sync"], 5, 1, in_process=False) == "controller"
    assert script.classify(["/x/raylet", "--a"], 5, 1, in_process=False) == "ray_system"
    assert script.classify(["python", "-m", "pdserve"], 1, 1, in_process=True) == "frontend"
    assert script.classify(["python", "-m", "pdserve"], 1, 1, in_process=False) == "driver"


def test_the_summary_quotes_medians_and_the_spread():
    rows = [{"arm": "2", "replicas": 2, "tokens_per_s": v, "ttft_overhead_ms_p50": None}
            for v in (10.0, 30.0, 20.0)]
    (entry,) = script.summarize(rows, ("tokens_per_s", "ttft_overhead_ms_p50"))
    assert entry["tokens_per_s"] == 20.0 and entry["tokens_per_s_range"] == [10.0, 30.0]
    assert entry["repeats"] == 3 and "ttft_overhead_ms_p50" not in entry
