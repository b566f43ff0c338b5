"""TLS on the KV gRPC channel, with a CA and certificates made in the test."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kv_helpers import LAYOUT, TOKEN, WAIT_S, assert_blocks_equal, kv_regions

from pdserve.kv.transport.base import TransferState
from pdserve.kv.transport.grpc import GrpcSink, GrpcSource
from pdserve.kv.transport.tls import TlsFiles

pytestmark = pytest.mark.unit


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, TlsFiles]:
    """A CA, and per engine a certificate it signed; plus one signed by a stranger CA."""
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("pdserve test CA", ca_key, "pdserve test CA", ca_key, ca=True)
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    (root / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files = {}
    for name, issuer_key in (("prefill", ca_key), ("decode", ca_key), ("stranger", stranger_key)):
        key = ec.generate_private_key(ec.SECP256R1())
        issuer = "pdserve test CA" if issuer_key is ca_key else "stranger CA"
        cert = _certificate(name, key, issuer, issuer_key, ca=False)
        (root / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}.key").write_bytes(_pem_key(key))
        files[name] = TlsFiles(str(root / f"{name}.pem"), str(root / f"{name}.key"), str(root / "ca.pem"))
    return files


def _with(files: TlsFiles, **changes) -> TlsFiles:
    fields = {f: getattr(files, f) for f in ("certfile", "keyfile", "ca_file", "client_auth", "server_name")}
    return TlsFiles(**{**fields, **changes})


def _pull(source: GrpcSource, tls: TlsFiles | None, request_id: str):
    regions = kv_regions(8, seed=2, sink_side=True)
    sink = GrpcSink(LAYOUT, regions, engine_id="decode-0", cluster_token=TOKEN, tls=tls)
    try:
        source.pin(request_id, [1, 2])
        transfer = sink.start_pull(source.address, request_id, [1, 2], [3, 4])
        transfer.wait(WAIT_S)
        if transfer.state is TransferState.DONE:
            assert_blocks_equal(source.regions, [1, 2], sink.regions, [3, 4])
        return transfer
    finally:
        sink.close()


@pytest.mark.parametrize("client_auth", [False, True])
def test_a_pull_over_tls_works_and_a_plaintext_sink_is_refused(pki, client_auth):
    server_tls = _with(pki["prefill"], client_auth=client_auth)
    source = GrpcSource(
        LAYOUT, kv_regions(8, seed=1), engine_id="prefill-0", cluster_token=TOKEN, tls=server_tls
    )
    try:
        pulled = _pull(source, _with(pki["decode"], client_auth=client_auth), "over-tls")
        assert pulled.state is TransferState.DONE, pulled.error

        plaintext = _pull(source, None, "plaintext")
        assert plaintext.state is TransferState.FAILED and "UNAVAILABLE" in plaintext.error
        assert source.pinned_blocks("plaintext") == (1, 2)
    finally:
        source.close()


def test_client_authentication_refuses_a_sink_without_a_certificate_of_the_ca(pki):
    source = GrpcSource(
        LAYOUT, kv_regions(8, seed=1), engine_id="prefill-0", cluster_token=TOKEN,
        tls=_with(pki["prefill"], client_auth=True),
    )
    try:
        no_certificate = _pull(source, _with(pki["decode"], client_auth=False), "anonymous")
        stranger = _pull(source, _with(pki["stranger"], client_auth=True), "stranger")
        assert no_certificate.state is TransferState.FAILED and stranger.state is TransferState.FAILED
        assert source.pinned_blocks("anonymous") == (1, 2) and source.pinned_blocks("stranger") == (1, 2)
    finally:
        source.close()


def test_a_sink_refuses_a_source_whose_certificate_its_ca_did_not_sign(pki):
    source = GrpcSource(
        LAYOUT, kv_regions(8, seed=1), engine_id="prefill-0", cluster_token=TOKEN, tls=pki["stranger"]
    )
    try:
        refused = _pull(source, pki["decode"], "impostor")
        assert refused.state is TransferState.FAILED and "CERTIFICATE_VERIFY_FAILED" in refused.error
    finally:
        source.close()


def test_client_authentication_needs_a_ca():
    with pytest.raises(ValueError, match="CA"):
        TlsFiles("cert.pem", "key.pem", None, client_auth=True)
