"""pdserve.sim.validation.cpu_service: the profile carries the engines' own max_num_batched_tokens."""

import pytest

from pdserve.sim.validation.cpu_service import engine_batched_tokens

pytestmark = pytest.mark.unit

LINE = ("(EngineActor pid=15789) INFO 11-27 08:20:02 [scheduler.py:307] Chunked prefill is enabled "
        "with max_num_batched_tokens={}.\n")


def test_the_engines_batched_token_budget_comes_from_their_start_up_lines():
    log = "service starting\n" + LINE.format(2048) + LINE.format(2048) + "ready\n"
    assert engine_batched_tokens(log) == 2048


@pytest.mark.parametrize("log", ["no such line\n", LINE.format(2048) + LINE.format(4096)])
def test_a_missing_or_ambiguous_budget_stops_the_profile(log):
    with pytest.raises(RuntimeError, match="max_num_batched_tokens"):
        engine_batched_tokens(log)
