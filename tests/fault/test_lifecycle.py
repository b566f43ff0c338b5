"""A clean lifecycle for `pdserve serve` in local mode (issue 28).

A SIGKILLed server leaves no process of its Ray session (GCS, raylet, agents, engine actors,
vLLM's engine core) and no port behind, and the next server starts on its port; other servers
on the machine live on. SIGTERM drains: a stream in flight finishes within api.shutdown_grace_s,
one that does not fit is cut, and either way the process exits 0 leaving nothing behind. A
local Ray instance has logical CPUs for every engine, however few cores the machine has.

Real processes throughout: each test starts its own servers and shares nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.config.schema import PdserveConfig
from pdserve.testing import save_tiny_model
from pdserve.testing.server import RunningServer, free_port, spawn_process, start_process

# Generous liveness bounds, never speed targets: the reaper ends a killed server's session in
# a few seconds, a drained server stops a few seconds after its grace.
GONE_WITHIN_S = 30
EXIT_WITHIN_S = 60
# A serving session's processes that live as long as it does (Ray may retire idle workers).
LONG_LIVED = ("pdserve serve", "pdserve.lifecycle", "gcs_server", "raylet", "DashboardAgent",
              "RuntimeEnvAgent", "EngineActor")


@dataclass
class Session:
    """A server's local Ray session as it ran: its process tree and the Ray session directory."""

    processes: list[psutil.Process]
    names: list[str]  # their command lines, as they were
    directory: str

    @classmethod
    def of(cls, server: RunningServer) -> Session:
        root = psutil.Process(server.process.pid)
        processes = [root, *root.children(recursive=True)]
        names = [_cmdline(p) for p in processes]
        # The GCS, raylet and Ray's Python daemons name it on their command lines.
        directory = next(m.group(1) for line in names
                         if (m := re.search(r"(/[^\s=]*/session_[\d_-]+)", line)))
        return cls(processes, names, directory)

    def running(self) -> list[psutil.Process]:
        """Its processes still running: those of the tree, and any other that references the
        session directory (command line, open files)."""
        found = {p.pid: p for p in self.processes if _running(p)}
        for p in psutil.process_iter():
            if p.pid not in found and p.pid != os.getpid() and self._references(p):
                found[p.pid] = p
        return list(found.values())

    def _references(self, process: psutil.Process) -> bool:
        try:
            return (re.search(re.escape(self.directory) + r"(/|\s|$)", _cmdline(process))
                    or any(f.path.startswith(self.directory + "/") for f in process.open_files()))
        except psutil.Error:
            return False

    def wait_gone(self) -> None:
        """Every process of the session ends, and with them every port they listened on (a
        socket outlives its process only in a child, which references the session too). The
        freed ports themselves are not checked: other Ray instances on this machine may take
        one at once."""
        deadline = time.monotonic() + GONE_WITHIN_S
        while (left := self.running()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [_describe(p) for p in left], "processes of the session outlived the server"

    def kill_leftovers(self) -> None:
        """Cleanup after a failed test: the next test must not inherit this one's processes."""
        for p in self.running():
            try:
                p.kill()
            except psutil.Error:
                pass


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _describe(process: psutil.Process) -> str:
    return f"{process.pid} {_cmdline(process)[:100]}"


def serve(args: list[str], port: int, log: Path, start_timeout_s: float = 180) -> RunningServer:
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), *args]
    return start_process(command, port, log, start_timeout_s)


def mock_args(model: Path, *extra: str) -> list[str]:
    return ["--engine", "mock", "--model", str(model), "--served-model-name", "tiny", *extra]


