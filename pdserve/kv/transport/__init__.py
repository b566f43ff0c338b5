"""KV block transfer between prefill and decode workers, below the vLLM connector.

- `base`: the interface (BlockSource, BlockSink, KVTransfer, TransferState).
- `regions`, `handshake`, `errors`, `defaults`: what the interface speaks of (KVLayoutSpec,
  BlockRegion; the version, challenge-response token proof and layout checks at handshake; the
  control-plane errors; the settings' defaults, in a module light enough for the config tree to
  import).
- `sessions`: what a source remembers of its peers (single-use challenges, sessions bound to
  their connection, the NCCL pairs each holds).
- `tls`: the KV gRPC channel's TLS files and credentials.
- `fake`: in-process implementation for higher-level tests.
- `grpc`: portable implementation (chunked server stream) and the NCCL path's side channel.
- `control`: the NCCL path's per-pair control connection (one TCP socket, msgpack frames).
- `nccl`: per-pair torch.distributed groups (NCCL on CUDA, gloo on CPU) with staged batches.
- `cuda_ipc`: engines on one node: the sink maps the source's KV cache once (CUDA IPC:
  `ipc_memory`) and each pull is one kernel from the source's blocks into its own (`peer_copy`),
  pipelined over a per-source link (`ipc_link`); NCCL where IPC cannot map the source.
- `blocks`, `leases`, `heads`, `wire`: shared helpers (block copies, pins and leases, KV heads
  across TP sizes, protobuf mapping).

Importing this package imports nothing heavy; import the implementation module you use.
"""
