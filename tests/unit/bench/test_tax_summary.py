"""benchmarks/gpu/tax_summary.py: the serving tax's cells come from the grid's own summary, with
each TPOT target's attainment computed from the records' requests (they stored 8, 10 and 20 ms)."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).parents[3] / "benchmarks" / "gpu" / "tax_summary.py"
_spec = importlib.util.spec_from_file_location("tax_summary", _PATH)
tax = importlib.util.module_from_spec(_spec)
sys.modules["tax_summary"] = tax
_spec.loader.exec_module(tax)


def _row(rate: float, tpots: list[float]) -> dict:
    n = len(tpots)
    return {"rate": rate, "attainment": {"8": 0.0, "10": 0.0, "20": 0.0},  # stale: recomputed
            "requests": {"ok": [True] * n, "ttft_ms": [100.0] * n, "tpot_ms": tpots}}


def test_every_target_is_read_from_the_requests_and_the_cells_are_the_grids():
    # 12 ms TPOT everywhere at 2 req/s; at 4 req/s half the requests take 18 ms.
    record = {"arm": "colocated-1", "num_gpus": 1, "ttft_ms": 500.0, "tpot_targets_ms": [8.0, 10.0, 20.0],
              "start_s": 1.0, "commands": ["x"], "rates": [_row(2, [12.0] * 10), _row(4, [12.0] * 5 + [18.0] * 5)]}
    full = tax.every_target(record)
    assert full["tpot_targets_ms"] == [8.0, 10.0, 15.0, 20.0]
    assert [row["attainment"] for row in full["rates"]] == [
        {"8": 0.0, "10": 0.0, "15": 1.0, "20": 1.0}, {"8": 0.0, "10": 0.0, "15": 0.5, "20": 1.0}]
    cells = {c["tpot_ms"]: c["goodput_per_gpu"] for c in tax.cells({"colocated-1": [record]})}
    assert cells[15.0]["colocated-1"]["value"] == 2 and not cells[15.0]["colocated-1"]["lower_bound"]
    assert cells[20.0]["colocated-1"]["value"] == 4 and cells[20.0]["colocated-1"]["lower_bound"]
    assert cells[8.0]["colocated-1"]["value"] == 0.0
    assert cells[20.0]["pdserve_best"]["arm"] == "colocated-1"
