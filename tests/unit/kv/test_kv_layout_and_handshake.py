"""Compatibility hash, field-naming refusals and handshake proofs (no network)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kv.transport.base import KVTransfer, TransferState
from pdserve.kv.transport.errors import AuthenticationError, IncompatiblePeerError, WireVersionError
from pdserve.kv.transport.handshake import (
    WIRE_VERSION, Transcript, check_compatible, make_hello, new_nonce, verify_hello,
)
from pdserve.kv.transport.regions import BlockRegion, KVLayoutSpec, check_regions

pytestmark = pytest.mark.unit

LLAMA = KVLayoutSpec("meta-llama/Llama-3.1-8B", "bfloat16", 16, "flash_attn:[2,nb,bs,h,d]", 2, 1, 32)
TRANSCRIPT = Transcript("decode-1", "prefill-1", new_nonce(), new_nonce())


def test_compat_hash_is_stable_across_releases():
    # Changing this digest means old and new engines refuse each other: bump WIRE_VERSION too.
    assert LLAMA.compat_hash() == "6577c2fe3effd7989521be454f9486a75578be488cb205c627d4ed0980a6c5ad"


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(KVLayoutSpec) if not f.name.startswith("tp_")]
)
def test_every_field_but_tp_changes_the_hash_and_is_named_when_it_differs(field):
    value = getattr(LLAMA, field)
    changed = dataclasses.replace(LLAMA, **{field: value + 1 if isinstance(value, int) else value + "x"})

    assert changed.compat_hash() != LLAMA.compat_hash()
    with pytest.raises(IncompatiblePeerError, match=field) as refused:
        check_compatible(LLAMA, changed)
    assert refused.value.field == field


@pytest.mark.parametrize("field", ["tp_size", "tp_rank"])
def test_tp_is_left_out_of_the_hash_but_named_when_no_heads_axis_allows_it_to_differ(field):
    changed = dataclasses.replace(LLAMA, **{field: getattr(LLAMA, field) + 1})

    assert changed.compat_hash() == LLAMA.compat_hash()
    with pytest.raises(IncompatiblePeerError, match="equal tensor_parallel_size") as refused:
        check_compatible(LLAMA, changed)
    assert refused.value.field == field


def test_region_mismatch_names_the_region_and_field():
    mine = [BlockRegion(torch.zeros(4, 2, 8)).info(), BlockRegion(torch.zeros(4, 2, 8)).info()]
    theirs = [mine[0], BlockRegion(torch.zeros(4, 2, 8, dtype=torch.float16)).info()]
    with pytest.raises(IncompatiblePeerError) as refused:
        check_regions(mine, theirs)
    assert refused.value.field == "regions[1].dtype"


def test_block_shape_excludes_the_block_dim():
    info = BlockRegion(torch.zeros(2, 10, 16, 4, 8, dtype=torch.float16), block_dim=1).info()
    assert info.block_shape == (2, 16, 4, 8)
    assert info.block_nbytes == 2 * 16 * 4 * 8 * 2


def test_hello_checks_version_then_token_then_layout():
    hello = make_hello(LLAMA, "secret", "client", WIRE_VERSION, TRANSCRIPT)
    verify_hello(LLAMA, "secret", "client", hello, WIRE_VERSION, TRANSCRIPT)
    with pytest.raises(WireVersionError):
        verify_hello(LLAMA, "secret", "client", hello, WIRE_VERSION + 1, TRANSCRIPT)
    with pytest.raises(AuthenticationError):
        verify_hello(LLAMA, "other", "client", hello, WIRE_VERSION, TRANSCRIPT)
    with pytest.raises(IncompatiblePeerError, match="tp_rank"):
        other_rank = dataclasses.replace(LLAMA, tp_rank=0)
        verify_hello(other_rank, "secret", "client", hello, WIRE_VERSION, TRANSCRIPT)


def test_a_proof_is_not_valid_for_the_other_role():
    server_hello = make_hello(LLAMA, "secret", "server", WIRE_VERSION, TRANSCRIPT)
    with pytest.raises(AuthenticationError):
        verify_hello(LLAMA, "secret", "client", server_hello, WIRE_VERSION, TRANSCRIPT)


@pytest.mark.parametrize("field", ["client_engine_id", "server_engine_id", "server_nonce", "client_nonce"])
def test_a_proof_is_valid_for_its_own_handshake_only(field):
    hello = make_hello(LLAMA, "secret", "client", WIRE_VERSION, TRANSCRIPT)
    value = getattr(TRANSCRIPT, field)
    changed = new_nonce() if isinstance(value, bytes) else value + "x"
    other = dataclasses.replace(TRANSCRIPT, **{field: changed})

    assert make_hello(LLAMA, "secret", "client", WIRE_VERSION, other).token_proof != hello.token_proof
    with pytest.raises(AuthenticationError):
        verify_hello(LLAMA, "secret", "client", hello, WIRE_VERSION, other)


def test_transfer_handle_ends_once():
    transfer = KVTransfer("req", "addr", 3)
    assert transfer.state is TransferState.PENDING and not transfer.done
    transfer.set_transferring()
    transfer.add_bytes(10)
    transfer.finish("boom")
    transfer.finish()
    assert transfer.state is TransferState.FAILED and transfer.error == "boom" and transfer.bytes_moved == 10
    assert transfer.wait(0) is TransferState.FAILED
