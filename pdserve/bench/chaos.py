"""`pdserve bench chaos`: a soak that SIGKILLs a running service's engines and reports how it survives.

Lifecycle of one soak (`run_command`):
1. read /health and /metrics once (the service must answer both), resolve the model;
2. references: `--reference FILE` (written by `--write-reference FILE` against a calm, e.g. colocated,
   service), or else every prompt sent once to the target itself before anything is killed;
3. for `--duration-s`: Poisson arrivals of greedy completions (streaming, a `--non-streaming-share`
   not) over `--prompts` fixed prompts, each with its own hang timeout; a poller reads /health and
   /metrics every 0.5 s; a killer SIGKILLs one serving engine, picked at random among the pools of
   `--kill-pools` on this machine, first at `--warmup-s` and then after exponential gaps;
4. wait for the requests still running (each ends by its timeout), then, bounded by
   `--settle-timeout-s`, until the service is ready and idle (nothing running, KV usage 0);
5. write `chaos.json` and `chaos.png` into --out, print the table; exit 3 when a request hung, differed
   from its reference or was lost, or KV usage is not back to 0 (chaos_report.verdict).

One aiohttp session carries every request and poll; a `TaskGroup` owns the request tasks, the poller
and the killer, so an interrupted soak cancels them all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil

from pdserve.bench.chaos_report import (
    EngineSeries,
    HealthSample,
    Kill,
    MetricsSnapshot,
    Outcome,
    RequestRecord,
    SoakRun,
    build_report,
    exit_code,
    format_table,
    health_sample,
    missing_references,
)
from pdserve.bench.client import KEEPALIVE_S, SSEDecoder, fetch_first_model
from pdserve.bench.report import save_json
from pdserve.errors import PdserveError

_DESCRIPTION = ("Chaos soak: load a running service, SIGKILL its engines at random, report failures, "
                "hangs, wrong greedy text and time to heal.")
POLL_S = 0.5  # /health and /metrics; a heal is timed to this resolution
_PROBE_TIMEOUT_S = 5.0  # one /health or /metrics answer; a slower one counts as no answer
_REFERENCE_CONCURRENCY = 4
# Words of the generated prompts: common English, so any tokenizer splits them into real tokens.
_WORDS = tuple(
    "the of and to in is was for on that with as by at from his her an were are which this be has had "
    "or one their first new after who they two its been more other into time over also city world "
    "year river light music house water story north small great early people language history".split()
)


class ChaosError(PdserveError):
    """The soak could not run (service unreachable, references missing); the message says why."""


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register `chaos` on `pdserve bench`'s subcommands, with its own handler."""
    parser = commands.add_parser("chaos", help="kill engines under load, report how the service heals",
                                 description=_DESCRIPTION)
    add_args(parser)
    parser.set_defaults(func=run_command, handler=run_command, bench_command="chaos", bench_parser=parser)
    return parser


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", required=True, help="the running service, e.g. http://127.0.0.1:8000")
    a("--model", help="model name to send (default: the service's first model)")
    a("--api-key", help="bearer key for the API and /metrics")
    a("--out", type=Path, default=Path("."), help="directory for chaos.json and chaos.png")
    a("--rate", type=_positive, default=1.0, help="mean request rate (Poisson arrivals, req/s)")
    a("--duration-s", type=_positive, default=120.0, help="how long requests are sent and engines killed")
    a("--prompts", type=_count, default=16, help="distinct prompts (deterministic, varied lengths)")
    a("--max-prompt-words", type=_count, default=200, help="longest prompt, in words")
    a("--max-tokens", type=_count, default=32, help="max_tokens of every completion")
    a("--non-streaming-share", type=_share, default=0.2, help="share of requests sent without streaming")
    a("--request-timeout-s", type=_positive, default=300.0,
      help="a request with no completion by then counts as hung")
    a("--kill-interval-s", type=_positive, default=30.0, help="mean gap between kills (exponential)")
    a("--warmup-s", type=_non_negative, default=10.0, help="first kill after this long")
    a("--max-kills", type=_non_negative_int, default=None, help="stop killing after this many (0: none)")
    a("--kill-pools", type=lambda text: [p for p in text.split(",") if p], default=["prefill", "decode"],
      help="comma-separated pools whose engines may be killed (default: prefill,decode)")
    a("--local", action="store_true", help="treat every engine as on this machine (skip the node IP check)")
    a("--reference", type=Path, help="JSON {prompt: text} from --write-reference (default: the target's "
      "own answers before the first kill)")
    a("--write-reference", type=Path, metavar="FILE",
      help="only send each prompt once and write {prompt: text} to FILE (run it against a calm service)")
    a("--unrecoverable-pattern", default=r"no live engine|no engine can take",
      help="regex: a failure whose error matches is not counted as lost")
    a("--settle-timeout-s", type=_non_negative, default=120.0,
      help="after the load, wait at most this long for the service to be ready and idle")
    a("--bucket-s", type=_positive, default=5.0, help="timeline bucket")
    a("--seed", type=int, default=0, help="seed of prompts, arrivals and kills")
    a("--no-plots", action="store_true", help="skip chaos.png")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be within 0..1, got {text}")
    return value


