from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayoutSpec(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "kv_layout", "tp_size", "tp_rank", "num_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    kv_layout: str
    tp_size: int
    tp_rank: int
    num_layers: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("block_shape", "dtype", "block_nbytes")
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    block_nbytes: int
    def __init__(self, block_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., block_nbytes: _Optional[int] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("wire_version", "engine_id")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    engine_id: str
    def __init__(self, wire_version: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class ChallengeResponse(_message.Message):
    __slots__ = ("wire_version", "engine_id", "nonce")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    engine_id: str
    nonce: bytes
    def __init__(self, wire_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("wire_version", "compat_hash", "layout", "engine_id", "token_proof", "server_nonce", "client_nonce")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROOF_FIELD_NUMBER: _ClassVar[int]
    SERVER_NONCE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NONCE_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    compat_hash: str
    layout: LayoutSpec
    engine_id: str
    token_proof: bytes
    server_nonce: bytes
    client_nonce: bytes
    def __init__(self, wire_version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., layout: _Optional[_Union[LayoutSpec, _Mapping]] = ..., engine_id: _Optional[str] = ..., token_proof: _Optional[bytes] = ..., server_nonce: _Optional[bytes] = ..., client_nonce: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("wire_version", "compat_hash", "layout", "engine_id", "session_id", "regions", "token_proof")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PROOF_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    compat_hash: str
    layout: LayoutSpec
    engine_id: str
    session_id: str
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    token_proof: bytes
    def __init__(self, wire_version: _Optional[int] = ..., compat_hash: _Optional[str] = ..., layout: _Optional[_Union[LayoutSpec, _Mapping]] = ..., engine_id: _Optional[str] = ..., session_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ..., token_proof: _Optional[bytes] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "max_chunk_bytes", "release_after")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_AFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    max_chunk_bytes: int
    release_after: bool
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., max_chunk_bytes: _Optional[int] = ..., release_after: _Optional[bool] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("region", "block_offset", "block_count", "data")
    REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    region: int
    block_offset: int
    block_count: int
    data: bytes
    def __init__(self, region: _Optional[int] = ..., block_offset: _Optional[int] = ..., block_count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class SetupCommunicatorRequest(_message.Message):
    __slots__ = ("pair_id", "backend")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    backend: str
    def __init__(self, pair_id: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class SetupCommunicatorResponse(_message.Message):
    __slots__ = ("store_address", "params")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    params: bytes
    def __init__(self, store_address: _Optional[str] = ..., params: _Optional[bytes] = ...) -> None: ...
