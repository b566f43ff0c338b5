"""`pdserve bench chaos` against a real 1P1D `pdserve serve --engine mock` service on local Ray.

Checks the soak itself: references written, engines really SIGKILLed (pids from /metrics, gone
afterwards), a well-formed report whose counts add up, the plot, and the exit code agreeing with the
verdict. It does not check how the service heals (restarts, zero failures): that is the service's
own tests' business, and the soak is a measurement.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import psutil
import pytest

from pdserve.testing.server import start_mock_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_mock_server(
        ["--served-model-name", "tiny", "--mode", "disaggregated", "--prefill", "1", "--decode", "1",
         "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5",
         "--set", "engine.mock.decode_step_s=0.02"],
        tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


def engine_pids(server) -> dict[int, str]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {int(line.split('pid="')[1].split('"')[0]): line.split('pool="')[1].split('"')[0]
            for line in text.splitlines() if line.startswith("pdserve_engine_info{")}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_short_soak_kills_real_engines_and_reports_counts_that_add_up(server, tmp_path):
    chaos = [sys.executable, "-m", "pdserve", "bench", "chaos", "--url", server.base_url,
             "--prompts", "6", "--max-prompt-words", "60", "--max-tokens", "8"]
    reference = tmp_path / "reference.json"
    subprocess.run([*chaos, "--write-reference", str(reference)], check=True, timeout=60)
    texts = json.loads(reference.read_text())
    assert len(texts) == 6 and all(texts.values())

    before = engine_pids(server)
    assert sorted(before.values()) == ["decode", "prefill"]
    soak = subprocess.run(
        [*chaos, "--out", str(tmp_path), "--rate", "2", "--duration-s", "20", "--warmup-s", "4",
         "--kill-interval-s", "8", "--max-kills", "2", "--request-timeout-s", "20",
         "--settle-timeout-s", "8"],
        capture_output=True, text=True, timeout=150)
    assert soak.returncode in (0, 3), soak.stdout + soak.stderr
    report = json.loads((tmp_path / "chaos.json").read_text())

    assert report["sent"] > 10
    assert report["sent"] == report["completed"] + report["failed"] + report["hung"]
    assert report["failed"] == report["lost"] + report["unrecoverable"]
    assert sum(report["failures_by_error"].values()) == report["failed"]
    for key in ("sent", "completed", "failed", "hung"):
        assert sum(bucket[key] for bucket in report["timeline"]) == report[key], key
    assert report["config"]["reference_source"].startswith("the target service itself")
    assert report["config"]["health_at_start"]["http_status"] == 200

    kills = report["kills"]
    assert 1 <= len(kills) <= 2
    assert kills[0]["pid"] in before and kills[0]["pool"] == before[kills[0]["pid"]]
    assert kills[0]["t"] == pytest.approx(4.0, abs=1.0)
    assert all(gone(kill["pid"]) for kill in kills), kills
    assert len(report["heal"]["per_kill_s"]) == len(kills)

    assert (soak.returncode == 3) == bool(report["verdict"])
    assert "verdict:" in soak.stdout
    assert (tmp_path / "chaos.png").stat().st_size > 10_000
