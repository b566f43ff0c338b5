"""Methods pdserve adds to vLLM's workers (vLLM's `worker_extension_cls`), which the engine
adapter calls through `AsyncLLM.collective_rpc` by name, on every rank of the engine.

- `pdserve_release_kv(request_id)`: end the KV pin that pdserve's connector holds for a
  finished prefill leg whose decode leg will never pull it (`VllmEngine.release_kv`).
- `pdserve_renew_kv(request_id)`: restart that pin's lease while its decode leg still waits
  for its engine (`VllmEngine.renew_kv`).
"""

from __future__ import annotations

QUALNAME = f"{__name__}.PdserveWorkerExtension"


class PdserveWorkerExtension:
    def pdserve_release_kv(self, request_id: str) -> bool:
        worker_side = _worker_side()
        return worker_side is not None and worker_side.release_pin(request_id)

    def pdserve_renew_kv(self, request_id: str) -> bool:
        worker_side = _worker_side()
        return worker_side is not None and worker_side.renew_pin(request_id)


def _worker_side():
    """This worker's side of pdserve's KV connector, or None (no connector configured)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group, has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "worker_side", None)
