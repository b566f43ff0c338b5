"""Two services for the OpenAI-API tests of this package, started side by side once and shared
by every module here (package scope: they stop after the package's last test):

- `colocated`: one CPU vLLM engine serving whole requests;
- `disaggregated`: one prefill and one decode engine, KV pulled over gRPC. A prompt of at most
  `LOCAL_PREFILL_MAX_TOKENS` tokens is prefilled on the decode engine (a local prefill, the same
  `FULL` leg a recompute runs); a longer one goes to the prefill engine and its decode leg pulls
  the KV. Prefix-aware routing is off, so a repeated prompt takes the same path each time. Each
  response's `x-pdserve-prefill-engine` header says which path it took.

Tests compare what the two return for the same request.
"""

from __future__ import annotations

import openai
import pytest

from pdserve.testing.server import spawn_process, wait_healthy, free_port

MODEL = "SmolLM2-135M-Instruct"
LOCAL_PREFILL_MAX_TOKENS = 8
TOOL_CALL_PARSER = "hermes"
START_TIMEOUT_S = 900


def _command(port: int, args: list[str]) -> list[str]:
    import sys

    return [sys.executable, "-m", "pdserve", "serve", "--port", str(port), "--model", "embedded",
            *args]


@pytest.fixture(scope="package")
def services(embedded_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("openai-api")
    # Three engines share 2 cores and 24 GiB: keep each KV cache small.
    small_kv = ["--kv-cache-memory-bytes", str(512 * 1024**2)]
    common = [*small_kv, "--set", f"api.tool_call_parser={TOOL_CALL_PARSER}"]
    colocated_port, disaggregated_port = free_port(), free_port()
    colocated = spawn_process(
        _command(colocated_port, ["--mode", "colocated", *common]), colocated_port,
        work / "colocated.log")
    disaggregated = spawn_process(
        _command(disaggregated_port, [
            "--mode", "disaggregated", "--prefill", "1", "--decode", "1", "--transport", "grpc",
            "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5",
            "--set", f"scheduler.local_prefill_max_tokens={LOCAL_PREFILL_MAX_TOKENS}",
            "--set", "scheduler.prefix_aware=false", *common]),
        disaggregated_port, work / "disaggregated.log")
    try:
        wait_healthy(colocated, START_TIMEOUT_S)
        wait_healthy(disaggregated, START_TIMEOUT_S)
        yield {"colocated": colocated, "disaggregated": disaggregated}
    finally:
        colocated.stop()
        disaggregated.stop()


@pytest.fixture(scope="package")
def colocated(services):
    return services["colocated"]


@pytest.fixture(scope="package")
def disaggregated(services):
    return services["disaggregated"]


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)
