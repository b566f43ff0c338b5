"""The reaper: no process of a local Ray session outlives the `pdserve serve` that owns it.

Why: Ray ties its GCS and raylet to the driver (the kernel kills them when it dies), but the
raylet's agents (dashboard agent, runtime env agent) outlived a SIGKILLed `pdserve serve` for
good, and workers and the engines' vLLM subprocesses linger until they notice, holding ports and
memory. Only local mode has this reaper: there pdserve owns the Ray instance; a cluster's
engines outlive the frontend on purpose.

Lifecycle: `Reaper.start()` (the server, before Ray starts) spawns `python -m pdserve.lifecycle
SERVER_PID` in a session of its own (a Ctrl-C, or a kill of the server's process group, does not
reach it; it ignores SIGINT and SIGTERM, so only the end of its pipe ends it) with a pipe as its
stdin whose only write end the server holds. `Reaper.watch(session_dir)` sends the Ray session
directory once Ray is up. While the pipe is open, the reaper records the server's descendants
every second. At EOF -- `Reaper.close()` after a normal shutdown, or the kernel closing the pipe
because the server died, however it died -- it ends every process of the session
(`session_processes`): SIGTERM, SIGKILL after a short grace, again until none is left; then it
exits. A process counts as the session's only by identity, never by name: a descendant of the
server (pid and start time), a process Ray started for the session directory (its command line
names it, or its stdout or stderr is one of its log files), or a descendant of either. Other
pdserve instances and other users' Ray have other session directories.

Linux only (it reads /proc); elsewhere there is no reaper.
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

# Named, not __name__: the reaper runs as __main__.
logger = logging.getLogger("pdserve.lifecycle")

# How often the reaper records the server's descendants. A process younger than this at the
# server's death is still found through the session directory or its parent.
_RECORD_INTERVAL_S = 1.0
# SIGTERM -> SIGKILL. Ray's processes and vLLM's engine core exit well within this on SIGTERM;
# it is short because a killed server's port and memory should be free within seconds.
_TERM_GRACE_S = 2.0
# Sweeps at EOF: a process may start a child between a sweep's scan and its signals (an
# actor starting vLLM's engine core); the next sweep finds it. One sweep is the usual case.
_SWEEPS = 5
# How long a normally stopping server waits for the reaper's last sweep (it finds nothing then).
_CLOSE_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Proc:
    """A process by identity: a pid the kernel reuses gets another start time."""

    pid: int
    started: int  # clock ticks after boot (/proc/PID/stat field 22)


# --- the server's end -------------------------------------------------------------------------

class Reaper:
    """The server's handle on its reaper process: `start` before Ray, `watch` the session once
    Ray is up, `close` after Ray is shut down."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._process = process

    @classmethod
    def start(cls) -> Reaper | None:
        if not sys.platform.startswith("linux"):
            logger.warning("no reaper on %s: a killed server may leave Ray processes behind",
                           sys.platform)
            return None
        process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.lifecycle", str(os.getpid())],
            stdin=subprocess.PIPE, start_new_session=True)
        return cls(process)

    def watch(self, session_dir: str) -> None:
        """Name the Ray session whose processes die with the server."""
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(f"{session_dir}\n".encode())
            self._process.stdin.flush()
        except OSError as e:
            logger.warning("the reaper is gone (%r): a killed server may leave Ray processes "
                           "behind", e)

    def close(self) -> None:
        """End the reaper after a normal shutdown: it sweeps what Ray left, then exits."""
        assert self._process.stdin is not None
        try:
            self._process.stdin.close()
        except OSError:
            pass  # it is gone already
        try:
            self._process.wait(_CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the reaper is still ending Ray processes; it exits when done")


# --- /proc ------------------------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields follow its last ')'.
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[1]), int(fields[19])


def identify(pid: int) -> Proc | None:
    stat = _stat(pid)
    return Proc(pid, stat[2]) if stat is not None and stat[0] != "Z" else None


def alive(proc: Proc) -> bool:
    """Still running (a zombie is dead, only not yet collected by its parent)."""
    return identify(proc.pid) == proc


