"""KV block transfer between prefill and decode workers, below the vLLM connector.

- `base`: the interface (BlockSource, BlockSink, KVTransfer, TransferState).
- `regions`, `handshake`, `errors`, `defaults`: what the interface speaks of (KVLayoutSpec,
  BlockRegion; the version, token and layout checks at handshake; the control-plane errors; the
  settings' defaults, in a module light enough for the config tree to import).
- `fake`: in-process implementation for higher-level tests.
- `grpc`: portable implementation (chunked server stream) and the NCCL path's side channel.
- `nccl`: per-pair torch.distributed groups (NCCL on CUDA, gloo on CPU) with staged batches.
- `blocks`, `leases`, `heads`, `wire`: shared helpers (block copies, pins and leases, KV heads
  across TP sizes, protobuf mapping).

Importing this package imports nothing heavy; import the implementation module you use.
"""
