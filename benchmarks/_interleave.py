"""Timing shared by the benchmark scripts: peers called in turns, so the machine's load hits them alike."""

from __future__ import annotations

import platform
import time


def best_ms(fns: dict, rounds: int) -> dict:
    """The fastest of ``rounds`` calls of each of ``fns`` (name -> callable), in ms; the calls in turns (one of each
    per round), after one warm-up call of each."""
    for f in fns.values():
        f()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {n: t * 1e3 for n, t in best.items()}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), for the first line of a benchmark's output."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
