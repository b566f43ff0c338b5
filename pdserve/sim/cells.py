"""Sampled large-scale runs: simulate one cell of a big deployment, scale the totals up.

The production router looks at every engine for every request, so simulating 1000 engines
costs ~1000 x more per request than one engine. A large deployment that spreads traffic evenly
behaves, request for request, like `cells` independent copies of a cell with 1/cells of its
engines (and bounds) and 1/cells of its traffic. `split` builds that cell: its workload is a
random thinning of the whole one (each request lands in cell `index` with probability
1/cells, so Poisson arrivals stay Poisson and curves keep their shape), its topology the
rounded-up share of each pool. One simulated cell then gives the latency distributions and SLO
attainment of the whole; GPU-hours, throughput and goodput multiply by `cells`.

The approximation: a cell routes among fewer engines than the global scheduler would, so its
queues balance a little worse (pessimistic for latency at small cells; cells of 16+ engines
pool nearly as well as one big pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.autoscaler.policy import PoolBounds
from pdserve.sim.runner import Topology
from pdserve.sim.workload import Workload


@dataclass(frozen=True, slots=True)
class Cell:
    cells: int
    index: int
    topology: Topology
    workload: Workload


def cell_topology(topology: Topology, cells: int) -> Topology:
    pools = {p: max(1, math.ceil(n / cells)) for p, n in topology.pools.items()}
    bounds = None
    if topology.bounds:
        bounds = {p: PoolBounds(math.ceil(b.min_replicas / cells),
                                max(1, math.ceil(b.max_replicas / cells)))
                  for p, b in topology.bounds.items()}
    return Topology(pools, bounds)


def thin(workload: Workload, cells: int, index: int, seed: int = 0) -> Workload:
    if cells == 1:
        return workload
    keep = np.random.default_rng((seed, cells)).integers(0, cells, len(workload)) == index
    return Workload(workload.arrivals[keep], workload.prompts[keep], workload.outputs[keep],
                    f"{workload.name} (cell {index + 1}/{cells})")


def split(topology: Topology, workload: Workload, cells: int, index: int = 0,
          seed: int = 0) -> Cell:
    if cells < 1 or not 0 <= index < cells:
        raise ValueError(f"need cells >= 1 and 0 <= index < cells, got {cells}, {index}")
    return Cell(cells, index, cell_topology(topology, cells), thin(workload, cells, index, seed))


def scale_totals(body: dict, cells: int) -> dict:
    """Multiply a run's totals (not its latencies or shares) by the number of cells."""
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "num_prompts"):
        if isinstance(body.get(key), (int, float)):
            body[key] = body[key] * cells
    sim = body.get("simulation")
    if sim:
        sim["cells"] = cells
        sim["gpu_hours"] *= cells
        sim["gpu_hours_by_pool"] = {p: h * cells for p, h in sim["gpu_hours_by_pool"].items()}
        sim["engines_started"] *= cells
        sim["note"] = (f"one cell of {cells} simulated (1/{cells} of engines and traffic); "
                       "totals multiplied, latencies and attainment are the cell's")
    return body
