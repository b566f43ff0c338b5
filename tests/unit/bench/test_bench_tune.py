"""The pool-aware tuner's search: candidates, ranking, pruning and resume, driven by a fake evaluator
(no service is started), and `bench tune` on the command line against the fake OpenAI server."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from pdserve.bench import cli
from pdserve.bench.tune import (
    Candidate,
    Deployment,
    DeploymentMode,
    EngineKnobs,
    Probe,
    Trial,
    TrialStatus,
    TuneRecord,
    TuneSettings,
    best_per_deployment,
    deployments_for_budget,
    format_ranking,
    plan_candidates,
    rank_trials,
    resumable_trials,
    run_tuning,
    series_dropped,
    trial_from_dict,
    trial_to_dict,
)

pytestmark = pytest.mark.unit


class FakeEvaluator:
    """Answers each candidate with a scripted goodput (req/s) or a start failure; records the calls."""

    def __init__(self, goodput: Mapping[str, float | None]) -> None:
        self.goodput = goodput
        self.settings = TuneSettings()
        self.calls: list[str] = []

    async def __call__(self, candidate: Candidate) -> Trial:
        self.calls.append(candidate.key)
        rate = self.goodput[candidate.key]
        gpus = self.settings.num_gpus(candidate)
        if rate is None:
            return Trial(candidate, TrialStatus.FAILED, gpus, error="did not start")
        return Trial(candidate, TrialStatus.OK, gpus, rate, probes=(Probe(rate, 0.95), Probe(rate * 2, 0.5)))


def test_budget_gives_colocated_and_every_split() -> None:
    assert [d.name for d in deployments_for_budget(4)] == [
        "colocated:4", "3P1D", "2P2D", "1P3D", "3P1D-adaptive", "2P2D-adaptive", "1P3D-adaptive"]
    assert [d.name for d in deployments_for_budget(1)] == ["colocated:1"]
    assert all(d.num_engines == 4 for d in deployments_for_budget(4))
    with pytest.raises(ValueError):
        deployments_for_budget(0)


@pytest.mark.parametrize(
    ("spec", "name"),
    [("3P1D", "3P1D"), ("1p2d", "1P2D"), ("colocated:2", "colocated:2"), ("colocated", "colocated:4")],
)
def test_deployment_specs_parse(spec: str, name: str) -> None:
    assert Deployment.parse(spec, default_engines=4).name == name


@pytest.mark.parametrize("spec", ["0P1D", "2P0D", "colocated:0", "colocated:x", "2x2", "P1D"])
def test_bad_deployment_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        Deployment.parse(spec, default_engines=4)
    with pytest.raises(ValueError, match="needs :N"):
        Deployment.parse("colocated")


def test_candidates_become_the_serve_flags_of_their_service() -> None:
    assert Deployment.parse("colocated:3").serve_args() == ["--mode", "colocated", "--replicas", "3"]
    assert Deployment.parse("2P1D").serve_args() == [
        "--mode", "disaggregated", "--prefill", "2", "--decode", "1"
    ]
    assert EngineKnobs(64, 2048).serve_args() == [
        "--max-num-seqs", "64", "--set", "engine.max_num_batched_tokens=2048"
    ]
    assert EngineKnobs().serve_args() == []  # engine defaults: pass nothing


def test_plan_orders_each_series_by_ascending_max_num_seqs_with_the_default_last() -> None:
    plan = plan_candidates([Deployment.parse("1P1D")], [None, 64, 16, 64], [2048, None])
    assert [c.key for c in plan] == [
        "1P1D/seqs=16,tokens=2048",
        "1P1D/seqs=64,tokens=2048",
        "1P1D/seqs=default,tokens=2048",
        "1P1D/seqs=16,tokens=default",
        "1P1D/seqs=64,tokens=default",
        "1P1D/seqs=default,tokens=default",
    ]
    assert len({c.series for c in plan}) == 2
    assert plan[0].slug == "1P1D-seqs-16-tokens-2048"


def _plan() -> list[Candidate]:
    return plan_candidates([Deployment.parse("colocated:2"), Deployment.parse("1P1D")], [8, 16, 32, 64])


async def test_a_series_is_pruned_after_goodput_drops_and_other_series_go_on() -> None:
    goodput = {
        "colocated:2/seqs=8,tokens=default": 4.0,
        "colocated:2/seqs=16,tokens=default": 6.0,
        "colocated:2/seqs=32,tokens=default": 5.0,  # below 0.9 x 6.0: the series has dropped
        "colocated:2/seqs=64,tokens=default": 9.0,  # never measured
        "1P1D/seqs=8,tokens=default": 3.0,
        "1P1D/seqs=16,tokens=default": 2.8,  # within 10% of 3.0: keep going
        "1P1D/seqs=32,tokens=default": 3.5,
        "1P1D/seqs=64,tokens=default": 3.6,
    }
    evaluate = FakeEvaluator(goodput)
    trials = await run_tuning(_plan(), evaluate, TuneSettings(prune_drop=0.1))
    assert "colocated:2/seqs=64,tokens=default" not in evaluate.calls
    assert len(evaluate.calls) == 7
    assert [t.status for t in trials].count(TrialStatus.PRUNED) == 1
    assert [t.candidate.key for t in trials] == [c.key for c in _plan()]  # one trial per candidate

    everything = FakeEvaluator(goodput)
    await run_tuning(_plan(), everything, TuneSettings(prune_drop=None))
    assert len(everything.calls) == 8


def test_a_failed_start_after_a_success_drops_the_series_but_a_first_failure_does_not() -> None:
    c = _plan()[0]
    ok = Trial(c, TrialStatus.OK, 2, 5.0)
    failed = Trial(c, TrialStatus.FAILED, 2, error="OOM")
    assert series_dropped([ok, failed], 0.1)
    assert not series_dropped([failed, ok], 0.1)
    assert not series_dropped([ok, failed], None)
    # A series that never met the SLO has no best to fall from.
    assert not series_dropped([Trial(c, TrialStatus.OK, 2, 0.0)] * 3, 0.1)


def test_ranking_is_by_goodput_per_gpu_then_failed_then_pruned() -> None:
    small = Candidate(Deployment.parse("colocated:2"), EngineKnobs())
    big = Candidate(Deployment.parse("1P3D"), EngineKnobs())
    trials = [
        Trial(big, TrialStatus.PRUNED, 4),
        Trial(big, TrialStatus.OK, 4, 16.0),  # more req/s, but 4.0 per GPU
        Trial(small, TrialStatus.FAILED, 2, error="x"),
        Trial(small, TrialStatus.OK, 2, 10.0),  # 5.0 per GPU: the better use of GPUs
    ]
    ranked = rank_trials(trials)
    assert [(t.candidate.deployment.name, t.status) for t in ranked] == [
        ("colocated:2", TrialStatus.OK),
        ("1P3D", TrialStatus.OK),
        ("colocated:2", TrialStatus.FAILED),
        ("1P3D", TrialStatus.PRUNED),
    ]
    table = format_ranking(trials)
    first_row = table.splitlines()[2].split()
    assert first_row[:2] == ["1", "colocated:2"] and "5.000" in first_row
    assert [t.candidate.deployment.name for t in best_per_deployment(trials)] == ["1P3D", "colocated:2"]


async def test_resume_reuses_recorded_trials_and_measures_only_the_rest() -> None:
    goodput = {c.key: 2.0 + i for i, c in enumerate(_plan())}
    first = FakeEvaluator(goodput)
    settings = {"num_prompts": 100, "goodput": {"ttft": 500.0}}
    partial = [trial_to_dict(t) for t in await run_tuning(_plan()[:3], first, TuneSettings())]
    saved = json.loads(json.dumps(TuneRecord(settings, [trial_from_dict(d) for d in partial]).to_dict()))

    second = FakeEvaluator(goodput)
    seen: list[str] = []
    previous = resumable_trials(saved, settings)
    trials = await run_tuning(
        _plan(), second, TuneSettings(), previous, lambda t: seen.append(t.candidate.key)
    )
    assert second.calls == [c.key for c in _plan()[3:]]
    assert seen == [c.key for c in _plan()]  # reused trials are reported too (the record stays whole)
    assert [t.max_goodput_rate for t in trials] == [goodput[c.key] for c in _plan()]


def test_resume_refuses_a_record_made_with_other_settings() -> None:
    saved = TuneRecord({"num_prompts": 100, "goodput": {"ttft": 500.0}}).to_dict()
    with pytest.raises(ValueError, match="num_prompts: saved 100, now 200"):
        resumable_trials(saved, {"num_prompts": 200, "goodput": {"ttft": 500.0}})
    with pytest.raises(ValueError, match="format version"):
        resumable_trials({**saved, "format_version": 99}, saved["settings"])


def test_trials_round_trip_through_json() -> None:
    probes = (
        Probe(2.0, 1.0, (("ttft", 1.0), ("tpot", 1.0))),
        Probe(4.0, 0.5, (("ttft", 0.5), ("tpot", 0.9))),
    )
    trial = Trial(_plan()[1], TrialStatus.OK, 2, 3.5, probes, start_s=12.0, wall_s=60.0, load_1m=3.5)
    data = json.loads(json.dumps(trial_to_dict(trial)))
    assert trial_from_dict(data) == trial
    assert data["goodput_per_gpu"] == 1.75


# --- the command line, with the service launcher replaced by one that "starts" the fake server -----------


class FakeService:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def fake_launcher(fake_server, monkeypatch):
    launched: list[tuple[list[str], FakeService]] = []

    class Launcher:
        @staticmethod
        async def start(serve_args, log_path, timeout_s):
            if "--fail-to-start" in serve_args and "colocated" in serve_args:
                raise cli.ServiceStartError("pdserve serve exited with 1:\nRuntimeError: no engines")
            service = FakeService(fake_server.base_url)
            launched.append((list(serve_args), service))
            return service

    monkeypatch.setattr(cli, "ServeProcess", Launcher)
    return launched


def _tune_argv(tmp_path: Path, tokenizer_dir: Path, *extra: str) -> list[str]:
    return [
        "tune", "--num-engines", "2", "--num-seqs-list", "4", "--serve-args", "--engine mock",
        "--num-cpus-per-engine", "0.5", "--tokenizer", str(tokenizer_dir), "--num-prompts", "4",
        "--random-input-len", "8", "--random-output-len", "3", "--goodput", "ttft:2000", "tpot:1000",
        "--search-start-rate", "50", "--search-max-rate", "50", "--result-dir", str(tmp_path),
        "--disable-tqdm", *extra,
    ]


def test_tune_cli_ranks_candidates_and_writes_json_csv_and_plot(
    fake_launcher, word_tokenizer_dir, tmp_path, capsys
) -> None:
    assert cli.main(_tune_argv(tmp_path, word_tokenizer_dir)) == 0
    # colocated:2, 1P1D and 1P1D-adaptive with max_num_seqs 4: three services, each stopped; the
    # adaptive one routes against the goodput targets.
    assert len(fake_launcher) == 3 and all(service.stopped for _, service in fake_launcher)
    assert fake_launcher[2][0][:9] == ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                                       "--adaptive", "--max-num-seqs", "4"]
    assert fake_launcher[2][0][-4:] == ["--ttft-ms", "2000", "--tpot-ms", "1000"]
    first_args = fake_launcher[0][0]
    assert first_args[:6] == ["--mode", "colocated", "--replicas", "2", "--max-num-seqs", "4"]
    assert "--engine" in first_args and "pools.decode.num_cpus=0.5" in first_args
    record = json.loads((tmp_path / "tune.json").read_text())
    assert [t["status"] for t in record["trials"]] == ["ok"] * 3
    # The fake server meets the SLO at every rate: the search stops at --search-max-rate.
    assert all(t["max_goodput_rate"] == 50.0 and t["goodput_per_gpu"] == 25.0 for t in record["trials"])
    assert record["best"] == "colocated:2/seqs=4,tokens=default"  # a tie keeps plan order
    assert len((tmp_path / "tune.csv").read_text().splitlines()) == 4
    probe = record["trials"][0]["probes"][0]
    assert probe == {"request_rate": 50.0, "slo_attainment": 1.0, "by_target": {"ttft": 1.0, "tpot": 1.0}}
    assert (tmp_path / "tune.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "Best of each deployment" in out and "1.00x" in out

    # Resuming the finished run measures nothing again; a narrower plan keeps the other trials on record.
    assert cli.main([*_tune_argv(tmp_path, word_tokenizer_dir), "--resume"]) == 0
    assert cli.main([*_tune_argv(tmp_path, word_tokenizer_dir), "--resume", "--deployments", "1P1D"]) == 0
    assert len(fake_launcher) == 3
    kept = json.loads((tmp_path / "tune.json").read_text())["trials"]
    assert sorted(t["key"] for t in kept) == [
        "1P1D-adaptive/seqs=4,tokens=default", "1P1D/seqs=4,tokens=default",
        "colocated:2/seqs=4,tokens=default"
    ]


def test_tune_cli_records_a_service_that_fails_to_start(
    fake_launcher, word_tokenizer_dir, tmp_path, capsys
) -> None:
    argv = _tune_argv(tmp_path, word_tokenizer_dir, "--serve-args=--fail-to-start", "--start-retries", "0")
    assert cli.main(argv) == 0
    record = json.loads((tmp_path / "tune.json").read_text())
    statuses = {t["key"]: (t["status"], t["error"]) for t in record["trials"]}
    assert statuses["colocated:2/seqs=4,tokens=default"] == (
        "failed", "pdserve serve exited with 1: ... RuntimeError: no engines"
    )
    assert statuses["1P1D/seqs=4,tokens=default"][0] == "ok"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-engines", "2"], "tune ranks by goodput"),
        (["--goodput", "ttft:1"], "needs --num-engines N or --deployments"),
        (["--goodput", "ttft:1", "--deployments", "colocated"], "needs :N"),
        (["--goodput", "ttft:1", "--deployments", "4x4"], "--deployments: invalid deployment"),
        (["--goodput", "ttft:1", "--num-engines", "2", "--serve-args", "--mode colocated"],
         "must not set --mode"),
        (["--goodput", "ttft:1", "--num-engines", "2", "--serve-args", "--set engine.max_num_seqs=4"],
         "use --num-seqs-list"),
        (["--goodput", "ttft:1", "--num-engines", "2", "--num-seqs-list", "0"],
         "--num-seqs-list: must be >= 1"),
        (["--goodput", "ttft:1", "--num-engines", "2", "--serve-args", "'unclosed"], "cannot split"),
    ],
)
def test_bad_tune_flags_are_argparse_errors(extra: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_saved_runs_plot_as_attainment_panels_and_a_ranking(tmp_path) -> None:
    from PIL import Image

    from pdserve.bench.plots import plot_goodput_ranking, plot_slo_attainment_panels

    runs = {
        "colocated": [
            (0.5, {"ttft": 1.0, "tpot": 1.0, "all": 1.0}),
            (1.0, {"ttft": 0.9, "tpot": 0.5, "all": 0.5}),
        ],
        "ttft-only": [(0.5, {"ttft": 1.0, "all": 1.0})],  # a run without a TPOT target: no TPOT point
    }
    panels = plot_slo_attainment_panels(runs, tmp_path / "attainment.png")
    ranking = plot_goodput_ranking([("3P1D/a", "3P1D", 2.5), ("colocated:4/a", "colocated:4", 1.9)],
                                   tmp_path / "tune.png")
    assert Image.open(panels).size[0] > 2 * Image.open(panels).size[1]  # three panels side by side
    assert Image.open(ranking).size[1] > 0


def test_adaptive_deployments_are_searched_and_served_against_the_slo() -> None:
    from pdserve.bench.cli_args import slo_serve_args

    names = [d.name for d in deployments_for_budget(2)]
    assert names == ["colocated:2", "1P1D", "1P1D-adaptive"]
    adaptive = Deployment.parse("1p1d-adaptive")
    assert adaptive.adaptive and adaptive.serve_args() == [
        "--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--adaptive"]
    with pytest.raises(ValueError, match="adaptive"):
        Deployment(DeploymentMode.COLOCATED, replicas=2, adaptive=True)
    # The service routes against the goodput targets, unless its own flags set them.
    args = argparse.Namespace(goodput=["ttft:500", "tpot:20"])
    assert slo_serve_args(args, []) == ["--ttft-ms", "500", "--tpot-ms", "20"]
    assert slo_serve_args(args, ["--tpot-ms", "15"]) == ["--ttft-ms", "500"]
