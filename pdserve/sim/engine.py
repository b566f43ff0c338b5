"""One simulated engine: vLLM-style continuous batching on a virtual clock.

Lifecycle of a request on an engine (`SimEngine`):
- `submit_prefill(req)`: queued FCFS; it is admitted once the engine has free KV blocks for it
  (a full request reserves prompt + output blocks; a prefill-only leg, its prompt's blocks);
- each step takes the running decode batch plus prefill chunks of the queue up to the token
  budget (`max_num_batched_tokens - batch`) and `max_num_seqs`; the step's duration comes from
  the `EngineProfile`; at its end every decode in the batch has one more token, and a prompt
  whose last chunk ran has its first token (`on_first_token`);
- a full request then joins the decode batch; a prefill-only leg keeps its blocks until the
  decode engine has pulled them (`release`);
- `submit_decode(req)`: a decode leg whose KV comes from a prefill engine: it waits for blocks,
  pulls for `transfer_s`, then joins the batch; `on_finished` fires with its last token.

Decode tokens are not events: a request that joins the batch after step k finishes at step
k + output - 1, kept in a heap by that step number, so a step costs O(log n) for the requests
that finish in it, not O(batch). Nor are most steps: while an engine only decodes, every step
has the same duration (the batch does not change), so one event covers the whole run of steps
up to the next request that finishes (`skip_steps`). New work interrupts the run: the steps
already over are counted, the one in flight ends at its boundary (as in vLLM, new work waits
for the next step), and stepping resumes one step at a time. This gives the same timeline as
stepping one by one, with events in proportion to requests instead of GPU-seconds. Step end
times are kept (`record_steps`) only when per-token ITLs are wanted.

Async scheduling (`EngineProfile.async_scheduling`, vLLM's default on GPU): vLLM's engine core
keeps two steps in flight (`step_with_batch_queue`, batch queue of 2). Once a step is launched it
schedules the next one at once, from what it knows then; only when there is nothing to schedule
does it wait for the step's outputs and schedule afresh. So while work goes on (a decode batch,
a prompt's next chunk, prompts beyond the token budget), the batch of step k+1 is formed when
step k starts, and a request that arrives during step k first runs in step k+2. Decodes are not
held up: the scheduler counts a scheduled token as done, so a request decodes in the step right
after its last prompt chunk, as without async scheduling. Here a step that starts back to back
after another takes only the new work (submitted prompts, pulled decode legs) that was there
when the step before it started, if the engine had work left for it then; otherwise (the look
ahead found nothing, or the engine was idle) it takes all. In an H100 trace of a 1P1D prefill
engine at 20 req/s of 2048-token prompts (2026-11-27), one step later is 50-190 ms, and the
simulated TTFT p50 went from -18% to -7% of the measured.

A step the engine scheduled afresh (not ahead: after idling, or after a look ahead that found
nothing) it first launches, which keeps vLLM's engine core busy for `lookahead_s` (15-38 ms for
a 2048-token prefill on an H100); only then does it take in the requests that came meanwhile
and form the next batch from them. So the step after a fresh one takes the work that came
within `lookahead_s` of its start; if none came, it takes all there is at the fresh step's end.
Session 13's H100 trace, which records when each request reached vLLM's scheduler, shows both:
requests taken in 15-38 ms into a fresh 2048-token prefill and run in the step after it, and
those coming later held to the step's end and run a step later still.

A prefill engine hands its prompts over: the decode engine pulls their KV while the prefill
engine runs its next step, which then takes `EngineProfile.handoff_s` longer per prompt (the
gathers and NCCL sends on its GPU, the pull thread in its process). The step that starts
within `handoff_window_s` of the one that prefilled them pays it; after a longer pause the
pulls are over. In seven H100 runs it was 0.6-1.1 ms per 2048-token prompt, about 2% of a step:
at 20 req/s, 95% of the prefill engine's capacity, without it the simulated TTFT p50 came out
17-27% low in every run of sessions 12-14.

With a `noise_seed`, where the profile says the steps of the engine's pool wander
(`EngineProfile.noise_of`), each step takes the model's time times a factor from the engine's own
process (pdserve.sim.calibration.step_noise), seeded by the noise seed and the replica id, so a run repeats
exactly. Every step is then its own event: decode steps no longer take the same time, so no run of
them is skipped.

With `host` (the engines of a host, this one among them) and a profile that measured engines of
one host slowing each other (`EngineProfile.interference` for the engine's pool), a step that
starts while another engine of the host is running one takes the model's time times the shared
factor, any other step the lone one (pdserve.sim.calibration.step_interference). Steps then differ with
the other engines' work, so no run of them is skipped either.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from functools import partial

from pdserve.sim.calibration.step_interference import interference_factors
from pdserve.sim.calibration.step_noise import StepNoise
from pdserve.sim.engine_profile import EngineProfile
from pdserve.sim.events import EventQueue


class SimRequest:
    """A request's simulated state and timeline (virtual seconds)."""

    __slots__ = ("index", "arrival", "prompt", "output", "prefill_left", "blocks", "blocks_on",
                 "leg", "ttft_pool", "decode_pool", "prefill_engine", "decode_engine", "admission",
                 "first_token", "decode_start", "join_step", "finish", "step_engine", "error",
                 "ctx_join", "pblocks", "pblocks_on", "entered", "prefill_start")

    def __init__(self, index: int, arrival: float, prompt: int, output: int) -> None:
        self.index = index
        self.arrival = arrival
        self.prompt = prompt
        self.output = max(1, output)
        self.prefill_left = prompt
        self.blocks = 0
        self.blocks_on = None  # the engine holding its (full or decode leg) blocks
        self.pblocks = 0  # a prefill leg's prompt blocks, held until pulled
        self.pblocks_on = None
        self.leg = "full"  # "full" (prefill + decode here), "prefill", "decode"
        self.ttft_pool = self.decode_pool = ""
        self.prefill_engine = self.decode_engine = None
        self.admission = None  # the request ledger's Admission
        self.first_token = -1.0  # engine time of the first token
        self.decode_start = 0.0
        self.join_step = 0
        self.finish = -1.0
        self.step_engine = None  # engine whose step log holds its decode tokens
        self.error = ""
        self.ctx_join = 0
        self.entered = 0.0  # when it last reached an engine's scheduler (async scheduling)
        self.prefill_start = -1.0  # when the step with its first prompt chunk started


