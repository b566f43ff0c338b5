"""Scheduler side of the connector: decides what to keep, pull and release; moves no bytes.

Runs inside vLLM's scheduler (EngineCore process, one thread). It sees vLLM `Request` objects
(duck-typed: `request_id`, `kv_transfer_params`, `num_prompt_tokens`, `num_computed_tokens`,
`status`), turns them into small typed plans (`StepPlan`) for the worker side, and keeps only
plain per-request bookkeeping, dropped at `request_finished`.

Prefill request (params `do_remote_decode`), lifecycle:
  update_state_after_alloc (tracked) -> build_step_plan of the step that computes the prompt's
  last token (pin its blocks) -> request_finished: length-capped => confirm and return
  (True, RemotePrefill params); stopped/aborted/unservable => drop the pin, (False, None).
  The worker reports it in get_finished's sending set once the pin ends (pulled, released by
  the decode side, or lease expiry), and vLLM frees the blocks.

Decode request (params `do_remote_prefill`), lifecycle:
  get_num_new_matched_tokens -> (prompt tokens not cached locally, async) -> update_state_after
  _alloc (plan the pull into the freshly allocated blocks, or release the remote pin when
  nothing is left to pull) -> the worker reports it in the receiving set, with the blocks of a
  failed pull in get_block_ids_with_load_errors (vLLM then recomputes or fails the request,
  per kv_load_failure_policy) -> request_finished: release the remote pin if it was never used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kv.connector.compat import FinishKind, ScheduledRequest, finish_kind, prompt_block_ids
from pdserve.kv.connector.config import ConnectorConfig
from pdserve.kv.connector.metadata import (
    KVPin,
    KVPull,
    RemotePrefill,
    RemoteRelease,
    StepPlan,
    WorkerEndpoint,
    is_remote_decode,
    is_remote_prefill,
    prompt_blocks,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _PrefillTrack:
    """A prefill request between its first allocation and request_finished."""

    num_prompt_tokens: int
    block_ids: list[int]
    pinned: tuple[int, ...] | None = None


class SchedulerSide:
    """The connector's scheduler-side state machine; pure apart from logging."""

    def __init__(self, config: ConnectorConfig, *, engine_id: str, block_size: int):
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self._endpoints: dict[int, WorkerEndpoint] = {}
        self._prefills: dict[str, _PrefillTrack] = {}
        self._remotes: dict[str, RemotePrefill | None] = {}  # decode request -> parsed params
        self._local_hits: dict[str, int] = {}  # decode request -> locally cached prompt tokens
        self._settled: set[str] = set()  # decode requests whose remote pin was pulled or released
        self._drops: list[str] = []
        self._pins: list[KVPin] = []
        self._confirms: list[KVPin] = []
        self._pulls: list[KVPull] = []
        self._releases: list[RemoteRelease] = []

    def set_endpoints(self, endpoints: Mapping[int, WorkerEndpoint]) -> None:
        """Records each TP rank's KV source address. vLLM calls it once at engine start, after
        the workers registered their KV caches; never blocks."""
        self._endpoints = dict(endpoints)
        logger.info(
            "pdserve KV connector: sources %s", {r: e.address for r, e in sorted(self._endpoints.items())}
        )

    # ---- decode side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond the local prefix-cache hit that the prefill engine holds.

        Called by vLLM's scheduler for a waiting request each time it tries to schedule it
        (possibly several times; side-effect free apart from remembering the local hit).
        Returns (count, True): the load is asynchronous. Never blocks.
        """
        remote = self._remote_of(request)
        if remote is None:
            return 0, False
        if num_computed_tokens % self.block_size:
            # A partial local block cannot be completed in place: it may be shared.
            logger.warning(
                "request %s: local hit of %d tokens is not block aligned; computing locally",
                request.request_id,
                num_computed_tokens,
            )
            return 0, False
        # Leave at least the last prompt token to compute: vLLM samples from its forward.
        loadable = min(remote.num_prompt_tokens, int(request.num_prompt_tokens) - 1)
        count = loadable - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Plans the pull into the blocks vLLM just allocated, or the release of a remote pin
        that will not be pulled (everything was cached locally); starts tracking a prefill
        request. Called by vLLM's scheduler right after allocating a waiting request's blocks
        (`block_ids`: all of the request's blocks); never blocks."""
        params = request.kv_transfer_params
        if is_remote_decode(params) and self.config.is_producer:
            self._track_prefill(request)
            return
        remote = self._remote_of(request)
        if remote is None:
            return
        request_id = request.request_id
        self._settled.add(request_id)  # one transfer per request, even if it is preempted later
        local = self._local_hits.pop(request_id, 0)
        if num_external_tokens <= 0:
            self._releases.append(RemoteRelease(remote))
            return
        first, end = local // self.block_size, prompt_blocks(local + num_external_tokens, self.block_size)
        src, dst = remote.remote_block_ids[first:end], tuple(int(b) for b in block_ids[first:end])
        if len(src) != end - first or len(dst) != end - first:
            # The transport refuses mismatched lists, so the pull fails and the policy applies.
            logger.error(
                "request %s: need blocks [%d, %d) but have %d remote and %d local",
                request_id,
                first,
                end,
                len(src),
                len(dst),
            )
        self._pulls.append(KVPull(request_id, remote, src, dst))

    def _remote_of(self, request: Any) -> RemotePrefill | None:
        """The parsed params of a decode request that may still pull; None otherwise."""
        request_id = request.request_id
        if not self.config.is_consumer or request_id in self._settled:
            return None
        if request_id not in self._remotes:
            params = request.kv_transfer_params
            self._remotes[request_id] = self._parse(request_id, params) if is_remote_prefill(params) else None
        return self._remotes[request_id]

    @staticmethod
    def _parse(request_id: str, params: Mapping[str, Any]) -> RemotePrefill | None:
        try:
            return RemotePrefill.from_params(params)
        except ValueError as exc:
            logger.error(
                "request %s: ignoring bad kv_transfer_params (computing locally): %s", request_id, exc
            )
            return None

    # ---- prefill side --------------------------------------------------------------------

    def _track_prefill(self, request: Any) -> None:
        track = self._prefills.get(request.request_id)
        if track is not None and track.pinned is not None:
            # Preempted after its pin (only if max_tokens > 1): those blocks were freed.
            self._drops.append(request.request_id)
        self._prefills[request.request_id] = _PrefillTrack(int(request.num_prompt_tokens), [])

    def build_step_plan(self, scheduled: Iterable[ScheduledRequest], num_scheduled_tokens: int) -> StepPlan:
        """This step's work for the worker side; resets the pending lists.

        Called by vLLM's scheduler once per engine step, after every allocation of the step
        (`scheduled`: the step's requests, via compat.iter_scheduled). Pins a prefill request
        whose prompt completes in this step, so its blocks are servable before its first token
        leaves the engine. Never blocks. A decode engine tracks no prefills, so it never walks
        `scheduled` (a generator): at a batch of 100 that walk cost ~270 us a step on a slow CPU.
        """
        for item in scheduled if self._prefills else ():
            track = self._prefills.get(item.request_id)
            if track is None:
                continue
            if item.new_block_ids is not None:
                track.block_ids = (
                    list(item.new_block_ids) if item.replaces else track.block_ids + list(item.new_block_ids)
                )
            prompt_done = item.num_computed_tokens + item.num_scheduled_tokens >= track.num_prompt_tokens
            if track.pinned is None and prompt_done:
                blocks = prompt_block_ids(track.block_ids, track.num_prompt_tokens, self.block_size)
                if blocks is not None:
                    track.pinned = tuple(blocks)
                    self._pins.append(KVPin(item.request_id, track.pinned))
        plan = StepPlan(
            drops=tuple(self._drops),
            pins=tuple(self._pins),
            confirms=tuple(self._confirms),
            pulls=tuple(self._pulls),
            releases=tuple(self._releases),
            num_scheduled_tokens=num_scheduled_tokens,
        )
        self._drops, self._pins, self._confirms, self._pulls, self._releases = [], [], [], [], []
        return plan

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks?, kv_transfer_params for the output). Called by vLLM's scheduler
        exactly once per request, before it frees the blocks; never blocks."""
        if is_remote_decode(request.kv_transfer_params) and self.config.is_producer:
            return self._finish_prefill(request, block_ids)
        self._finish_decode(request)
        return False, None

    def _finish_prefill(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        track = self._prefills.pop(request_id, None)
        num_prompt = int(request.num_prompt_tokens)
        blocks = prompt_block_ids(block_ids, num_prompt, self.block_size)
        problem = self._unservable(request, blocks, num_prompt)
        if problem is not None:
            if problem != "stopped":
                logger.info("request %s: not keeping prefill KV (%s)", request_id, problem)
            if track is not None and track.pinned is not None:
                self._drops.append(request_id)
            return False, None
        assert blocks is not None
        if track is not None and track.pinned is not None and track.pinned != tuple(blocks):
            logger.warning(
                "request %s: pinned %s but vLLM reports %s; re-pinning", request_id, track.pinned, blocks
            )
        self._confirms.append(KVPin(request_id, tuple(blocks)))
        return True, self._params(request_id, blocks, num_prompt)

    def _unservable(self, request: Any, blocks: list[int] | None, num_prompt: int) -> str | None:
        kind = finish_kind(request)
        if kind == FinishKind.STOPPED:
            return "stopped"  # the first token ended the sequence: nothing to decode
        if kind != FinishKind.LENGTH:
            return f"finished as {getattr(request.status, 'name', request.status)}"
        if blocks is None or int(request.num_computed_tokens) < num_prompt:
            return "prompt not fully computed"
        if self._endpoints.get(0) is None or self._endpoints[0].address is None:
            return "no KV source address (worker handshake metadata missing)"
        return None

    def _params(self, request_id: str, blocks: Sequence[int], num_prompt: int) -> dict[str, Any]:
        ranks = sorted(self._endpoints)
        tp_addresses = tuple(self._endpoints[r].address or "" for r in ranks) if len(ranks) > 1 else ()
        return RemotePrefill(
            remote_engine_id=self.engine_id,
            remote_request_id=request_id,
            remote_address=self._endpoints[0].address or "",
            remote_block_ids=tuple(blocks),
            num_prompt_tokens=num_prompt,
            transport=self.config.transport,
            remote_tp_addresses=tp_addresses,
        ).to_params()

    def _finish_decode(self, request: Any) -> None:
        request_id = request.request_id
        self._local_hits.pop(request_id, None)
        if request_id in self._settled:
            self._settled.discard(request_id)
            self._remotes.pop(request_id, None)
            return
        # Never allocated (aborted while waiting, or refused): the prefill engine still pins it.
        remote = self._remote_of(request)
        self._remotes.pop(request_id, None)
        if remote is not None:
            self._releases.append(RemoteRelease(remote))

    @property
    def num_tracked(self) -> int:
        """Requests with live bookkeeping; tests check it returns to zero."""
        return len(self._prefills) + len(self._remotes) + len(self._local_hits) + len(self._settled)
