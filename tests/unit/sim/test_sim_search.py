import pytest

from pdserve.autoscaler.policy import PoolBounds
from pdserve.slo import SloTargets
from pdserve.sim import cli
from pdserve.sim.baselines import TtftOnlyAutoscaler
from pdserve.sim.runner import SimConfig, Topology, simulate
from pdserve.sim.search import candidates, search_static
from pdserve.sim.workload import at_rate
from conftest import hand_profile_json

pytestmark = pytest.mark.unit


def test_candidates_cover_colocated_and_every_split():
    names = [t.name for t in candidates(3)]
    assert names == ["colocated x3", "1P2D", "2P1D"]


def test_search_finds_the_smallest_deployment_meeting_the_goal(profile):
    # ~1000 prompt tokens/s of work on engines that prefill 1000 tokens/s: one engine drowns.
    wl = at_rate("random", 400, 4.0, input_len=250, output_len=10, seed=0)
    base = SimConfig(profile, Topology.colocated(1), SloTargets.from_s(0.5, 0.05))
    goodput = SloTargets(ttft_ms=500, tpot_ms=50)
    best, trials = search_static(base, wl, goodput, 0.9, 6, disaggregated=False)
    assert best is not None
    n = best.topology.pools["colocated"]
    assert best.attainment >= 0.9
    assert all(t.attainment < 0.9 for t in trials if t.topology.pools["colocated"] < n)
    assert n >= 2  # one engine at ~100% prefill load cannot hold a 500 ms TTFT


def test_ttft_only_baseline_scales_on_ttft_alone(profile):
    wl = at_rate("random", 600, 6.0, input_len=250, output_len=10, seed=1)
    config = SimConfig(profile, Topology.colocated(1, PoolBounds(1, 4)), SloTargets.from_s(0.3, 0.05),
                       autoscaler="ttft_only", autoscale_interval_s=2.0)
    run = simulate(config, wl)
    assert run.decisions and {d.reason for _, d in run.decisions} <= {"ttft_breach", "idle"}
    ups = [d for _, d in run.decisions if d.delta > 0]
    assert ups and all(d.delta == 1 for d in ups)  # one engine at a time
    assert isinstance(TtftOnlyAutoscaler({"colocated": PoolBounds(1, 2)}, 0.3).bounds, dict)


def test_cli_run_writes_a_harness_keyed_result(tmp_path, capsys):
    import json

    prof = hand_profile_json(tmp_path)
    out = tmp_path / "r.json"
    code = cli.main(["run", "--profile", str(prof), "--prefill", "1", "--decode", "1",
                     "--num-prompts", "30", "--request-rate", "2", "--random-input-len", "100",
                     "--random-output-len", "8", "--ttft-ms", "1000", "--tpot-ms", "100",
                     "--save-result", str(out)])
    assert code == 0
    body = json.loads(out.read_text())
    assert body["completed"] == 30 and body["simulation"]["topology"] == "1P1D"
    assert body["command"].startswith("pdserve sim run --profile ")
    assert body["command"].endswith(f"--save-result {out}")
    assert "median_ttft_ms" in body and body["slo_attainment"]["all"] > 0


def test_cli_search_writes_the_winner_every_trial_and_its_command(tmp_path, capsys):
    import json

    prof = hand_profile_json(tmp_path)
    out = tmp_path / "s.json"
    argv = ["search", "--profile", str(prof), "--num-prompts", "200", "--request-rate", "4",
            "--random-input-len", "250", "--random-output-len", "10", "--ttft-ms", "500",
            "--tpot-ms", "50", "--attainment", "0.9", "--max-engines", "3", "--no-disaggregated",
            "--save-result", str(out)]
    assert cli.main(argv) == 0
    body = json.loads(out.read_text())
    assert body["command"] == "pdserve sim " + " ".join(argv)
    assert body["goal"] == 0.9
    names = [t["topology"] for t in body["trials"]]
    assert body["best_static"]["topology"] in names and names[0] == "colocated x1"
    assert body["best_static"]["attainment"] >= 0.9
    assert "cheapest static: " + body["best_static"]["topology"] in capsys.readouterr().out
