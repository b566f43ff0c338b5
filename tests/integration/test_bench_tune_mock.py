"""`pdserve bench tune` for real: it starts `pdserve serve --engine mock` on local Ray for each candidate
(colocated:2 and 1P1D), searches each one's goodput, stops it, and leaves no process behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import psutil
import pytest

from pdserve.bench import cli
from pdserve.bench.service import ServeProcess
from pdserve.testing import save_tiny_model

pytestmark = pytest.mark.integration


@pytest.fixture
def tiny_model_dir(tmp_path):
    return save_tiny_model(tmp_path / "tiny-model")


def test_tune_starts_searches_and_stops_each_candidate(tiny_model_dir, tmp_path, monkeypatch, capsys):
    started: list[ServeProcess] = []

    class RecordingServeProcess(ServeProcess):
        """The real launcher; it only keeps each service so the test can check what is left after."""

        @classmethod
        async def start(cls, serve_args, log_path, timeout_s=900.0):
            service = await super().start(serve_args, log_path, timeout_s)
            started.append(service)
            return service

    monkeypatch.setattr(cli, "ServeProcess", RecordingServeProcess)
    out = tmp_path / "tune"
    argv = [
        "tune", "--num-engines", "2", "--num-seqs-list", "8",
        "--serve-args", f"--engine mock --model {tiny_model_dir} --served-model-name tiny",
        "--num-cpus-per-engine", "0.25", "--tokenizer", str(tiny_model_dir),
        "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "6",
        # Lax targets and a two-rate search: the test checks the plumbing, not a speed.
        "--goodput", "ttft:30000", "tpot:30000", "--search-start-rate", "1", "--search-max-rate", "2",
        "--start-timeout", "300", "--result-dir", str(out), "--disable-tqdm",
    ]
    assert cli.main(argv) == 0

    record = json.loads((out / "tune.json").read_text())
    trials = {t["key"]: t for t in record["trials"]}
    assert list(trials) == ["colocated:2/seqs=8,tokens=default", "1P1D/seqs=8,tokens=default",
                            "1P1D-adaptive/seqs=8,tokens=default"]
    for trial in trials.values():
        assert trial["status"] == "ok", trial["error"]
        assert [p["request_rate"] for p in trial["probes"]] == [1.0, 2.0]
        assert trial["max_goodput_rate"] == 2.0 and trial["goodput_per_gpu"] == 1.0
        assert trial["start_s"] > 0
    assert (out / "tune.csv").exists() and (out / "tune.png").exists()
    # Each service got the deployment and knobs, and logged its start.
    logs = sorted((out / "logs").iterdir())
    assert [log.name for log in logs] == [
        "1P1D-adaptive-seqs-8-tokens-default.log", "1P1D-seqs-8-tokens-default.log",
        "colocated-2-seqs-8-tokens-default.log"
    ]
    # The adaptive deployment routes against the goodput targets.
    assert ("--prefill 1 --decode 1 --adaptive --max-num-seqs 8 --engine mock" in logs[0].read_text()
            and "--ttft-ms 30000 --tpot-ms 30000" in logs[0].read_text())
    assert "--prefill 1 --decode 1 --max-num-seqs 8 --engine mock" in logs[1].read_text()
    # Nothing of either service survives: not the server, not Ray, not the engine actors (which Ray
    # puts in process groups of their own).
    assert len(started) == 3
    for service in started:
        assert service.process.poll() is not None
        assert len(service.descendants) >= 3  # Ray's GCS and raylet plus engine actors, at least
        assert service.alive_descendants() == []
    assert "Best of each deployment" in capsys.readouterr().out


def test_a_terminated_tuner_stops_the_running_service(tiny_model_dir, tmp_path):
    """SIGTERM to the tuner mid-search: it stops the candidate's service (which runs in a session of its
    own, out of reach of signals to the tuner's group) and exits 130."""
    out = tmp_path / "tune"
    command = [
        sys.executable, "-m", "pdserve", "bench", "tune", "--deployments", "1P1D",
        "--serve-args", f"--engine mock --model {tiny_model_dir} --served-model-name tiny",
        "--num-cpus-per-engine", "0.25", "--tokenizer", str(tiny_model_dir),
        "--random-input-len", "32", "--random-output-len", "4", "--num-prompts", "100000",
        "--goodput", "ttft:30000", "--search-start-rate", "1", "--result-dir", str(out), "--disable-tqdm",
    ]
    tuner = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in tuner.stdout:
            if "healthy after" in line:
                break
        service_tree = psutil.Process(tuner.pid).children(recursive=True)
        assert any("serve" in p.cmdline() for p in service_tree)
        tuner.send_signal(signal.SIGTERM)
        rest = tuner.communicate(timeout=180)[0]
    finally:
        if tuner.poll() is None:
            tuner.kill()
    assert tuner.returncode == 130, rest
    assert "Interrupted" in rest
    _, alive = psutil.wait_procs(service_tree, timeout=10)
    assert alive == []
