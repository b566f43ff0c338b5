"""The control-plane errors of KV transfer: a peer refused or unreachable at handshake.

Data-plane failures are not raised: a pull ends in `TransferState.FAILED` with an error string
(base.py), and the connector applies its policy.
"""

from __future__ import annotations

from pdserve.errors import PdserveError

__all__ = [
    "AuthenticationError", "IncompatiblePeerError", "KVTransportError", "PairLimitError", "WireVersionError",
]


class KVTransportError(PdserveError):
    """A peer was refused or could not be reached (control plane)."""


class WireVersionError(KVTransportError):
    """The peer speaks another wire version."""


class AuthenticationError(KVTransportError):
    """The peer did not prove knowledge of this cluster's token."""


class PairLimitError(KVTransportError):
    """A source refused another NCCL pair: the session's or the source's limit is reached."""


class IncompatiblePeerError(KVTransportError):
    """The peer lays out KV differently; `field` names the first differing field."""

    def __init__(
        self, field: str, local: object = None, remote: object = None, *, message: str | None = None
    ):
        super().__init__(
            message or f"incompatible KV peer: {field} differs (local {local!r}, remote {remote!r})"
        )
        self.field = field
