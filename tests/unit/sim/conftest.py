import json

import numpy as np
import pytest

import pdserve.autoscaler.controller as controller
import pdserve.autoscaler.policy as policy
import pdserve.scheduler.routing as routing
import pdserve.scheduler.ledger as ledger

from pdserve.scheduler.perf_model import PerfModel
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.workload import Workload

# Round numbers so every expected time below can be computed by hand:
# prefill 1000 tok/s, step 10 ms + 1 ms per running sequence, lone-request TTFT overhead 50 ms
# (so a 40 ms response path), KV pull 1 MB/s at 1000 bytes per token (1 ms per token).
PERF = PerfModel(prefill_tokens_per_s=1000.0, decode_step_s=0.010, decode_step_per_seq_s=0.001,
                 prefill_overhead_s=0.050, kv_bytes_per_token=1000, transfer_bytes_per_s=1e6)


@pytest.fixture
def profile():
    return EngineProfile(PERF, block_size=16, num_kv_blocks=1000, max_num_seqs=64,
                         max_num_batched_tokens=512, startup_s=30.0, name="hand")


def hand_profile_json(tmp_path, step_fit: dict | None = None):
    """A profile JSON as `pdserve sim profile` writes it, with round numbers (and `step_fit`'s
    keys over a hand step fit, when given): its path."""
    data = {"prefill_tokens_per_s": 1000, "ttft_single_ms": {"100": 150},
            "tpot_ms_by_batch": {"1": 11, "2": 12}, "kv_bytes_per_token": 1000, "num_kv_blocks": 1000,
            "block_size": 16, "startup_s": 5}
    if step_fit is not None:
        data["step_fit"] = {"decode_step_s": 0.01, "decode_step_per_seq_s": 0.001,
                            "prefill_tokens_per_s": 1000, "steps": 900, "mixed_steps": 10,
                            "residual_p50_s": 0.001, **step_fit}
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(data))
    return prof


def sim_cli(tmp_path, **step_fit):
    """`pdserve sim run` on a hand profile JSON whose step fit has `step_fit`'s extra keys: (its
    1P1D command line, a function that runs it with more flags and gives the mean TPOT in ms)."""
    from pdserve.sim import cli

    prof = hand_profile_json(tmp_path, step_fit)
    base = ["run", "--profile", str(prof), "--prefill", "1", "--decode", "1", "--num-prompts", "30",
            "--request-rate", "2", "--random-input-len", "100", "--random-output-len", "8"]

    def tpot(*extra):
        out = tmp_path / "r.json"
        assert cli.main([*base, *extra, "--save-result", str(out)]) == 0
        return json.loads(out.read_text())["mean_tpot_ms"]

    return base, tpot


def workload(*rows):
    """rows of (arrival, prompt, output)."""
    a, p, o = zip(*rows)
    return Workload(np.array(a, float), np.array(p, np.int64), np.array(o, np.int64), "hand")


@pytest.fixture
def production_calls(monkeypatch):
    """Counts of calls to the production `place`, `place_colocated` and `decide`, reached the
    way the simulators reach them: through the ledger and the controller modules."""
    calls = {"place": 0, "place_colocated": 0, "decide": 0}

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ledger, "place", spy("place", routing.place))
    monkeypatch.setattr(ledger, "place_colocated", spy("place_colocated", routing.place_colocated))
    monkeypatch.setattr(controller, "decide", spy("decide", policy.decide))
    return calls
