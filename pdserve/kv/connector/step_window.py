"""The part of a step in which a decode worker may wait for its pulls at no cost to the engine.

Under vLLM's async scheduling (the default on GPU) the engine thread launches step m while the GPU
still runs step m-1: it schedules m, queues m's forward and sampling, calls the connector's
get_finished, and only then blocks until m-1's outputs are ready. A pull that get_finished(m)
reports rides on m's outputs, which the scheduler reads two steps later; it then admits the
request into the step after the one it has already scheduled ahead. A pull that ends just after
get_finished(m) returned waits for get_finished(m+1), one more step.

Measured on vLLM 0.24 (2 x H100, Llama-3.1-8B shape, 1P1D at 8-20 req/s, NCCL pulls of 256 MiB
taking 3.6-9.9 ms on average; benchmarks/results/gpu/decode-gap/): the decode engine admitted
70-99% of its requests exactly four steps after the step during which they reached its scheduler
(3.5-3.7 steps after their pull's mean end), most of the rest five. A request reaches the
scheduler right after a step's outputs (0.2 ms later); its pull starts as the next step is
launched, while the GPU still runs the step the request came in (8-12 ms there), which is longer
than the mean pull.

So get_finished may wait for the pulls in flight for as long as the GPU still runs the work that
was queued before this step's forward (the step before): the engine thread would block that
long anyway, right after. A pull that ends meanwhile is reported one step earlier, and its
request decodes one step earlier (its TPOT drops by a step / 255 at 256 output tokens).

The window: `open()` at the step's first hook (bind_connector_metadata, before the forward is
queued) records a CUDA event on the current stream; `is_open()` is true until the GPU has
passed it; get_finished closes it. A step that was not bound, a CPU engine (its forward has
already run when get_finished comes) and a synchronously scheduled engine (the step before has
ended when this one is launched) get no wait.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from pdserve.kv.transport.base import KVTransfer
from pdserve.kv.transport.regions import BlockRegion

__all__ = ["ClosedWindow", "CudaStepWindow", "StepWindow", "wait_for_pulls", "window_for"]

# How often a wait checks that the GPU still runs the step before. A pull's end wakes the wait
# at once; the GPU's end is seen up to this late (the engine's next step is already queued, so
# 0.2 ms of delay costs the GPU nothing), and each check takes the GIL from the pull threads.
POLL_S = 0.0002


class StepWindow(Protocol):
    """Whether the device still runs the work queued before the current step's forward."""

    def open(self) -> None:
        """The step's first hook, before its forward is queued."""

    def is_open(self) -> bool:
        """True while the work queued before `open()` is still running."""

    def close(self) -> None:
        """The step's report is done; `is_open()` is False until the next `open()`."""


class ClosedWindow:
    """No window: a CPU engine, or a worker before its KV caches are registered."""

    def open(self) -> None:
        pass

    def is_open(self) -> bool:
        return False

    def close(self) -> None:
        pass


class CudaStepWindow:
    """The window on a CUDA device: an event recorded on the current stream at `open()`."""

    def __init__(self, device: torch.device):
        self.device = device
        self._event: torch.cuda.Event | None = None
        self._armed = False

    def open(self) -> None:
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(self.device))
        self._armed = True

    def is_open(self) -> bool:
        return self._armed and self._event is not None and not self._event.query()

    def close(self) -> None:
        self._armed = False


def window_for(regions: Sequence[BlockRegion]) -> StepWindow:
    """The window for a worker whose KV cache is `regions`: CUDA's, or none."""
    if regions and regions[0].tensor.is_cuda:
        return CudaStepWindow(regions[0].tensor.device)
    return ClosedWindow()


def wait_for_pulls(transfers: Sequence[KVTransfer], window: StepWindow, max_wait_s: float) -> None:
    """Blocks while `window` is open and some of `transfers` is still running, for at most
    `max_wait_s`. Sleeps on a running pull's own event (the GIL is released), so a pull's end
    is seen at once and the window's end within POLL_S."""
    deadline = time.monotonic() + max_wait_s
    running = [t for t in transfers if not t.done]
    while running and window.is_open():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        running[0].wait(min(POLL_S, left))
        running = [t for t in running if not t.done]
