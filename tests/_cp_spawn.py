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


# the server's environment, which every process it forks inherits (not the test's at the time of the fork): one
# OpenMP thread (what every rank and page runs with under `make test`), and transformers / the hub offline and
# matplotlib without a display, read when those modules are imported (transformers here, by the server)
_SERVER_ENV = dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg")


def context():
    """The start method for the tests' worker processes: ``forkserver``, its server having imported torch,
    attnkit and transformers' Llama once, so a worker is a fork of a process that has them loaded (a fresh
    interpreter pays ~5 s of CPU importing torch on the 2-core CI machine and ~12 s more for transformers, and
    a W = 8 group pays it 8 times); never a fork of the test process itself, whose OpenMP threads a fork would
    copy broken. The server starts with :data:`_SERVER_ENV` set."""
    global _started
    ctx = mp.get_context("forkserver")
    if not _started:
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(_PRELOAD)
        old = {k: os.environ.get(k) for k in _SERVER_ENV}
        os.environ.update(_SERVER_ENV)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _started = True
    return ctx


def _in_dir(cwd, env, stdout, stderr, code, argv):  # a worker of run_script
    import sys

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = list(argv)
    sys.path.insert(0, str(cwd))
    status = 0
    try:
        exec(compile(code, argv[0], "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def run_script(script, argv, cwd, env, timeout: float):
    """``python SCRIPT ARGV...`` in ``cwd`` with the environment ``env``, as a fork of the server (see
    :func:`context`): (exit status, stdout, stderr). Past ``timeout`` seconds it is killed (status None)."""
    import pathlib

    cwd = pathlib.Path(cwd)
    out, err = cwd / ".stdout", cwd / ".stderr"
    code = pathlib.Path(script).read_text(encoding="utf-8")
    p = context().Process(target=_in_dir, args=(str(cwd), dict(env), str(out), str(err), code,
                                                [str(script), *map(str, argv)]))
    p.start()  # not a daemon: a page may start processes of its own (torch.compile's workers)
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(10)
        status = None
    else:
        status = p.exitcode
    read = lambda f: f.read_text(encoding="utf-8", errors="replace") if f.exists() else ""  # noqa: E731
    return status, read(out), read(err)


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


def error_of(fn) -> str:
    """``fn()``'s exception as ``"Type: message"`` ("" when it returns): what a rank sends back to the test, where
    every rank must raise."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""
