"""A bounded spawn of W gloo processes on 127.0.0.1 for the context-parallel integration tests:
``run(W, target, *args)`` → ``{rank: result}``; a worker's exception comes back as a traceback
string, and a group that does not finish within ``limit`` seconds is killed (never a hang)."""

from __future__ import annotations

import importlib.util
import os
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, W, port, target, args, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(W))
        torch.set_num_threads(1)
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=W, timeout=timedelta(seconds=90))
        try:
            q.put((rank, target(rank, W, *args)))
        finally:
            dist.destroy_process_group()
    except Exception:
        q.put((rank, {"error": traceback.format_exc()}))


# what the ranks import: torch, attnkit, and the Llama of the transformers tests (~12 s more per fresh interpreter
# here; the server imports it once, where transformers is installed)
_PRELOAD = ["torch", "torch.distributed", "attnkit", "attnkit.distributed"]
if importlib.util.find_spec("transformers") is not None:
    _PRELOAD.append("transformers.models.llama.modeling_llama")
_started = False


def context():
    """The start method for rank processes: ``forkserver``, its server having imported torch and attnkit once,
    so a rank is a fork of a process that has them loaded (a fresh interpreter pays ~5 s of CPU importing torch
    on the 2-core CI machine, and a W = 8 group pays it 8 times); never a fork of the test process itself, whose
    OpenMP threads a fork would copy broken. The server starts with OMP_NUM_THREADS=1 (what every rank wants; a
    rank inherits the server's environment, not the test's at the time of the fork)."""
    global _started
    ctx = mp.get_context("forkserver")
    if not _started:
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(_PRELOAD)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        _started = True
    return ctx


def run(W: int, target, *args, limit: float = 240) -> dict:
    ctx = context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, W, port, target, args, q), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        while len(out) < W:
            rank, res = q.get(timeout=limit)
            out[rank] = res
    except queue.Empty:
        raise TimeoutError(f"{W} processes did not finish within {limit}s (got ranks {sorted(out)})") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out
