"""`pdserve serve` on real local Ray with the mock engine: routing across replicas, and a dead
engine actor mid-request (its stream continues on the other engine, unbroken; the dead engine is
replaced and the pool heals)."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import psutil
import pytest

from pdserve.testing.server import metric_value, start_mock_server, wait_for_metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_mock_server(
        ["--served-model-name", "tiny", "--mode", "colocated", "--replicas", "2",
         "--set", "pools.colocated.num_cpus=0.5", "--set", "engine.mock.decode_step_s=0.02"],
        tmp_path_factory.mktemp("server"))
    yield running
    running.stop()


def complete(server, max_tokens=4, **extra):
    return httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "hello world", "max_tokens": max_tokens, **extra})


def engine_pids(server) -> list[int]:
    """PIDs of this server's engine actor processes, from its `pdserve_engine_info` series
    (other Ray clusters may run on the same machine)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    pids = [int(line.split('pid="')[1].split('"')[0]) for line in text.splitlines()
            if line.startswith("pdserve_engine_info{")]
    assert all(psutil.pid_exists(pid) for pid in pids), pids
    return pids


def test_requests_are_spread_over_both_replicas(server):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: complete(server, max_tokens=20), range(8)))
    assert all(r.status_code == 200 for r in results)
    def finished(text):
        return [metric_value(text, "pdserve_engine_finished_requests", pool="colocated", replica=r) or 0
                for r in ("colocated-0", "colocated-1")]

    served = finished(wait_for_metrics(server.base_url, lambda t: sum(finished(t)) >= 8))
    # Least-outstanding routing splits 8 concurrent requests over both engines.
    assert sum(served) == 8 and min(served) >= 2, served


def stream_events(server, started: threading.Event) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 300, "stream": True,
                            "ignore_eos": True}) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                started.set()
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def stream_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_a_killed_engine_migrates_its_request_and_is_replaced(server):
    import concurrent.futures as cf

    undisturbed = stream_events(server, threading.Event())
    pids = engine_pids(server)
    assert len(pids) == 2, pids
    restarts_before = metric_value(httpx.get(f"{server.base_url}/metrics").text,
                                   "pdserve_engine_restarts_total", pool="colocated",
                                   reason="died") or 0
    with cf.ThreadPoolExecutor(2) as pool:
        # Two long streams: the router puts them on different engines (least outstanding).
        started = [threading.Event(), threading.Event()]
        first = pool.submit(stream_events, server, started[0])
        assert started[0].wait(20)
        second = pool.submit(stream_events, server, started[1])
        assert started[1].wait(20)
        os.kill(pids[0], signal.SIGKILL)
        outcomes = [first.result(timeout=120), second.result(timeout=120)]
    # Both streams complete, the killed engine's one on the other engine: no error event, the
    # same text as an undisturbed stream (no token lost or repeated), one migration.
    for events in outcomes:
        assert not [e for e in events if "error" in e], events
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert stream_text(events) == stream_text(undisturbed)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert metric_value(text, "pdserve_requests_migrated_total", pool="colocated") == 1
    # The dead engine is replaced (no --autoscale): health goes back to ready with two engines,
    # one of them a new process.
    healed = wait_for_metrics(server.base_url, lambda t: len(
        [line for line in t.splitlines() if line.startswith("pdserve_engine_info{")]) == 2
        and (metric_value(t, "pdserve_engine_restarts_total", pool="colocated",
                          reason="died") or 0) == restarts_before + 1, timeout_s=60)
    assert pids[0] not in engine_pids(server) and pids[1] in engine_pids(server), healed
    for _ in range(50):
        health = httpx.get(f"{server.base_url}/health").json()
        if health["status"] == "ready":
            break
        threading.Event().wait(0.2)
    assert health["status"] == "ready" and health["pools"]["colocated"]["serving"] == 2, health
    assert httpx.get(f"{server.base_url}/ready").status_code == 200
    for _ in range(5):
        assert complete(server).status_code == 200


def test_an_idle_connection_outlives_the_usual_client_keep_alive(server):
    """The server keeps an idle connection open for `api.keep_alive_s` (75 s), longer than the
    5 s uvicorn defaults to: a client or load balancer that reuses a pooled connection after a
    few idle seconds must not find it closed under it ("Server disconnected")."""
    import http.client
    import time
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        time.sleep(6.5)  # past uvicorn's default 5 s keep-alive
        conn.request("GET", "/health")  # on the same socket: a closed one raises here or below
        second = conn.getresponse()
        assert second.status == 200 and second.read()
        assert conn.sock is sock
    finally:
        conn.close()