def complete(server: RunningServer, model: str = "tiny") -> dict:
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                   json={"model": model, "prompt": "hello world", "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def sigkill_and_check(server: RunningServer) -> Session:
    session = Session.of(server)
    server.process.kill()
    server.process.wait()
    session.wait_gone()
    return session


@pytest.mark.integration
def test_sigkilled_server_leaves_no_ray_process_nor_port_and_its_port_serves_again(tmp_path):
    model = save_tiny_model(tmp_path / "tiny-model")
    disaggregated = ["--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                     "--set", "pools.prefill.num_cpus=0.5", "--set", "pools.decode.num_cpus=0.5"]
    bystander = serve(mock_args(model, *disaggregated), free_port(), tmp_path / "bystander.log")
    sessions = [Session.of(bystander)]
    port = free_port()
    try:
        first = serve(mock_args(model, *disaggregated), port, tmp_path / "first.log")
        sessions.append(Session.of(first))
        complete(first)
        assert sum("EngineActor" in n for n in sessions[-1].names) == 2, sessions[-1].names
        sigkill_and_check(first)
        assert port_is_free(port)

        again = serve(mock_args(model, *disaggregated), port, tmp_path / "again.log")
        sessions.append(Session.of(again))
        assert complete(again)["choices"][0]["finish_reason"] == "length"
        again.stop()
        # Another server's session is not this one's: the reaper left it alone.
        bystanding = sessions[0]
        assert all(_running(p) for p, line in zip(bystanding.processes, bystanding.names)
                   if any(name in line for name in LONG_LIVED))
        complete(bystander)
    finally:
        bystander.stop()
        for session in sessions:
            session.kill_leftovers()


@pytest.mark.integration
def test_sigkilled_server_with_ingress_replicas_leaves_nothing_behind(tmp_path):
    """Local mode with two ingress replicas (a controller and detached actors on pdserve's own
    Ray instance): one command still owns everything, its death takes everything."""
    model = save_tiny_model(tmp_path / "tiny-model")
    server = serve(mock_args(model, "--mode", "disaggregated", "--prefill", "1", "--decode", "1",
                             "--ingress-replicas", "2"), free_port(), tmp_path / "pdserve.log")
    session = Session.of(server)
    try:
        complete(server)
        names = [_cmdline(p) for p in session.running()]
        assert sum(n.startswith("ray::Ingress") for n in names) == 2, names
        assert sum(n.startswith("ray::Controller") for n in names) == 1, names
        sigkill_and_check(server)
        assert port_is_free(server.port)
    finally:
        server.stop()
        session.kill_leftovers()


@pytest.mark.integration
def test_sigkilled_vllm_server_leaves_no_engine_core_behind(tmp_path):
    """The real CPU engine: its vLLM engine core is a subprocess of the engine actor."""
    server = serve(["--model", "embedded", "--mode", "colocated", "--replicas", "1"],
                   free_port(), tmp_path / "pdserve.log", start_timeout_s=600)
    session = Session.of(server)
    try:
        complete(server, model="SmolLM2-135M-Instruct")
        # Now with every process the engine started (a process whose command line could not
        # be read at one look, as once on a loaded CI machine, is looked at again).
        deadline = time.monotonic() + 20
        session = Session.of(server)
        while not any("EngineCore" in n for n in session.names) and time.monotonic() < deadline:
            time.sleep(1)
            session = Session.of(server)
        assert any("EngineCore" in n for n in session.names), session.names
        sigkill_and_check(server)
    finally:
        server.stop()
        session.kill_leftovers()


def _data(line: str) -> dict | None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: "):])


def _stream_across_sigterm(server: RunningServer, max_tokens: int) -> tuple[list[dict], bool]:
    """Stream a completion, SIGTERM the server once its first chunk arrived, read on: the
    chunks, and whether the stream ended properly ([DONE])."""
    chunks, done = [], False
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": max_tokens,
                            "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        chunks.append(next(chunk for line in lines if (chunk := _data(line)) is not None))
        assert chunks[0]["choices"][0]["finish_reason"] is None  # in flight
        server.process.send_signal(signal.SIGTERM)
        _wait_refusing(server)
        try:
            for line in lines:
                done = done or line == "data: [DONE]"
                if (chunk := _data(line)) is not None:
                    chunks.append(chunk)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server cut the stream
    return chunks, done


def _wait_refusing(server: RunningServer) -> None:
    """A draining server serves no new connection: refused, or (one it accepted just before it
    stopped listening) closed unanswered."""
    deadline = time.monotonic() + EXIT_WITHIN_S
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{server.base_url}/v1/models", timeout=5)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            return
        time.sleep(0.1)
    raise AssertionError("the draining server still serves new connections")


def _sigterm_during_a_stream(tmp_path, max_tokens: int, *extra: str) -> tuple[list[dict], bool]:
    """A mock server (50 ms a token) gets SIGTERM while streaming `max_tokens`: its chunks and
    whether the stream ended, once the process exited 0 and left nothing behind."""
    model = save_tiny_model(tmp_path / "tiny-model")
    server = serve(mock_args(model, "--mode", "colocated", "--set", "engine.mock.decode_step_s=0.05",
                             *extra),
                   free_port(), tmp_path / "pdserve.log")
    session = Session.of(server)
    try:
        chunks, done = _stream_across_sigterm(server, max_tokens=max_tokens)
        assert server.process.wait(EXIT_WITHIN_S) == 0, server.log_tail()
        session.wait_gone()
        assert port_is_free(server.port)
        return chunks, done
    finally:
        server.stop()
        session.kill_leftovers()


@pytest.mark.integration
def test_sigterm_lets_a_stream_that_fits_the_grace_finish_and_exits_0(tmp_path):
    # 160 tokens at 50 ms: an 8 s stream, well within the default 30 s grace.
    chunks, done = _sigterm_during_a_stream(tmp_path, 160)
    assert done and len(chunks) == 160, len(chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.integration
def test_sigterm_cuts_a_stream_past_the_grace_and_still_exits_0(tmp_path):
    # 1000 tokens at 50 ms: a 50 s stream against a 1 s grace.
    chunks, done = _sigterm_during_a_stream(tmp_path, 1000, "--set", "api.shutdown_grace_s=1")
    assert not done and len(chunks) < 1000, len(chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


@pytest.mark.integration
def test_sigterm_drains_every_ingress_replica_and_exits_0(tmp_path):
    # Two replicas share the port; the stream's replica drains it within the grace (8 s of
    # 30), then the deployment stops and nothing of it is left.
    chunks, done = _sigterm_during_a_stream(tmp_path, 160, "--ingress-replicas", "2")
    assert done and len(chunks) == 160, len(chunks)


@pytest.mark.integration
def test_sigterm_during_the_start_stops_what_started_and_exits_0(tmp_path):
    """A deployment signalled while it starts (an orchestrator gives up on it) stops once its
    start ends, never says ready, exits 0 and leaves nothing behind; before, Ray's own SIGTERM
    handler aborted the process (-6) and the lifecycle guard reaped the rest."""
    model = save_tiny_model(tmp_path / "tiny-model")
    port = free_port()
    server = spawn_process([sys.executable, "-m", "pdserve", "serve", "--port", str(port),
                            *mock_args(model, "--mode", "colocated", "--ingress-replicas", "2")],
                           port, tmp_path / "pdserve.log")
    session = None
    try:
        deadline = time.monotonic() + 180
        while "ingress replicas go to the nodes" not in server.log_path.read_text():
            assert server.process.poll() is None and time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
        session = Session.of(server)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(EXIT_WITHIN_S) == 0, server.log_tail()
        assert "pdserve ready" not in server.log_path.read_text()
        session.wait_gone()
        assert port_is_free(port)
    finally:
        server.stop()
        if session is not None:
            session.kill_leftovers()


@pytest.mark.integration
def test_local_ray_has_cpus_for_more_engines_than_cores(tmp_path):
    """`--prefill 1 --decode 2` asks Ray for 1.5x the machine's cores (on 2 cores: the default
    1 CPU per engine); before, the third engine waited for a CPU forever."""
    model = save_tiny_model(tmp_path / "tiny-model")
    per_engine = (os.cpu_count() or 1) / 2
    server = serve(mock_args(model, "--mode", "disaggregated", "--prefill", "1", "--decode", "2",
                             "--set", f"pools.prefill.num_cpus={per_engine}",
                             "--set", f"pools.decode.num_cpus={per_engine}"),
                   free_port(), tmp_path / "pdserve.log", start_timeout_s=120)
    session = Session.of(server)
    try:
        assert complete(server)["choices"][0]["finish_reason"] == "length"
        assert "logical CPUs" in server.log_path.read_text()  # the one line that says so
    finally:
        server.stop()
        session.kill_leftovers()


@pytest.mark.unit
def test_local_ray_cpus_cover_the_autoscalers_most_engines():
    from pdserve.service import local_ray_cpus

    cores = os.cpu_count() or 1
    config = PdserveConfig.model_validate({
        "mode": "colocated", "slo": {"ttft_ms": 500, "tpot_ms": 50},
        "pools": {"colocated": {"replicas": 2, "num_cpus": cores}},
        "autoscale": {"enabled": True, "colocated": {"min_replicas": 1, "max_replicas": 6}}})
    assert local_ray_cpus(config) == 6 * cores
    idle = PdserveConfig.model_validate({"pools": {"prefill": {"num_cpus": 0.1},
                                                   "decode": {"num_cpus": 0.1}}})
    assert local_ray_cpus(idle) == cores
