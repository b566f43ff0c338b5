"""TLS for the KV gRPC channel: which files an endpoint uses and the gRPC credentials made of them.

One certificate and key per engine serve both ends: a source presents them as its server
certificate; with client authentication on, a sink presents them as its client certificate and
the source checks it against `ca_file`. A sink checks the source's certificate against
`ca_file` (the system's roots when None) and the address it dials, or `server_name` when the
certificates name the cluster rather than each host. Files are read once, when an endpoint is
built; restart the engine to rotate them.

TLS covers the gRPC channel: handshake, pulls over gRPC, and the NCCL path's side channel (so
each NCCL pair's control key travels encrypted). NCCL's own traffic and its rendezvous store are
not encrypted (NCCL has no TLS); keep them on a trusted network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = ["TlsFiles"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one endpoint; built by the connector from `kv.tls_*`."""

    certfile: str
    keyfile: str
    ca_file: str | None = None
    client_auth: bool = False  # sources require, and sinks present, client certificates
    server_name: str | None = None  # the name sinks expect in sources' certificates

    def __post_init__(self) -> None:
        if self.client_auth and not self.ca_file:
            raise ValueError("TLS client authentication needs a CA file to check client certificates")

    def server_credentials(self) -> grpc.ServerCredentials:
        """A source's credentials; once per source."""
        pair = (_read(self.keyfile), _read(self.certfile))
        roots = _read(self.ca_file) if self.client_auth and self.ca_file else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=roots, require_client_auth=self.client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A sink's credentials; once per channel."""
        roots = _read(self.ca_file) if self.ca_file else None
        if not self.client_auth:
            return grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.ssl_channel_credentials(
            root_certificates=roots, private_key=_read(self.keyfile), certificate_chain=_read(self.certfile)
        )

    def channel_options(self) -> list[tuple[str, str]]:
        """Extra channel options: the expected server name, when set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
