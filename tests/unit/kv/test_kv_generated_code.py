"""The committed protobuf/gRPC code matches the .proto files (regenerate if this fails)."""

from __future__ import annotations

import pytest

from pdserve.kv.proto import generate

pytestmark = pytest.mark.unit


def test_generated_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev dependency) regenerates the code")
    generate.generate(tmp_path)
    for proto_file in generate.PROTO_FILES:
        for name in generate.generated_names(proto_file):
            committed = (generate.PACKAGE_DIR / name).read_text()
            assert (tmp_path / name).read_text() == committed, (
                f"pdserve/kv/proto/{name} is stale or hand-edited: run `python -m pdserve.kv.proto.generate` "
                "(with the grpcio-tools version pinned in the dev dependencies) and commit the result"
            )


def test_generated_grpc_module_imports_within_the_package():
    text = (generate.PACKAGE_DIR / "kv_transfer_pb2_grpc.py").read_text()
    assert "from . import kv_transfer_pb2" in text
    assert "from pdserve.kv.v1" not in text
