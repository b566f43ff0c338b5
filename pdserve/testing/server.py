"""Start `pdserve serve` as a real subprocess (tests, benchmarks), and stop it cleanly."""

from __future__ import annotations

import os
import signal
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    """A free port in 20000-29999: below the kernel's ephemeral range and above Ray's worker
    ports, so a Ray instance starting meanwhile (GCS, raylet, agents all bind ephemeral ports)
    cannot take it before the server binds it, which on a GPU host is a minute later."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free port in 20000-29999")


@dataclass
class RunningServer:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60) -> None:
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)  # the service releases engines and Ray on SIGINT
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(args: list[str], log_path: Path, start_timeout_s: float = 600) -> RunningServer:
    """Start `pdserve serve ARGS` on a free port and wait until /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), *args]
    return start_process(command, port, log_path, start_timeout_s)


def start_mock_server(args: list[str], workdir: Path, start_timeout_s: float = 180) -> RunningServer:
    """`pdserve serve --engine mock ARGS` over a tiny tokenizer-only model made under `workdir`
    (no weights, no download); the log goes to `workdir/pdserve.log`."""
    from pdserve.testing.tokenizer import save_tiny_model

    model_dir = save_tiny_model(Path(workdir) / "tiny-model")
    return start_server(["--engine", "mock", "--model", str(model_dir), *args],
                        Path(workdir) / "pdserve.log", start_timeout_s)


def start_process(command: list[str], port: int, log_path: Path, start_timeout_s: float,
                  env: dict[str, str] | None = None) -> RunningServer:
    """Start any OpenAI-compatible server process (pdserve, plain vLLM) and wait for /health."""
    server = spawn_process(command, port, log_path, env)
    wait_healthy(server, start_timeout_s)
    return server


def spawn_process(command: list[str], port: int, log_path: Path,
                  env: dict[str, str] | None = None) -> RunningServer:
    """Start a server process without waiting for it (several can then start side by side)."""
    log = log_path.open("w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    return RunningServer(process, port, log_path)


def wait_healthy(server: RunningServer, start_timeout_s: float) -> None:
    """Wait until the server's /health answers 200; stop it and raise if it exits or times out."""
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not become healthy in {start_timeout_s} s:\n{server.log_tail()}")


def metric_value(metrics_text: str, name: str, **labels: str) -> float | None:
    """The value of the Prometheus sample `name` whose labels include `labels`, or None."""
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        sample_name, _, label_text = series.partition("{")
        if sample_name != name:
            continue
        pairs = dict(
            item.split("=", 1) for item in label_text.rstrip("}").split(",") if "=" in item
        )
        if all(pairs.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(value)
    return None


def wait_for_metrics(base_url: str, ready, timeout_s: float = 15.0) -> str:
    """Scrape /metrics until `ready(text)` holds (engine gauges refresh about once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=5).text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.25)
