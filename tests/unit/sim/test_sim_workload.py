import numpy as np
import pytest

from pdserve.bench.arrivals import rate_offsets
from pdserve.bench.workloads import UniformLengths, draw_lengths
from pdserve.sim.cells import cell_topology, split
from pdserve.sim.runner import Topology
from pdserve.sim.workload import RateCurve, at_rate, bursty, curve_arrivals, diurnal, from_curve
from pdserve.autoscaler.policy import PoolBounds

pytestmark = pytest.mark.unit


def test_rate_workload_is_the_harness_schedule_and_lengths_for_the_same_seed():
    wl = at_rate("random", 50, 4.0, burstiness=0.5, seed=3, input_len=256, output_len=32,
                 range_ratio=0.5)
    rng = np.random.default_rng(3)
    pairs = draw_lengths(UniformLengths.from_range_ratio(256, 0.5),
                         UniformLengths.from_range_ratio(32, 0.5), 50, rng)
    assert wl.prompts.tolist() == [p for p, _ in pairs]
    assert wl.outputs.tolist() == [o for _, o in pairs]
    assert np.allclose(wl.arrivals, rate_offsets(50, 4.0, 0.5, np.random.default_rng(3)))


def test_curve_arrivals_follow_the_curve():
    curve = RateCurve((0.0, 100.0, 200.0), (10.0, 10.0, 30.0))  # 1000 + 2000 expected
    arrivals = curve_arrivals(curve, np.random.default_rng(0))
    assert np.all(np.diff(arrivals) >= 0) and arrivals[-1] <= 200.0
    first, second = (arrivals < 100).sum(), (arrivals >= 100).sum()
    assert 900 < first < 1100 and 1850 < second < 2150
    # within the ramp, the later half gets more than the earlier half (rate 20 -> 30 vs 10 -> 20)
    assert ((arrivals >= 150) & (arrivals < 200)).sum() > ((arrivals >= 100) & (arrivals < 150)).sum()


def test_diurnal_and_bursts():
    day = diurnal(100.0, trough_ratio=0.2)
    assert day.rate(14 * 3600) == pytest.approx(100.0)
    assert day.rate(2 * 3600) == pytest.approx(20.0)
    surged = bursty(day, bursts=3, burst_factor=2.0, burst_s=600, seed=1)
    ratio = surged.rate(np.linspace(0, 86400, 20000)) / day.rate(np.linspace(0, 86400, 20000))
    assert ratio.max() == pytest.approx(2.0, rel=0.01) and ratio.min() == pytest.approx(1.0)
    wl = from_curve(day.scaled(0.002), "chat", seed=0)
    assert len(wl) == pytest.approx(day.scaled(0.002).cumulative()[1][-1], rel=0.05)


def test_a_cell_is_a_share_of_engines_bounds_and_traffic():
    topo = Topology.disaggregated(10, 30, PoolBounds(4, 20), PoolBounds(8, 60))
    cell = cell_topology(topo, 10)
    assert dict(cell.pools) == {"prefill": 1, "decode": 3}
    assert (cell.bounds["prefill"].min_replicas, cell.bounds["prefill"].max_replicas) == (1, 2)
    assert (cell.bounds["decode"].min_replicas, cell.bounds["decode"].max_replicas) == (1, 6)
    wl = at_rate("random", 20000, 100.0, input_len=10, output_len=10)
    parts = [split(topo, wl, 4, i).workload for i in range(4)]
    assert sum(len(p) for p in parts) == 20000
    assert all(4500 < len(p) < 5500 for p in parts)
    # thinning keeps the rate curve: a quarter of the traffic arrives over the same span
    assert parts[0].span_s == pytest.approx(wl.span_s, rel=0.01)
