"""Engine step traces as engines record them (pdserve.engine.step_trace): the writer's lines read
back, and the mock engine's trace."""

import asyncio

import pytest

from pdserve.config.schema import MockEngineConfig
from pdserve.engine.mock_engine import MockEngine
from pdserve.engine.step_trace import Step, StepTraceWriter
from pdserve.engine.types import GenerateRequest, SamplingOptions
from pdserve.sim.calibration.trace_reader import read_steps

pytestmark = pytest.mark.unit


def test_the_writer_appends_lines_that_read_back_by_replica_and_time(tmp_path):
    writer = StepTraceWriter(tmp_path / "steps", "decode-0")
    for i in range(3):
        writer.record(Step(t=float(i), prefill_tokens=i, prefill_reqs=1, decode_reqs=2, busy_s=0.01))
    # Lines are readable before the writer closes: a profile reads a live engine's trace.
    assert [s.t for s in read_steps(tmp_path / "steps")["decode-0"]] == [0.0, 1.0, 2.0]
    writer.close()
    assert [s.prefill_tokens for s in read_steps(writer.path, since=1.0)["decode-0"]] == [1, 2]
    assert read_steps(tmp_path / "steps", since=3.0) == {}
    with pytest.raises(FileNotFoundError):
        read_steps(tmp_path)


def test_the_mock_engine_traces_one_step_per_decoded_token(tmp_path):
    async def run() -> None:
        engine = MockEngine("colocated-0", "colocated", "m",
                            MockEngineConfig(decode_step_s=0.001, prefill_tokens_per_s=1e6),
                            step_trace_dir=tmp_path)
        await engine.start()

        async def one(i: int) -> None:
            request = GenerateRequest(request_id=f"r{i}", prompt_token_ids=(1, 2, 3 + i),
                                      sampling=SamplingOptions(max_tokens=6, ignore_eos=True))
            async for _ in engine.generate(request):
                pass

        await asyncio.gather(*(one(i) for i in range(4)))
        await engine.shutdown()

    asyncio.run(run())
    steps = read_steps(tmp_path)["colocated-0"]
    # The first token of each request comes from its prefill, the other 5 from decode steps.
    assert sum(s.decode_reqs for s in steps) == 4 * 5
    assert all(s.prefill_tokens == 0 and 1 <= s.decode_reqs <= 4 for s in steps)
