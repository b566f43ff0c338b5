"""Process trees for tests and benchmarks: find them, measure their CPU, end them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and every process under it (nothing when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_processes(processes: Iterable[psutil.Process], timeout_s: float = 10) -> None:
    """SIGKILL each (those already gone are skipped) and wait for them."""
    processes = list(processes)
    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)


def stop_tree(pid: int, grace_s: float = 15) -> None:
    """SIGTERM `pid` and everything under it; SIGKILL what is left after `grace_s`."""
    processes = process_tree(pid)
    for p in processes:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    kill_processes(alive)


def cpu_seconds(groups: Mapping[str, Iterable[int]]) -> dict[str, float]:
    """User + system CPU seconds of each named group of processes (threads included)."""
    out = {}
    for name, pids in groups.items():
        total = 0.0
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        out[name] = total
    return out
