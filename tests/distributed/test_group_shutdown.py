"""destroy_process_group really ends a group that attnkit.distributed was imported beside.

torch.distributed.nn.functional reads ``group.WORLD`` into its functions' default arguments when it is imported;
torch.optim imports it (through torch._dynamo) when the first optimizer is built, so in a script that builds its
optimizer after init_process_group, as every training script does, the group outlived destroy_process_group
(gloo's threads and sockets alive until interpreter exit, where a rank of the context-parallel example was seen to
abort). ``import attnkit.distributed`` before init_process_group imports that module first (defaults None); after
it, the import is skipped (it would hold the group itself). Each case runs in a fresh interpreter (what is imported
is the point), one gloo rank on 127.0.0.1."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import gc, os, socket, sys
    import torch, torch.distributed as dist
    early = sys.argv[1] == "before"
    if early:
        import attnkit.distributed  # noqa: F401
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not early:
        import attnkit.distributed  # noqa: F401
    else:
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.Adam([p], lr=0.1)  # imports torch.distributed.nn.functional, through torch._dynamo
        p.grad = torch.ones(3)
        dist.all_reduce(p.grad)
        opt.step()
    def names():  # this process's threads by name (Linux); None where /proc does not list them
        if not os.path.isdir("/proc/self/task"):
            return None
        return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    def held():  # torch.distributed.nn.functional's functions that hold a group in their default arguments
        nnf = sys.modules.get("torch.distributed.nn.functional")
        return sorted(n for n, f in (vars(nnf).items() if nnf else ()) if callable(f) and any(
            isinstance(d, dist.ProcessGroup) for d in (getattr(f, "__defaults__", None) or ())))
    print("nn.functional imported:", "torch.distributed.nn.functional" in sys.modules)
    print("threads with the group:", names())
    print("defaults holding the group:", held())
    dist.destroy_process_group()
    gc.collect()
    print("threads after destroy_process_group:", names())
""")


def _run(when: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _SCRIPT, when], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _printed(out: str, label: str):
    line = next(x for x in out.splitlines() if x.startswith(label))
    return ast.literal_eval(line[len(label):])  # a list of names the script printed (None: not listed here)


def _gloo(names):
    return [n for n in names if n.startswith(("pt_gloo", "gloo_tcp"))]


@pytest.mark.parametrize("when", ["before", "after"])
def test_destroy_process_group_ends_the_groups_threads(when):
    out = _run(when)
    # before: imported by attnkit (so the defaults below are read); after: attnkit left it alone (no optimizer here)
    assert f"nn.functional imported: {when == 'before'}" in out, out
    # the cause, on every platform: no function of torch.distributed.nn.functional holds the group by a default
    assert _printed(out, "defaults holding the group:") == [], out
    # the effect, where the process's threads can be listed (Linux's /proc): gloo's threads end with the group
    alive, after = _printed(out, "threads with the group:"), _printed(out, "threads after destroy_process_group:")
    if alive is not None:
        assert _gloo(alive), out  # listed while the group lives: the check below can fail
        assert _gloo(after) == [], f"gloo threads alive after destroy_process_group ({when} import): {after}\n{out}"