def process_table() -> dict[Proc, int]:
    """Every running process this user may see -> its parent's pid."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z":
                table[Proc(int(entry), stat[2])] = stat[1]
    return table


def descendants(roots: Iterable[int], table: dict[Proc, int]) -> set[Proc]:
    children: dict[int, list[Proc]] = defaultdict(list)
    for proc, parent in table.items():
        children[parent].append(proc)
    found: set[Proc] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child.pid)
    return found


def started_for(pid: int, session_dir: str) -> bool:
    """Whether Ray started this process for `session_dir`: its command line names the
    directory, or its stdout or stderr is one of the session's files. Ray starts every process
    so, also those whose command line it rewrites (agents, workers: 'ray::DashboardAgent'), and
    vLLM's engine core inherits its worker's. (A `tail -f` of a session log holds the file on
    another descriptor: not the session's.)"""
    names = re.compile(re.escape(session_dir.rstrip("/")) + r"(?:/|\x00|$)")
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if names.search(f.read().decode(errors="replace")):
                return True
    except OSError:
        return False
    for fd in (1, 2):
        try:
            if names.match(os.readlink(f"/proc/{pid}/fd/{fd}")):
                return True
        except OSError:
            pass
    return False


def session_processes(server: Proc | None, recorded: set[Proc],
                      session_dirs: list[str]) -> set[Proc]:
    """The processes of the server's Ray session running now (never the server itself nor
    this process)."""
    table = process_table()
    found = {proc for proc in recorded if proc in table}
    found |= {proc for proc in table if any(started_for(proc.pid, d) for d in session_dirs)}
    roots = {proc.pid for proc in found}
    if server is not None and server in table:
        roots.add(server.pid)
    found |= descendants(roots, table)
    return {proc for proc in found if proc.pid != os.getpid() and proc != server}


# --- the reaper process -----------------------------------------------------------------------

def _signal(procs: Iterable[Proc], sig: signal.Signals) -> None:
    for proc in procs:
        if alive(proc):  # not a pid the kernel gave to someone else meanwhile
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_gone(procs: set[Proc], timeout_s: float) -> set[Proc]:
    deadline = time.monotonic() + timeout_s
    left = {proc for proc in procs if alive(proc)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {proc for proc in left if alive(proc)}
    return left


def _name(proc: Proc) -> str:
    """'ray::DashboardAgent[1234]': the program as its command line shows it (Ray's titles)."""
    try:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            program = f.read().split(b"\x00")[0].split(b" ")[0].decode(errors="replace")
    except OSError:
        program = ""
    return f"{os.path.basename(program)}[{proc.pid}]"


def reap(server: Proc | None, recorded: set[Proc], session_dirs: list[str]) -> None:
    """End every process of the session: SIGTERM, then SIGKILL past the grace; sweep again
    until a scan finds none."""
    why = "left after the server stopped" if server is not None and alive(server) else \
        "of a server that died"
    for _ in range(_SWEEPS):
        victims = session_processes(server, recorded, session_dirs)
        if not victims:
            return
        logger.warning("ending %d Ray session process(es) %s: %s", len(victims), why,
                       ", ".join(sorted(_name(p) for p in victims)))
        _signal(victims, signal.SIGTERM)
        stubborn = _wait_gone(victims, _TERM_GRACE_S)
        _signal(stubborn, signal.SIGKILL)
        _wait_gone(stubborn, _TERM_GRACE_S)
    logger.error("processes of the session still start after %d sweeps", _SWEEPS)


def watch_server(server_pid: int) -> None:
    """Record the server's descendants and read session directories from stdin until EOF,
    then reap."""
    server = identify(server_pid) if os.getppid() == server_pid else None
    recorded: set[Proc] = set()
    session_dirs: list[str] = []
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], _RECORD_INTERVAL_S)
        if readable:
            chunk = os.read(0, 4096)
            if not chunk:
                break  # the server is gone, or stopped normally
            *lines, pending = (pending + chunk).split(b"\n")
            session_dirs.extend(line.decode() for line in lines if line)
        if server is not None:
            table = process_table()
            recorded = {p for p in recorded if p in table} | descendants([server.pid], table)
    reap(server, recorded, session_dirs)


def main(argv: list[str]) -> int:
    # Only the end of the pipe ends the reaper: a signal meant for the server (Ctrl-C, a
    # `pkill -f pdserve`) must not take away what cleans up after it. SIGKILL still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_server(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
