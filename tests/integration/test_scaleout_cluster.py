"""Several ingress replicas over one set of engines, on a two-node Ray cluster (issue 32).

The cluster is two Ray nodes on loopback addresses of this machine (`ray start --head` on
127.0.0.2 + `ray start --address` on 127.0.0.3: two raylets, as two machines behave): node A
carries the prefill engine, node B the two decode engines.
`pdserve serve --ray-address ... --ingress-replicas 2` joins it with mock engines: a controller
actor owns the engines, two ingress replicas (spread over the nodes) serve HTTP on one port
(SO_REUSEPORT). Each test drives real HTTP streams through the real actors and kills real
processes (SIGKILL):

- both replicas serve at once and place on every engine;
- an ingress replica killed under load: the other replica's streams finish, new requests are
  served, the engines keep running (same processes), the killed replica comes back and serves
  again, and what it left running on the engines is aborted;
- the controller killed under load: every stream finishes and new requests are served while
  it is gone; it comes back, re-attached to the same engine processes;
- a decode engine killed under load: its streams migrate, the controller replaces it once, and
  both replicas place on the replacement;
- the pdserve process killed: the deployment keeps serving; `pdserve serve` again attaches to
  it without restarting an engine, and its SIGINT takes everything down.

The module's last test ends the deployment, so the tests run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from pdserve.testing import save_tiny_model
from pdserve.testing.ray_cluster import LocalCluster, ray_env, start_cluster
from pdserve.testing.server import RunningServer, free_port, spawn_process, wait_healthy

pytestmark = pytest.mark.integration

INGRESS = ("pdserve-ingress-0", "pdserve-ingress-1")
DECODE_STEP_S = 0.02


@pytest.fixture(scope="module")
def cluster():
    cluster = start_cluster(free_port(), [{"node_a": 100}, {"node_b": 100}])
    try:
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Deployment:
    cluster: LocalCluster
    args: list[str]
    workdir: object
    port: int = field(default_factory=free_port)
    server: RunningServer | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_name: str = "pdserve.log") -> RunningServer:
        command = [sys.executable, "-m", "pdserve", "serve", "--port", str(self.port), *self.args]
        self.server = spawn_process(command, self.port, self.workdir / log_name, ray_env())
        wait_healthy(self.server, 300)
        # A running deployment answers /health before this process attaches: wait for it too.
        wait_for(lambda: self.server.process.poll() is not None
                 or "pdserve ready" in self.server.log_tail(400), 300, "the ready line")
        assert self.server.process.poll() is None, self.server.log_tail()
        return self.server

    def state(self) -> dict:
        """The controller's and replicas' processes, the engines' pids and running requests,
        and the named actors: read by a separate Ray driver."""
        out = subprocess.run([sys.executable, "-c", _STATE, self.cluster.address],
                             capture_output=True, text=True, timeout=120, env=ray_env())
        assert out.returncode == 0, out.stderr[-3000:]
        line = next(l for l in out.stdout.splitlines() if l.startswith("STATE="))
        return json.loads(line.removeprefix("STATE="))


_STATE = r"""
import json, sys, ray
ray.init(address=sys.argv[1], namespace="pdserve", logging_level="ERROR")
out = {"actors": sorted(ray.util.list_named_actors()), "ingress": {}}
try:
    info = ray.get(ray.get_actor("pdserve-controller").info.remote(), timeout=60)
    out["controller"] = {"pid": info["pid"], "incarnation": info["incarnation"],
                         "reporting": info["replicas_reporting"]}
    out["engines"] = {e.replica_id: e.pid for e in info["engines"]}
    out["running"] = {e.replica_id: ray.get(ray.get_actor(e.replica_id).stats.remote(),
                                            timeout=30).num_running for e in info["engines"]}
except ValueError:
    out["controller"] = None
for name in ("pdserve-ingress-0", "pdserve-ingress-1"):
    try:
        out["ingress"][name] = ray.get(ray.get_actor(name).start.remote(), timeout=120)
    except ValueError:
        out["ingress"][name] = None
