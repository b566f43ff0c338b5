"""KV block transfer between prefill and decode workers, below the vLLM connector.

- `base`: the interface (BlockSource, BlockSink, KVTransfer, TransferState, KVLayoutSpec, errors).
- `fake`: in-process implementation for higher-level tests.
- `grpc`: portable implementation (chunked server stream) and the NCCL path's side channel.
- `nccl`: per-pair torch.distributed groups (NCCL on CUDA, gloo on CPU) with staged batches.
- `blocks`, `leases`, `wire`: shared helpers (block copies, pins and leases, protobuf mapping).

Importing this package imports nothing heavy; import the implementation module you use.
"""
