"""Timing shared by the benchmark scripts: peers called in turns, so the machine's load hits them alike."""

from __future__ import annotations

import platform
import time


def rounds_ms(fns: dict, rounds: int) -> dict:
    """Every call's time, in ms: name -> ``rounds`` times, the calls of ``fns`` (name -> callable) in turns (one of
    each per round), after one warm-up call of each."""
    for f in fns.values():
        f()
    times: dict = {n: [] for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def best_ms(fns: dict, rounds: int) -> dict:
    """The fastest of ``rounds`` calls of each of ``fns`` (name -> callable), in ms; the calls in turns (one of each
    per round), after one warm-up call of each."""
    return {n: min(t) for n, t in rounds_ms(fns, rounds).items()}


def paired_ratio(a: list, b: list) -> float:
    """The median over rounds of a[i] / b[i]: two peers timed side by side in each round, so a load that comes and
    goes over the run hits both of a pair alike (steadier than the ratio of the two minima on a shared machine)."""
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    n = len(r)
    return r[n // 2] if n % 2 else (r[n // 2 - 1] + r[n // 2]) / 2


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
