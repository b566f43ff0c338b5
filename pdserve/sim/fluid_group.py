"""A group of identical engines advanced in fixed time steps, with requests as arrays, not events.

An `EngineGroup` stands for `ready` engines of one pool that the router treats as one: work it
receives is spread evenly over them, so every engine of the group is in the same state and the
group keeps that state once, in per-group totals (per-engine values are totals / ready). At
small scale a group is one engine; at a thousand engines it is ~60 of them.

Lifecycle of a step [t0, t1) (`FluidSimulation` drives it):
1. `begin_step`: engines whose start-up is over become ready; the step's prefill rate is set
   from the decode batch (one engine step serves the batch plus up to
   `max_num_batched_tokens - batch` prompt tokens, in the `EngineProfile` step time);
2. `admit_prefill(times, prompts)`: the step's arrivals placed here, in time order. The group's
   prompts form one FIFO queue served at the group's rate (ready engines x saturated per-engine
   prefill throughput); a request leaves the queue when the work ahead of it is done (Lindley's
   recursion, vectorised) and then takes one engine `ceil(prompt / budget)` steps of the
   current size plus its tokens at the prefill rate: its first token. Returned per request;
3. `join(times, ...)`: requests that start decoding here at those times (colocated and local
   prefills at their first token, remote ones once their KV is pulled) are queued to join;
4. `advance`: the decode batch runs as many engine steps as fit in the step (the time the
   prefill queue was busy runs steps with a full prefill chunk, the rest plain decode steps).
   The per-engine step counter `steps` advances by that (fractionally); a request that joins
   at counter s finishes at step ceil(s) + output - 1 (vLLM: one token per step), counted in a
   ring indexed by that step, so finishing is O(steps advanced), not O(batch). KV blocks are
   released with them (and prefill legs' blocks once pulled);
5. `resolve`: finished requests' end times come from the recorded (step counter, time) curve,
   in bulk: TPOT = (finish - first token) / (output - 1), exactly the per-request rule.

What this approximates: per-engine queueing noise (a group is one pooled queue, a little
optimistic against per-engine FCFS), the decode batch changes once per step (joins and
finishes at step granularity), the wait for the step in flight (half a decode step on a busy
engine), KV capacity and `max_num_seqs` are accounted but not enforced (over-use is counted in
`overcommit_steps`).
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.sim.engine_profile import EngineProfile

_RING = 4096  # steps ahead a finishing request can be counted; grows for longer outputs


class TimedQueue:
    """Rows (time, columns...) held until the clock passes their time; appended in chunks.

    Chunks are kept as pushed (unsorted), with their earliest and latest time: most rows are
    taken within a step or two of being pushed, a whole chunk at a time, and a chunk that
    straddles the cut is split by a mask. Cheaper than sorting every chunk on the way in."""

    __slots__ = ("_chunks",)

    def __init__(self) -> None:
        self._chunks: list[tuple[float, float, np.ndarray, tuple[np.ndarray, ...]]] = []

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def push(self, times: np.ndarray, *columns: np.ndarray) -> None:
        if not len(times):
            return
        self._chunks.append((float(times.min()), float(times.max()), times, columns))

    def pop_before(self, t: float) -> tuple[np.ndarray, tuple[np.ndarray, ...]] | None:
        """Rows with time < t (in no particular order), removed from the queue."""
        taken, keep = [], []
        for chunk in self._chunks:
            first, last, times, cols = chunk
            if first >= t:
                keep.append(chunk)
            elif last < t:
                taken.append((times, cols))
            else:
                early = times < t
                late = ~early
                taken.append((times[early], tuple(c[early] for c in cols)))
                rest = times[late]
                keep.append((float(rest.min()), last, rest, tuple(c[late] for c in cols)))
        self._chunks = keep
        if not taken:
            return None
        if len(taken) == 1:
            return taken[0]
        return (np.concatenate([t_ for t_, _ in taken]),
                tuple(np.concatenate(cols) for cols in zip(*(c for _, c in taken))))

    def count(self) -> int:
        return sum(len(times) for _, _, times, _ in self._chunks)


class EngineGroup:
    def __init__(self, group_id: str, pool: str, profile: EngineProfile, created: float) -> None:
        self.group_id = group_id
        self.pool = pool
        self.profile = profile
        self.created = created
        self.ready: list[str] = []  # engine ids serving
        self.starting: list[tuple[float, str]] = []  # (ready at, engine id), in time order
        self.draining = False  # the whole group takes no new work; removed once idle
        self.removed: float | None = None
        # Prefill: the pooled FIFO queue (Lindley) and this step's figures.
        self.free_at = 0.0  # when the queue's work placed so far is done
        self._rate = 0.0  # group prefill tokens/s this step
        self._busy_s = 0.0  # time the queue was busy within this step
        self._budget = 1  # prefill tokens per engine step this step
        self._tau = 0.0  # decode part of one engine step this step
        # Decode: counts by finishing step, in per-engine step numbers.
        self.steps = 0.0
        self.decoding = 0
        self.kv_used = 0.0  # blocks, group total
        self._ring_n = np.zeros(_RING, np.int64)
        self._ring_blocks = np.zeros(_RING)
        self.joining = TimedQueue()  # (join time) ft, arrival, output, prompt, blocks, alloc
        self.releases = TimedQueue()  # (time) blocks: prefill legs' KV, freed once pulled
        # Decoding requests by the step they joined in: (last finish step, earliest join step
        # - 1, (finish step, ft, arrival, out, prompt)).
        self._pending: list[tuple[float, float, tuple[np.ndarray, ...]]] = []
        self._log_steps = [0.0]
        self._log_t = [created]
        self._decoding_since: float | None = None
        self.overcommit_steps = 0

    # --- state ------------------------------------------------------------------------------

    @property
    def engines(self) -> int:
        return len(self.ready) + len(self.starting)

    @property
    def batch(self) -> float:
        """Per-engine decode batch."""
        return self.decoding / len(self.ready) if self.ready else 0.0

    def queued_tokens(self, now: float) -> float:
        """Group prompt tokens not prefilled yet (in service included)."""
        return max(self.free_at - now, 0.0) * self._rate

    def idle(self, now: float) -> bool:
        return (self.free_at <= now and self.decoding == 0 and not self.joining
                and not self.releases and not self._pending)

    # --- one step ---------------------------------------------------------------------------

    def begin_step(self, t0: float, t1: float) -> list[str]:
        """Start-ups that are over become ready; returns their engine ids."""
        started = []
        while self.starting and self.starting[0][0] <= t0:
            started.append(self.starting.pop(0)[1])
        self.ready.extend(started)
        p = self.profile
        perf = p.perf
        b = self.batch
        self._tau = perf.decode_step_s + perf.decode_step_per_seq_s * b
        self._budget = max(p.max_num_batched_tokens - int(b), 1)
        per_engine = self._budget / (self._tau + self._budget / perf.prefill_tokens_per_s)
        self._rate = len(self.ready) * per_engine
        self._busy_s = min(max(self.free_at - t0, 0.0), t1 - t0)
        return started

    def admit_prefill(self, times: np.ndarray, prompts: np.ndarray, t0: float,
                      t1: float) -> np.ndarray:
        """First-token times (engine side) of prompts arriving at `times` (sorted)."""
        work = prompts / self._rate
        done = np.cumsum(work)
        ahead = done - work
        finish = done + np.maximum(np.maximum.accumulate(times - ahead), self.free_at)
        start = finish - work
        self.free_at = float(finish[-1])
        self._busy_s += float(np.clip(np.minimum(finish, t1) - start, 0.0, None).sum())
        perf = self.profile.perf
        own = self._tau * np.ceil(prompts / self._budget) + prompts / perf.prefill_tokens_per_s
        if self.decoding:  # new work waits for the step in flight: half a step on average
            own = own + np.where(start <= times, 0.5 * self._tau, 0.0)
        return start + own

    def join(self, times: np.ndarray, ft: np.ndarray, arrival: np.ndarray, outputs: np.ndarray,
             prompts: np.ndarray, blocks: np.ndarray, alloc: np.ndarray) -> None:
        """Requests (output > 1) that join the decode batch at `times`; `alloc` blocks are taken
        then (a decode leg's), `blocks` are freed at the finish."""
        self.joining.push(times, ft, arrival, outputs, prompts, blocks, alloc)

    def advance(self, t0: float, t1: float) -> None:
        released = self.releases.pop_before(t1)
        if released is not None:
            self.kv_used -= float(released[1][0].sum())
        joins = self.joining.pop_before(t1)
        if self.decoding == 0 and joins is None:
            self._decoding_since = None
            return
        start = t0
        if self._decoding_since is None:  # the batch was empty: decoding begins with a join
            start = max(float(joins[0].min()), t0)
            self._log_steps.append(self.steps + 1e-9)
            self._log_t.append(start)
        self._decoding_since = start
        joined = len(joins[0]) if joins is not None else 0
        ready = max(len(self.ready), 1)
        p = self.profile
        batch = (self.decoding + joined) / ready
        tau = p.perf.decode_step_s + p.perf.decode_step_per_seq_s * batch
        busy = min(self._busy_s, t1 - start)
        chunk_s = self._budget / p.perf.prefill_tokens_per_s
        n = busy / (tau + chunk_s) + (t1 - start - busy) / tau
        if joins is not None:
            self._join_now(joins, start, (t1 - start) / n)
        s0, s1 = self.steps, self.steps + n
        self._finish(s0, s1)
        self.steps = s1
        self._log_steps.append(s1)
        self._log_t.append(t1)
        if batch > p.max_num_seqs or self.kv_used > p.num_kv_blocks * ready:
            self.overcommit_steps += 1

    def _join_now(self, joins, start: float, step_s: float) -> None:
        times, (ft, arrival, outputs, prompts, blocks, alloc) = joins
        at = self.steps + np.maximum(times - start, 0.0) / step_s
        finish = np.ceil(at) + outputs - 1
        horizon = int(finish.max() - math.floor(self.steps)) + 2
        if horizon >= len(self._ring_n):
            self._grow(horizon)
        slot = finish.astype(np.int64) % len(self._ring_n)
        self._ring_n += np.bincount(slot, minlength=len(self._ring_n))
        self._ring_blocks += np.bincount(slot, weights=blocks, minlength=len(self._ring_n))
        self.decoding += len(times)
        self.kv_used += float(alloc.sum())
        self._pending.append((float(finish.max()), float((finish - outputs).min()),
                              (finish, ft, arrival, outputs, prompts)))

    def _finish(self, s0: float, s1: float) -> None:
        """Requests whose last step lies in (s0, s1] leave the batch."""
        lo, hi = math.floor(s0) + 1, math.floor(s1)
        if hi < lo:
            return
        size = len(self._ring_n)
        if hi - lo + 1 >= size:
            idx = np.arange(size)
        else:
            idx = np.arange(lo, hi + 1) % size
        self.decoding -= int(self._ring_n[idx].sum())
        self.kv_used -= float(self._ring_blocks[idx].sum())
        self._ring_n[idx] = 0
        self._ring_blocks[idx] = 0.0

    def _grow(self, horizon: int) -> None:
        size = len(self._ring_n)
        new = 1 << int(math.ceil(math.log2(horizon + 1)))
        base = math.floor(self.steps)
        old_slots = (base + np.arange(size)) % size
        new_slots = (base + np.arange(size)) % new
        ring_n, ring_b = np.zeros(new, np.int64), np.zeros(new)
        ring_n[new_slots] = self._ring_n[old_slots]
        ring_b[new_slots] = self._ring_blocks[old_slots]
        self._ring_n, self._ring_blocks = ring_n, ring_b

    # --- finished requests ------------------------------------------------------------------

    def resolve(self, everything: bool = False) -> tuple[np.ndarray, ...] | None:
        """Requests finished so far: (finish time, ft, arrival, output, prompt), engine side."""
        if not self._pending:
            return None
        done, keep = [], []
        for last, oldest, cols in self._pending:
            if everything or last <= self.steps:  # the whole join chunk is over
                done.append(cols)
                continue
            over = cols[0] <= self.steps
            if over.any():
                done.append(tuple(c[over] for c in cols))
                rest = ~over
                cols = tuple(c[rest] for c in cols)
            keep.append((last, oldest, cols))
        self._pending = keep
        log_s = np.asarray(self._log_steps)
        log_t = np.asarray(self._log_t)
        if keep:  # the (step, time) curve from the earliest join still decoding
            oldest = min(c[1] for c in keep)
            start = max(int(np.searchsorted(log_s, oldest, side="right")) - 2, 0)
        else:
            start = len(log_s) - 1
        self._log_steps = self._log_steps[start:]
        self._log_t = self._log_t[start:]
        if not done:
            return None
        cols = [np.concatenate(c) for c in zip(*done)] if len(done) > 1 else list(done[0])
        t_finish = np.interp(cols[0], log_s, log_t)
        return (t_finish, *cols[1:])
