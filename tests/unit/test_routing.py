import pytest

from pdserve.scheduler.routing import ReplicaLoad, pick_least_loaded

pytestmark = pytest.mark.unit


def test_picks_fewest_outstanding_requests():
    loads = [ReplicaLoad("a", in_flight=3), ReplicaLoad("b", in_flight=1, num_waiting=1),
             ReplicaLoad("c", in_flight=4)]
    assert pick_least_loaded(loads) == "b"


def test_ties_break_on_kv_usage_then_id():
    loads = [ReplicaLoad("b", 1, kv_cache_usage=0.5), ReplicaLoad("a", 1, kv_cache_usage=0.5),
             ReplicaLoad("c", 1, kv_cache_usage=0.9)]
    assert pick_least_loaded(loads) == "a"


def test_skips_unhealthy_and_reports_none_when_all_are_down():
    loads = [ReplicaLoad("a", 0, healthy=False), ReplicaLoad("b", 9)]
    assert pick_least_loaded(loads) == "b"
    assert pick_least_loaded([ReplicaLoad("a", 0, healthy=False)]) is None
    assert pick_least_loaded([]) is None