class SimEngine:
    def __init__(self, replica_id: str, pool: str, profile: EngineProfile, queue: EventQueue,
                 on_first_token: Callable[[SimRequest, SimEngine], None],
                 on_finished: Callable[[SimRequest, SimEngine], None],
                 on_kv_change: Callable[[SimEngine], None],
                 on_step: Callable[[SimEngine, float], None],
                 on_pulled: Callable[[SimRequest, SimEngine], None],
                 on_idle: Callable[[SimEngine], None] | None = None,
                 record_steps: bool = False, skip_steps: bool = True,
                 noise_seed: int | None = None, host: list[SimEngine] | None = None) -> None:
        self.replica_id = replica_id
        self.pool = pool
        self.profile = profile
        self._queue = queue
        self._on_first_token = on_first_token
        self._on_finished = on_finished
        self._on_kv_change = on_kv_change
        self._on_step = on_step
        self._on_pulled = on_pulled
        self._on_idle = on_idle
        self.waiting: deque[SimRequest] = deque()  # prefill not done, FCFS
        self._admitted = 0  # waiting[:_admitted] hold their blocks
        self._pulls: deque[SimRequest] = deque()  # decode legs waiting for blocks
        self._joining: list[SimRequest] = []  # decode legs pulled, join at the next step
        self._finishing: list[tuple[int, int, SimRequest]] = []  # (finish step, index, req)
        self.batch = 0
        self._ctx_sum = 0  # sum over the batch of (prompt + 1 - join step): context = this + n*k
        self.kv_used = 0
        self.steps = 0
        self.step_ends: list[float] | None = [] if record_steps else None
        self.busy = False
        self.busy_s = 0.0
        self._step_prefill: list[tuple[SimRequest, int]] = []
        self._step_started = 0.0
        self._fresh = True  # the step in flight was formed at its start (see _cutoff)
        # requests the last step handed over (prefill legs the decode engine pulls), and until
        # when a step that starts serves their pulls (EngineProfile.handoff_s)
        self._handing = 0
        self._handing_until = 0.0
        self.created = queue.now
        # the steps' wandering speed, this engine's own draw of it (EngineProfile.step_noise)
        noise = profile.noise_of(pool) if noise_seed is not None else ()
        self._noise = StepNoise(noise, random.Random(f"{noise_seed}:{replica_id}")) if noise else None
        # the engines this one shares a host with, where they slow each other's steps
        shared = profile.interference.get(pool) if host is not None else None
        self._host = host if shared else None
        self._alone, self._shared = interference_factors(*shared) if shared else (1.0, 1.0)
        self._skip = (skip_steps and profile.decode_ctx_s_per_token == 0 and self._noise is None
                      and self._host is None)
        self._run: tuple[int, float, float, int] | None = None  # (k0, t0, step_s, steps)
        self._run_token = 0
        self.draining = False
        self.removed: float | None = None

    # --- work in ----------------------------------------------------------------------------

    def submit_prefill(self, req: SimRequest) -> None:
        """A request (leg "full" or "prefill") whose prompt this engine prefills."""
        if req.leg == "full":
            req.blocks = self.profile.blocks(req.prompt + req.output)
        else:
            req.pblocks = self.profile.blocks(req.prompt)
        req.entered = self._queue.now
        self.waiting.append(req)
        self._kick()

    def submit_decode(self, req: SimRequest) -> None:
        """A decode leg: pull the prompt's KV from its prefill engine, then decode."""
        req.blocks = self.profile.blocks(req.prompt + req.output)
        self._pulls.append(req)
        self._admit_pulls()

    def release(self, req: SimRequest) -> None:
        """Free a finished request's blocks here."""
        if req.blocks_on is self:
            self.kv_used -= req.blocks
            req.blocks_on = None
            self._freed()

    def release_prefill(self, req: SimRequest) -> None:
        """Free a prefill leg's blocks (the decode engine has pulled them)."""
        if req.pblocks_on is self:
            self.kv_used -= req.pblocks
            req.pblocks_on = None
            self._freed()

    def _freed(self) -> None:
        self._on_kv_change(self)
        self._admit_pulls()
        self._kick()

    @property
    def idle(self) -> bool:
        return (not self.busy and not self.waiting and not self._pulls and not self._joining
                and self.batch == 0 and self.kv_used == 0)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.profile.num_kv_blocks

    # --- internals --------------------------------------------------------------------------

    def _try_alloc(self, req: SimRequest, prefill_leg: bool = False) -> bool:
        need = req.pblocks if prefill_leg else req.blocks
        if self.kv_used + need > self.profile.num_kv_blocks:
            return False
        self.kv_used += need
        if prefill_leg:
            req.pblocks_on = self
        else:
            req.blocks_on = self
        self._on_kv_change(self)
        return True

    def _admit_pulls(self) -> None:
        while self._pulls and self._try_alloc(self._pulls[0]):
            req = self._pulls.popleft()
            req.decode_start = self._queue.now
            self._queue.after(self.profile.perf.transfer_s(req.prompt), self._pulled, req)

    def _pulled(self, req: SimRequest) -> None:
        if req.prefill_engine is not None:
            req.prefill_engine.release_prefill(req)
        self._on_pulled(req, self)
        req.entered = self._queue.now
        self._joining.append(req)
        self._kick()

    def _kick(self) -> None:
        if not self.busy:
            self._start_step(back_to_back=False)
        elif self._run is not None:
            self._interrupt_run()

    def _interrupt_run(self) -> None:
        """New work during a decode-only run: end the run at the boundary of the step in flight."""
        k0, t0, step, n = self._run
        done = min(int((self._queue.now - t0) / step), n - 1)
        self._run = None
        self._run_token += 1
        self._advance(done, t0, step)
        self._step_started = t0 + done * step
        self._fresh = self._fresh and done == 0  # the run's later steps were scheduled ahead
        self._queue.schedule(max(t0 + (done + 1) * step, self._queue.now), self._end_step)

    def _advance(self, m: int, t0: float, step: float) -> None:
        """Count `m` decode steps of a run (none of them finishes a request)."""
        if m <= 0:
            return
        if self.step_ends is not None:
            self.step_ends.extend(t0 + step * j for j in range(1, m + 1))
        self.steps += m
        self.busy_s += m * step
        self._on_step(self, step)

    def _end_run(self, token: int) -> None:
        if token != self._run_token or self._run is None:
            return  # interrupted: a plain step end was scheduled instead
        k0, t0, step, n = self._run
        self._run = None
        self._advance(n - 1, t0, step)
        self._step_started = self._queue.now - step
        self._fresh = self._fresh and n == 1
        self._end_step()

    def _start_step(self, back_to_back: bool = True) -> None:
        k = self.steps
        cutoff = self._cutoff() if back_to_back and self.profile.async_scheduling else None
        self._fresh = cutoff is None  # formed now, not ahead: launching it delays the look ahead
        held = False  # new work left for the step after this one (async scheduling)
        if cutoff is None:
            joining = self._joining
            self._joining = []
        else:
            joining = [r for r in self._joining if r.entered <= cutoff]
            self._joining = [r for r in self._joining if r.entered > cutoff]
            held = bool(self._joining)
        for req in joining:  # pulled decode legs: their next token ends this step
            self._join(req, k)
        p = self.profile
        budget = p.max_num_batched_tokens - self.batch
        seats = p.max_num_seqs - self.batch
        chunks = self._step_prefill
        prefill_tokens = 0
        for i, req in enumerate(self.waiting):
            if cutoff is not None and req.entered > cutoff:
                held = True  # FCFS: everyone behind it came later still
                break
            if budget <= 0 or seats <= 0:
                break
            if i >= self._admitted:
                if not self._try_alloc(req, req.leg == "prefill"):
                    break  # FCFS: the head waits for blocks, nobody overtakes it
                self._admitted += 1
            chunk = min(req.prefill_left, budget)
            if req.prefill_left == req.prompt:
                req.prefill_start = self._queue.now
            chunks.append((req, chunk))
            prefill_tokens += chunk
            budget -= chunk
            seats -= 1
        if not chunks and self.batch == 0:
            if held:  # what was held back could not run anyway (blocked on KV): take it all
                self._start_step(back_to_back=False)
                return
            self.busy = False
            if self._on_idle is not None and self.idle:
                self._on_idle(self)
            return
        context = self._ctx_sum + self.batch * k if p.decode_ctx_s_per_token else 0
        duration = p.step_s(prefill_tokens, self.batch, context)
        if self._handing and self._queue.now < self._handing_until:
            duration += p.handoff_s * self._handing
        self._handing = 0
        if self._host is not None:
            busy = any(e.busy for e in self._host if e is not self)
            duration *= self._shared if busy else self._alone
        if self._noise is not None:
            duration *= self._noise.factor(self._queue.now, duration)
        self.busy = True
        self._step_started = self._queue.now
        if not chunks and self._skip and not held:
            steps = self._finishing[0][0] - k  # until the next request finishes
            if steps > 1:
                self._run = (k, self._queue.now, duration, steps)
                self._run_token += 1
                self._queue.after(steps * duration, self._end_run, self._run_token)
                return
        self._queue.after(duration, self._end_step)

    def _cutoff(self) -> float | None:
        """Under async scheduling, for a step that starts as the one before it ends: when vLLM
        formed its batch. That was as the step before started (`lookahead_s` later if that step
        was formed afresh), if the engine had work for it then: a decode batch going on (with
        the prompts the step before finished, which decode in this step) or prompts and pulled
        legs already waiting. Otherwise (None) vLLM waited for the step's outputs, and this
        step takes all the work there is now."""
        formed = self._step_started + (self.profile.lookahead_s if self._fresh else 0.0)
        if (self.batch > 0 or (self.waiting and self.waiting[0].entered <= formed)
                or any(r.entered <= formed for r in self._joining)):
            return formed
        return None

    def _join(self, req: SimRequest, k: int) -> None:
        """The request's latest token came out at the end of step k; it decodes from step k+1."""
        req.join_step = k
        req.step_engine = self
        req.ctx_join = req.prompt + 1 - k
        self._ctx_sum += req.ctx_join
        self.batch += 1
        heapq.heappush(self._finishing, (k + req.output - 1, req.index, req))

    def _end_step(self, _: object = None) -> None:
        now = self._queue.now
        self.steps += 1
        k = self.steps
        duration = now - self._step_started
        self.busy_s += duration
        if self.step_ends is not None:
            self.step_ends.append(now)
        decoded = self.batch
        finishing = self._finishing
        while finishing and finishing[0][0] <= k:
            _, _, req = heapq.heappop(finishing)
            self.batch -= 1
            self._ctx_sum -= req.ctx_join
            req.finish = now
            self.release(req)
            self._on_finished(req, self)
        firsts = []
        for req, chunk in self._step_prefill:
            req.prefill_left -= chunk
            if req.prefill_left <= 0:
                firsts.append(req)
                if req.leg == "full" and req.output > 1:
                    self._join(req, k)
                elif req.leg == "full":
                    self.release(req)
        self._step_prefill.clear()
        if self.profile.handoff_s:
            self._handing = sum(1 for req in firsts if req.leg == "prefill" and req.output > 1)
            self._handing_until = now + self.profile.handoff_window_s
        if firsts:  # finished prompts are at the head of the queue (FCFS chunks)
            for _ in firsts:
                self.waiting.popleft()
            self._admitted -= len(firsts)
        if decoded:
            self._on_step(self, duration)
        self.busy = False
        self._start_step()
        if firsts:
            # vLLM hands out the outputs of a step that decoded only part way into the next
            # step's prefill (EngineProfile.release_delay_s): first tokens wait, the batch does not.
            held = sum(chunk for _, chunk in self._step_prefill)
            delay = self.profile.release_delay_s(held) if self.busy and decoded else 0.0
            for req in firsts:
                req.first_token = now + delay
                if req.leg == "full" and req.output == 1:
                    req.finish = now + delay
                if delay > 0:
                    self._queue.after(delay, partial(self._on_first_token, req), self)
                else:
                    self._on_first_token(req, self)

