"""A `pdserve serve` subprocess the tuner owns: start it, wait for /health, stop it leaving nothing behind.

Lifecycle: `ServeProcess.start` launches `python -m pdserve serve --port P ...` in a new session (its own
process group, so a terminal's Ctrl-C reaches the tuner, which then stops the service in order) and polls
/health. `stop` first asks nicely (SIGINT: the service releases its engines and its local Ray itself),
then SIGTERM and SIGKILL to the whole process group, then SIGKILL to any descendant seen while it ran
that is still alive: Ray's raylet and workers may sit in other process groups, and a leaked engine holds
~4 GB on a CPU host or a whole GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from pdserve.errors import PdserveError


class ServiceStartError(PdserveError):
    """The service exited or did not become healthy in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class ServeProcess:
    """A running service; `descendants` accumulates every child process seen (for the final sweep)."""

    process: subprocess.Popen
    port: int
    log_path: Path
    descendants: dict[int, float] = field(default_factory=dict)  # pid -> create time (pids get reused)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    async def start(
        cls, serve_args: Sequence[str], log_path: Path, timeout_s: float = 900.0
    ) -> ServeProcess:
        """Start `pdserve serve SERVE_ARGS` on a free port; return once /health answers 200."""
        port = free_port()
        service = cls(_launch([*serve_args, "--port", str(port)], log_path), port, log_path)
        try:
            await service._wait_healthy(timeout_s)
        except BaseException:
            service.stop()
            raise
        return service

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                self._note_descendants()
                if self.process.poll() is not None:
                    raise ServiceStartError(
                        f"pdserve serve exited with {self.process.returncode}:\n{_log_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.base_url}/health")).status_code == 200:
                        return
                await asyncio.sleep(1.0)
        raise ServiceStartError(
            f"pdserve serve was not healthy after {timeout_s:.0f} s:\n{_log_tail(self.log_path)}"
        )

    def _note_descendants(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.descendants[child.pid] = child.create_time()

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGINT and wait; then the process group; then any leftover descendant. Never raises."""
        self._note_descendants()
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)
            _wait_gone(lambda: not self._group_alive(), 10.0)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._kill_leftovers()

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _kill_leftovers(self) -> None:
        leftovers = self._alive_descendants()
        for process in leftovers:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(leftovers, timeout=10)

    def _alive_descendants(self) -> list[psutil.Process]:
        alive = []
        for pid, created in self.descendants.items():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                # Same pid and start time: still our process, not a reused pid.
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
        return alive

    def alive_descendants(self) -> list[int]:
        """Descendants seen while running that still exist (and are not zombies): empty after `stop`."""
        return [process.pid for process in self._alive_descendants()]


def _launch(serve_args: Sequence[str], log_path: Path) -> subprocess.Popen:
    """`pdserve serve` in a new session, its output (after the command line) in `log_path`."""
    command = [sys.executable, "-m", "pdserve", "serve", *serve_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        return subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )


def _wait_gone(gone, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.2)
