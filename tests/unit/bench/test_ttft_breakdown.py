"""pdserve.bench.ttft_breakdown: a request's TTFT split at vLLM's scheduler and its step."""

import numpy as np
import pytest

from pdserve.bench import ttft_breakdown as script
from pdserve.engine.step_trace import Step

pytestmark = pytest.mark.unit


def test_the_parts_add_up_to_each_request_and_warm_ups_are_skipped():
    # Engine clock = client clock + 100 s. Two warm-ups, then three requests sent at 0, 1, 2 s
    # that reach the scheduler 0, 10 and 5 ms late, wait 2 ms, run 50 ms steps, and reach the
    # client 12 ms after their step.
    steps = [Step(t=90.05, prefill_tokens=8, prefill_reqs=1, decode_reqs=0, busy_s=0.05, arrived=[90.0]),
             Step(t=90.55, prefill_tokens=8, prefill_reqs=1, decode_reqs=0, busy_s=0.05, arrived=[90.5])]
    sends, late = [0.0, 1.0, 2.0], [0.0, 0.010, 0.005]
    ttfts = []
    for send, delay in zip(sends, late):
        arrived = 100 + send + delay
        steps.append(Step(t=arrived + 0.052, prefill_tokens=8, prefill_reqs=1, decode_reqs=0,
                          busy_s=0.05, arrived=[arrived]))
        ttfts.append(delay + 0.052 + 0.012)
    run = {"start_times": [2.0, 0.0, 1.0], "ttfts": [ttfts[2], ttfts[0], ttfts[1]]}
    rows = script.starts_of({"prefill-0": steps, "decode-0": steps[:1]})
    assert len(rows) == 5  # the decode engine's requests are not first tokens
    b = script.breakdown(run, rows)
    assert b["requests"] == 3
    assert b["in"] == pytest.approx(5.0, abs=0.2)  # 0, 10, 5 ms over the quickest
    assert b["wait"] == pytest.approx(2.0) and b["step"] == pytest.approx(50.0)
    assert b["out"] == pytest.approx(12.0, abs=0.2)
    assert b["in"] + b["wait"] + b["step"] + b["out"] == pytest.approx(b["ttft"])


def test_a_trace_with_fewer_arrivals_than_requests_is_an_error():
    with pytest.raises(ValueError, match="2 arrivals"):
        script.match(np.array([1.0, 2.0]), np.array([0.0, 1.0, 2.0]))


def test_repeats_of_one_arrival_schedule_are_matched_in_the_order_they_ran():
    # The same schedule twice (the second repeat a touch steadier): each run takes its own window.
    sends = [0.0, 0.7, 1.1, 2.9, 3.0]
    arrivals = [50 + t for t in sends] + [80 + t + 0.0001 * i for i, t in enumerate(sends)]
    arrivals[1] += 0.002  # the first repeat's way in was a little slower once
    arrived = np.array(arrivals)
    first = script.match(arrived, np.array(sends))
    assert first == 0
    assert script.match(arrived, np.array(sends), after=first + len(sends)) == 5


def test_the_actors_side_splits_the_way_in_and_out():
    # Engine clock = client clock + 100 s. The actor takes each request 1 ms after the send
    # (+4 ms once), hands it to vLLM's scheduler 3 ms later, and sees the first output 2 ms after
    # the step; the client 5 ms after that.
    sends = [0.0, 1.0, 2.0]
    steps, actors, ttfts = [], [], []
    for i, send in enumerate(sends):
        submitted = 100 + send + 0.001 + (0.004 if i == 1 else 0.0)
        arrived = submitted + 0.003
        end = arrived + 0.05
        steps.append(Step(t=end, prefill_tokens=8, prefill_reqs=1, decode_reqs=0, busy_s=0.05,
                          arrived=[arrived]))
        actors.append((submitted, end + 0.002))
        ttfts.append(end + 0.002 + 0.005 - 100 - send)
    run = {"start_times": sends, "ttfts": ttfts}
    rows = script.starts_of({"prefill-0": steps})
    b = script.breakdown(run, rows, actors=script.actor_rows({"prefill-0": actors, "decode-0": []}))
    assert b["to actor"] == pytest.approx(4 / 3, abs=0.1)  # 0, 4, 0 ms over the quickest
    assert b["actor in"] == pytest.approx(3.0) and b["actor out"] == pytest.approx(2.0)
    assert b["from actor"] == pytest.approx(5.0 + 1.0, abs=0.1)  # with the quickest way in
    assert b["to actor"] + b["actor in"] + b["wait"] + b["step"] + b["actor out"] + b["from actor"] \
        == pytest.approx(b["ttft"])
    assert "to actor" not in script.breakdown(run, rows)  # no actor rows, no split