print("STATE=" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("scaleout")
    model_dir = save_tiny_model(workdir / "tiny-model")
    args = ["--engine", "mock", "--model", str(model_dir), "--served-model-name", "tiny",
            "--ray-address", cluster.address, "--mode", "disaggregated",
            "--prefill", "1", "--decode", "2", "--ingress-replicas", "2",
            "--set", "pools.prefill.num_cpus=0", "--set", "pools.decode.num_cpus=0",
            "--set", "pools.prefill.resources={node_a: 1}",
            "--set", "pools.decode.resources={node_b: 1}",
            "--set", f"engine.mock.decode_step_s={DECODE_STEP_S}",
            "--set", "engine.mock.prefill_tokens_per_s=20000",
            "--set", "scheduler.admit_ttft_factor=100"]
    deployment = Deployment(cluster, args, workdir)
    deployment.start()
    try:
        yield deployment
    finally:
        if deployment.server is not None:
            deployment.server.stop(120)


@dataclass
class Stream:
    ingress: str | None = None
    decode: str | None = None
    tokens: int = 0
    done: bool = False  # [DONE] arrived
    error: str | None = None


def stream(base_url: str, max_tokens: int, keep: int | None = None,
           started: threading.Event | None = None) -> Stream:
    """One streamed completion; `keep`: read that many tokens, then hang up."""
    result = Stream()
    body = {"model": "tiny", "prompt": "one two three four five six seven eight",
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            result.ingress = response.headers.get("x-pdserve-ingress")
            result.decode = response.headers.get("x-pdserve-decode-engine")
            if response.status_code != 200:
                result.error = f"status {response.status_code}"
                return result
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result.done = True
                elif line.startswith("data: "):
                    result.tokens += 1
                    if started is not None:
                        started.set()
                    if keep is not None and result.tokens >= keep:
                        return result
    except httpx.HTTPError as e:
        result.error = repr(e)
    return result


def complete(base_url: str, max_tokens: int = 8) -> tuple[int, str | None]:
    response = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "temperature": 0})
    return response.status_code, response.headers.get("x-pdserve-ingress")


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def test_two_replicas_serve_at_once_and_place_on_every_engine(deployment):
    state = deployment.state()
    assert all(state["ingress"][name] for name in INGRESS), state
    # One on each node (ids: with two raylets on one host, a worker's own idea of its node's
    # IP is the host's last `ray start --node-ip-address`), both on the one port.
    assert len({state["ingress"][name]["node_id"] for name in INGRESS}) == 2, state["ingress"]
    assert len({state["ingress"][name]["port"] for name in INGRESS}) == 1
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda _: stream(deployment.base_url, 40), range(32)))
    assert all(r.done and r.tokens == 40 for r in results), [r for r in results if not r.done]
    served_by = Counter(r.ingress for r in results)
    assert set(served_by) == set(INGRESS), served_by  # the kernel spread the connections
    decodes = Counter(r.decode for r in results)
    assert set(decodes) == {"decode-0", "decode-1"}, decodes
    # Both replicas report to the controller (their books are in the shared view).
    assert sorted(deployment.state()["controller"]["reporting"]) == sorted(INGRESS)


def test_an_ingress_replica_killed_under_load(deployment):
    before = deployment.state()
    victim = "pdserve-ingress-0"
    victim_pid = before["ingress"][victim]["pid"]
    started = threading.Event()
    with ThreadPoolExecutor(40) as pool:
        # Long streams (1000 tokens, 20 s): the survivor's are read for 150 tokens, then closed.
        streams = [pool.submit(stream, deployment.base_url, 1000, 150, started) for _ in range(16)]
        assert started.wait(30)
        time.sleep(0.5)
        os.kill(victim_pid, signal.SIGKILL)
        time.sleep(0.3)
        during = [pool.submit(complete, deployment.base_url) for _ in range(12)]
        results = [s.result() for s in streams]
        answered = [d.result() for d in during]
    survivors = [r for r in results if r.ingress != victim]
    victims = [r for r in results if r.ingress == victim]
    assert survivors and victims, Counter(r.ingress for r in results)
    assert all(r.tokens == 150 and r.error is None for r in survivors), survivors
    assert all(r.error is not None and not r.done for r in victims), victims  # cut, not "done"
    assert all(status == 200 for status, _ in answered), answered
    assert {name for _, name in answered} == {"pdserve-ingress-1"}
    # The replica comes back in a new process and serves again; no engine restarted.
    after = wait_for(lambda: (s := deployment.state())["ingress"][victim]
                     and s["ingress"][victim]["pid"] != victim_pid and s, 90, "the replica's restart")
    assert after["engines"] == before["engines"]
    wait_for(lambda: victim in {complete(deployment.base_url)[1] for _ in range(12)}, 60,
             "the restarted replica to serve")
    # The streams the dead replica left on the engines were aborted when its successor
    # subscribed, long before their 1000 tokens (20 s) would have ended them.
    wait_for(lambda: sum(deployment.state()["running"].values()) == 0, 15,
             "the engines to drop the dead replica's requests")