def run_command(args: argparse.Namespace) -> int:
    try:
        re.compile(args.unrecoverable_pattern)
    except re.error as exc:
        args.bench_parser.error(f"--unrecoverable-pattern: {exc}")
    try:
        return asyncio.run(_write_reference(args) if args.write_reference else _soak(args))
    except (ChaosError, ConnectionError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


# --- plain schedules -----------------------------------------------------------------------------------


def chaos_prompts(count: int, seed: int, max_words: int = 200) -> list[str]:
    """`count` distinct prompts, lengths spread log-uniformly over 4..max_words words (short and long
    prompts both: a kill then lands in prefills and in decodes)."""
    rng = np.random.default_rng(seed)
    low, high = math.log(min(4, max_words)), math.log(max_words)
    prompts = []
    for i in range(count):
        words = int(round(math.exp(rng.uniform(low, high))))
        prompts.append(f"Note {i}: " + " ".join(rng.choice(_WORDS, size=words)))
    return prompts


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` over [0, duration_s)."""
    times, t = [], 0.0
    while (t := t + rng.exponential(1.0 / rate)) < duration_s:
        times.append(t)
    return times


def kill_times(warmup_s: float, mean_gap_s: float, duration_s: float, rng: np.random.Generator,
               max_kills: int | None = None) -> list[float]:
    """The first kill at the end of the warm-up, then exponential gaps of mean `mean_gap_s`."""
    times, t = [], warmup_s
    while t < duration_s and (max_kills is None or len(times) < max_kills):
        times.append(t)
        t += rng.exponential(mean_gap_s)
    return times


def pick_victim(engines: Sequence[EngineSeries], pools: Sequence[str], is_local: Callable[[str], bool],
                is_alive: Callable[[int], bool], rng: np.random.Generator) -> EngineSeries | None:
    """One engine of `pools` that is on this machine and alive, uniformly at random; None if none is."""
    candidates = [e for e in engines if e.pool in pools and is_local(e.node) and is_alive(e.pid)]
    return candidates[int(rng.integers(len(candidates)))] if candidates else None


def local_addresses() -> frozenset[str]:
    addresses = {"localhost", "127.0.0.1", "::1"}
    for entries in psutil.net_if_addrs().values():
        addresses.update(entry.address.split("%")[0] for entry in entries)
    return frozenset(addresses)


def _alive(pid: int) -> bool:
    """A live process that is not this one (a zombie is dead)."""
    if pid <= 1 or pid == os.getpid():
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# --- the service ---------------------------------------------------------------------------------------


class Service:
    """The soak's view of the service over one aiohttp session: completions, /health, /metrics."""

    def __init__(self, url: str, model: str, api_key: str | None, max_tokens: int) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._max_tokens = max_tokens
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Service:
        # No connection cap: hung requests must not hold back the ones sent after them.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        # No session deadline: each request has the soak's own hang timeout, each probe its own.
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                              timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def complete(self, prompt: str, stream: bool) -> tuple[str, str]:
        """(text, error): greedy completion of `prompt`; error is "" when it completed."""
        assert self._session is not None
        body = {"model": self.model, "prompt": prompt, "max_tokens": self._max_tokens,
                "temperature": 0.0, "stream": stream}
        try:
            async with self._session.post(f"{self.url}/v1/completions", json=body) as response:
                if response.status != 200:
                    return "", f"HTTP {response.status}: {_error_message(await response.text())}"
                if not stream:
                    payload = await response.json(content_type=None)
                    return str(payload["choices"][0].get("text") or ""), ""
                return await _read_stream(response)
        except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
            return "", f"{type(exc).__name__}: {exc}"

    async def health(self) -> tuple[int | None, Any]:
        """(HTTP status, JSON body); (None, None) when it did not answer in time."""
        try:
            async with self._get("/health") as response:
                text = await response.text()
                try:
                    return response.status, json.loads(text)
                except ValueError:
                    return response.status, None
        except (aiohttp.ClientError, TimeoutError):
            return None, None

    async def metrics(self) -> MetricsSnapshot | None:
        try:
            async with self._get("/metrics") as response:
                if response.status != 200:
                    return None
                return MetricsSnapshot.from_text(await response.text())
        except (aiohttp.ClientError, TimeoutError):
            return None

    def _get(self, path: str) -> Any:
        assert self._session is not None
        return self._session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S))


async def _read_stream(response: aiohttp.ClientResponse) -> tuple[str, str]:
    """The text of an SSE completion stream; an `error` event or a stream cut short is an error."""
    decoder, text, finished = SSEDecoder(), [], False
    async for chunk in response.content.iter_any():
        for data in decoder.feed(chunk):
            if data.strip() == "[DONE]":
                continue
            payload = json.loads(data)
            if not isinstance(payload, dict):
                continue
            if "error" in payload:
                return "".join(text), _error_message(json.dumps(payload))
            for choice in payload.get("choices") or []:
                text.append(choice.get("text") or "")
                finished = finished or choice.get("finish_reason") is not None
    if not finished:
        return "".join(text), "stream ended without a finish_reason"
    return "".join(text), ""


def _error_message(body: str) -> str:
    """An OpenAI-style error body's message, or the body itself."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message") if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body[:500]


# --- the soak ------------------------------------------------------------------------------------------


class _Observer:
    """Polls /health and /metrics every POLL_S; keeps every health sample and the latest metrics."""

    def __init__(self, service: Service, started: float) -> None:
        self._service = service
        self._started = started
        self.samples: list[HealthSample] = []
        self.metrics: MetricsSnapshot | None = None
        self.killed: set[int] = set()  # pids the killer SIGKILLed

    async def poll_once(self) -> HealthSample:
        (status, body), metrics = await asyncio.gather(self._service.health(), self._service.metrics())
        self.metrics = metrics or self.metrics
        sample = health_sample(time.monotonic() - self._started, status, body, metrics,
                               frozenset(self.killed))
        self.samples.append(sample)
        return sample

    async def run(self) -> None:
        while True:
            began = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - began)))


async def _send(service: Service, prompts: Sequence[str], index: int, stream: bool, started: float,
                timeout_s: float) -> RequestRecord:
    sent = time.monotonic() - started
    try:
        async with asyncio.timeout(timeout_s):
            text, error = await service.complete(prompts[index], stream)
    except TimeoutError:
        return RequestRecord(index, stream, sent, sent + timeout_s, Outcome.HUNG)
    outcome = Outcome.FAILED if error else Outcome.COMPLETED
    return RequestRecord(index, stream, sent, time.monotonic() - started, outcome, text, error)


async def _load(service: Service, prompts: Sequence[str], args: argparse.Namespace, started: float,
                rng: np.random.Generator) -> list[RequestRecord]:
    arrivals = poisson_arrivals(args.rate, args.duration_s, rng)
    choices = rng.integers(len(prompts), size=len(arrivals))
    streams = rng.random(len(arrivals)) >= args.non_streaming_share
    tasks = []
    async with asyncio.TaskGroup() as group:
        for at, index, stream in zip(arrivals, choices, streams, strict=True):
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            tasks.append(group.create_task(
                _send(service, prompts, int(index), bool(stream), started, args.request_timeout_s)))
    return [task.result() for task in tasks]


async def _kill_engines(observer: _Observer, args: argparse.Namespace, started: float,
                        rng: np.random.Generator) -> tuple[list[Kill], list[dict[str, Any]]]:
    """SIGKILL an engine at each scheduled time; a time with no engine to kill is recorded as skipped."""
    addresses = local_addresses()
    killed: list[Kill] = []
    skipped: list[dict[str, Any]] = []
    for at in kill_times(args.warmup_s, args.kill_interval_s, args.duration_s, rng, args.max_kills):
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        engines = observer.metrics.engines if observer.metrics else ()
        victim = pick_victim(engines, args.kill_pools, lambda node: args.local or node in addresses,
                             lambda pid: _alive(pid) and pid not in observer.killed, rng)
        t = time.monotonic() - started
        if victim is None:
            skipped.append({"t": round(t, 3), "why": f"no live local engine in {','.join(args.kill_pools)}"})
            continue
        try:
            psutil.Process(victim.pid).kill()
        except psutil.Error as exc:
            skipped.append({"t": round(t, 3), "why": f"{victim.replica} pid {victim.pid}: {exc}"})
            continue
        observer.killed.add(victim.pid)
        killed.append(Kill(t, victim.pool, victim.replica, victim.pid, victim.node))
        print(f"[{t:7.1f} s] killed {victim.pool} {victim.replica} (pid {victim.pid})", flush=True)
    return killed, skipped


async def _settle(observer: _Observer, timeout_s: float, dead: frozenset[int]) -> dict[str, Any]:
    """Wait, bounded, until /health says ready and /metrics shows nothing running and no KV in use."""
    began = time.monotonic()
    while True:
        sample = await observer.poll_once()
        metrics = observer.metrics
        if sample.ready and metrics is not None and metrics.idle(dead):
            return {"ready_and_idle": True, "waited_s": round(time.monotonic() - began, 3)}
        if time.monotonic() - began >= timeout_s:
            return {"ready_and_idle": False, "waited_s": round(time.monotonic() - began, 3),
                    "last_health": sample.status, "reason": sample.reason}
        await asyncio.sleep(POLL_S)


async def _references(service: Service, prompts: Sequence[str]) -> dict[str, str]:
    """Each prompt sent once (non-streaming, a few at a time); any failure stops the soak."""
    limit = asyncio.Semaphore(_REFERENCE_CONCURRENCY)

    async def one(prompt: str) -> tuple[str, str]:
        async with limit:
            return await service.complete(prompt, stream=False)

    answers = await asyncio.gather(*(one(p) for p in prompts))
    errors = [error for _, error in answers if error]
    if errors:
        raise ChaosError(f"{len(errors)} of {len(prompts)} reference requests failed; first: {errors[0]}")
    return {prompt: text for prompt, (text, _) in zip(prompts, answers, strict=True)}


async def _open(args: argparse.Namespace) -> tuple[str, list[str]]:
    model = args.model or await fetch_first_model(args.url, args.api_key)
    return model, chaos_prompts(args.prompts, args.seed, args.max_prompt_words)


async def _write_reference(args: argparse.Namespace) -> int:
    model, prompts = await _open(args)
    async with Service(args.url, model, args.api_key, args.max_tokens) as service:
        references = await _references(service, prompts)
    save_json(references, args.write_reference)
    print(f"Saved {len(references)} reference completions to {args.write_reference}")
    return 0


def _read_references(path: Path, prompts: Sequence[str]) -> dict[str, str]:
    references = json.loads(path.read_text())
    missing = missing_references(prompts, references)
    if missing:
        raise ChaosError(f"{path} has no text for {len(missing)} of the {len(prompts)} prompts; write it "
                         "with the same --prompts, --max-prompt-words, --seed and --max-tokens")
    return references


async def _soak(args: argparse.Namespace) -> int:
    model, prompts = await _open(args)
    async with Service(args.url, model, args.api_key, args.max_tokens) as service:
        status, health_at_start = await service.health()
        metrics_start = await service.metrics()
        if status is None or metrics_start is None:
            raise ChaosError(f"{args.url} did not answer /health and /metrics")
        if args.reference:
            references, source = _read_references(args.reference, prompts), str(args.reference)
        else:
            references = await _references(service, prompts)
            source = "the target service itself, before the first kill"
        # One stream of random numbers each for the load and the kills: a different --rate does not
        # move the kills, nor --kill-interval-s the requests.
        load_rng, kill_rng = (np.random.default_rng([args.seed, stream]) for stream in (1, 2))
        began_at = datetime.now(UTC).isoformat(timespec="seconds")
        started = time.monotonic()
        observer = _Observer(service, started)
        await observer.poll_once()
        async with asyncio.TaskGroup() as group:
            poller = group.create_task(observer.run())
            killer = group.create_task(_kill_engines(observer, args, started, kill_rng))
            records = await _load(service, prompts, args, started, load_rng)
            kills, skipped = await killer
            poller.cancel()
        drained_s = round(time.monotonic() - started, 3)
        settle = await _settle(observer, args.settle_timeout_s, frozenset(k.pid for k in kills))
        settle["requests_ended_s"] = drained_s
        metrics_end = await service.metrics() or observer.metrics or metrics_start
    config = {"args": _args_record(args), "url": args.url, "model": model, "started_at": began_at,
              "health_at_start": {"http_status": status, "body": health_at_start},
              "reference_source": source, "prompts": len(prompts)}
    run = SoakRun(config, prompts, references, records, kills, skipped, observer.samples,
                  metrics_start, metrics_end, settle, args.duration_s)
    report = build_report(run, re.compile(args.unrecoverable_pattern), args.bucket_s)
    _save(args, report)
    print(format_table(report))
    return exit_code(report)


def _args_record(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "handler", "bench_parser", "api_key"}
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}


def _save(args: argparse.Namespace, report: dict[str, Any]) -> None:
    path = save_json(report, args.out / "chaos.json")
    if not args.no_plots:
        from pdserve.bench.plots import plot_chaos  # matplotlib: ~0.5 s, only when plotting

        plot_chaos(report, args.out / "chaos.png")
    print(f"Saved {path}{'' if args.no_plots else ' (+ chaos.png)'}")