def test_the_controller_killed_under_load(deployment):
    before = deployment.state()
    started = threading.Event()
    with ThreadPoolExecutor(40) as pool:
        streams = [pool.submit(stream, deployment.base_url, 120, None, started) for _ in range(16)]
        assert started.wait(30)
        os.kill(before["controller"]["pid"], signal.SIGKILL)
        time.sleep(0.2)
        during = [pool.submit(complete, deployment.base_url) for _ in range(16)]
        results = [s.result() for s in streams]
        answered = [d.result() for d in during]
    assert all(r.done and r.tokens == 120 for r in results), [r for r in results if not r.done]
    assert all(status == 200 for status, _ in answered), answered
    after = wait_for(lambda: (s := deployment.state())["controller"]
                     and s["controller"]["pid"] != before["controller"]["pid"]
                     and sorted(s["controller"]["reporting"]) == sorted(INGRESS) and s,
                     90, "the controller's restart")
    assert after["controller"]["incarnation"] != before["controller"]["incarnation"]
    assert after["engines"] == before["engines"]  # re-attached: the same engine processes
    assert {r["pid"] for r in after["ingress"].values()} == {
        r["pid"] for r in before["ingress"].values()}
    assert complete(deployment.base_url)[0] == 200


def test_a_decode_engine_killed_under_load_is_replaced_for_every_replica(deployment):
    """The replicas' streams on the dead engine migrate; the controller (the one supervisor)
    starts one replacement, and both replicas route to it."""
    before = deployment.state()
    victim_pid = before["engines"]["decode-0"]
    started = threading.Event()
    with ThreadPoolExecutor(40) as pool:
        streams = [pool.submit(stream, deployment.base_url, 150, None, started) for _ in range(16)]
        assert started.wait(30)
        time.sleep(0.3)
        os.kill(victim_pid, signal.SIGKILL)
        results = [s.result() for s in streams]
    assert all(r.done and r.tokens == 150 for r in results), [r for r in results if not r.done]
    assert {r.decode for r in results} >= {"decode-0"}  # some were placed on it
    after = wait_for(lambda: len((s := deployment.state())["engines"]) == 3 and s, 90,
                     "a replacement decode engine")
    new = set(after["engines"]) - set(before["engines"])
    assert len(new) == 1 and "decode-0" not in after["engines"], after["engines"]
    (replacement,) = new
    assert after["engines"]["prefill-0"] == before["engines"]["prefill-0"]

    def both_replicas_use_it() -> bool:
        with ThreadPoolExecutor(24) as pool:
            seen = list(pool.map(lambda _: stream(deployment.base_url, 30), range(24)))
        return {(r.ingress, r.decode) for r in seen} >= {(i, replacement) for i in INGRESS}

    wait_for(both_replicas_use_it, 60, "both replicas to place on the replacement")


def test_the_deployment_outlives_its_pdserve_process(deployment):
    before = deployment.state()
    server = deployment.server
    server.process.kill()  # SIGKILL: no teardown ran
    server.process.wait()
    assert complete(deployment.base_url)[0] == 200  # the replicas still serve
    deployment.start("pdserve-again.log")  # attaches: nothing restarts
    assert "pdserve ready" in deployment.server.log_tail(200)
    again = deployment.state()
    assert again["engines"] == before["engines"]
    assert again["controller"]["pid"] == before["controller"]["pid"]
    assert complete(deployment.base_url)[0] == 200
    deployment.server.stop(120)  # SIGINT: the deployment's end
    assert deployment.server.process.returncode == 0, deployment.server.log_tail()
    gone = deployment.state()
    assert gone["controller"] is None and gone["actors"] == [], gone
    with pytest.raises(httpx.ConnectError):
        complete(deployment.base_url)
