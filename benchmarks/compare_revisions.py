"""Speed of two attnkit source trees, measured in one sitting, interleaved: "did this change regress?".

    python benchmarks/compare_revisions.py --before /path/to/old/src --after src [--quick]

One long-lived worker process per tree (each imports its own ``attnkit``); for each
case the two workers are asked in turn, ``--rounds`` times, and each answer is the
median of ``--repeats`` timed calls after a warm-up. The table reports both medians
and their ratio (before / after: > 1 means the change is faster). Only ratios from one
run mean anything on a shared machine; absolute times swing between runs.

FLOPs (for the GFLOP/s column): forward 4·B·H·L·S·D × density (causal ×½ etc. via the
plan's fraction of computed tiles is not used here: dense count), backward ×2.5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# (name, B, H, Hkv, L, S, D, kwargs as source, mode)
CASES = [
    ("window-256 L=4096 fwd", 1, 8, 8, 4096, 4096, 64, "mask=masks.sliding_window(256)", "fwd"),
    ("window-256 L=4096 fwd+bwd", 1, 8, 8, 4096, 4096, 64, "mask=masks.sliding_window(256)", "fwdbwd"),
    ("window-256 L=4096 bf16 fwd", 1, 8, 8, 4096, 4096, 64, "mask=masks.sliding_window(256)", "fwd"),
    ("causal L=2048 fwd (auto)", 1, 8, 8, 2048, 2048, 64, "causal=True", "fwd"),
    ("causal L=2048 fwd (tiled)", 1, 8, 8, 2048, 2048, 64, "causal=True, backend='tiled'", "fwd"),
    ("causal L=2048 fwd+bwd (tiled)", 1, 8, 8, 2048, 2048, 64, "causal=True, backend='tiled'", "fwdbwd"),
    ("document 4 docs L=4096 fwd", 1, 8, 8, 4096, 4096, 64, "mask=masks.document(torch.arange(4096) // 1024)", "fwd"),
    ("alibi causal L=2048 fwd", 1, 8, 8, 2048, 2048, 64,
     "causal=True, score_mod=score_mods.alibi(torch.linspace(0.5, 0.01, 8))", "fwd"),
    ("softcap window L=2048 fwd+bwd", 1, 8, 8, 2048, 2048, 64,
     "mask=masks.sliding_window(256), score_mod=score_mods.softcap(30.0)", "fwdbwd"),
    ("from_mod band L=2048 fwd (same fn each call)", 1, 8, 8, 2048, 2048, 64, "mask=BAND", "fwd"),
    # a mask the kernel reads as a tile map (sinks and a window: two stretches a row), its partial tiles' bits
    ("tile map: sinks + window 256 as a mask_mod L=2048 fwd", 1, 8, 8, 2048, 2048, 64, "mask=SINKS", "fwd"),
    ("tile map: sinks + window 256 as a mask_mod L=2048 fwd+bwd", 1, 8, 8, 2048, 2048, 64, "mask=SINKS", "fwdbwd"),
    ("BlockMask of one head, causal mod, L=2048 fwd", 1, 8, 8, 2048, 2048, 64, "mask=BM_CAUSAL", "fwd"),
    ("decode L=1 S=2048 GQA causal", 1, 8, 2, 1, 2048, 64, "causal=True", "fwd"),
    ("decode L=1 S=128 GQA causal", 1, 8, 2, 1, 128, 64, "causal=True", "fwd"),
    ("decode L=1 S=128 GQA causal bf16", 1, 8, 2, 1, 128, 64, "causal=True", "fwd"),
    ("decode L=1 S=2048 GQA causal bf16", 1, 8, 2, 1, 2048, 64, "causal=True", "fwd"),
    ("prefill L=S=64 causal", 2, 4, 4, 64, 64, 16, "causal=True", "fwd"),
    ("prefill L=S=64 causal bf16", 2, 4, 4, 64, 64, 16, "causal=True", "fwd"),
    ("prefill L=S=200 GQA causal", 1, 4, 2, 200, 200, 64, "causal=True", "fwd"),
    # bf16 at a head dimension that is not a multiple of 32 (AMX: the scores' depth zero-padded)
    ("causal L=2048 D=80 bf16 fwd", 1, 8, 8, 2048, 2048, 80, "causal=True", "fwd"),
    ("causal L=2048 D=80 bf16 fwd+bwd", 1, 8, 8, 2048, 2048, 80, "causal=True", "fwdbwd"),
    # a decode step whose rows see different keys (the decode entry's tiles where a row does not see every key)
    ("rows differ: decode L=4 S=2048 GQA causal fwd", 1, 8, 2, 4, 2048, 64, "causal=True", "fwd"),
    ("rows differ: decode L=16 S=2048 GQA window 512 fwd", 1, 8, 2, 16, 2048, 64, "mask=masks.sliding_window(512)",
     "fwd"),
    ("rows differ: decode L=16 S=2048 GQA window 512 as a mask_mod fwd", 1, 8, 2, 16, 2048, 64,
     "mask=lambda b, h, i, j: (j <= i + 2032) & (j > i + 2032 - 512)", "fwd"),
    ("rows differ: decode L=4 S=2048 GQA causal + a soft cap as a score_mod fwd", 1, 8, 2, 4, 2048, 64,
     "causal=True, score_mod=lambda s, b, h, i, j: 30.0 * torch.tanh(s / 30.0)", "fwd"),
    # a few query rows with gradients over a long cache (fp32): the compiled kernel's few-rows backward from 2048 keys
    ("rows: L=1 S=1024 GQA causal fwd+bwd", 1, 8, 2, 1, 1024, 64, "causal=True", "fwdbwd"),
    ("rows: L=1 S=2048 GQA causal fwd+bwd", 1, 8, 2, 1, 2048, 64, "causal=True", "fwdbwd"),
    ("rows: L=4 S=2048 GQA causal fwd+bwd", 1, 8, 2, 4, 2048, 64, "causal=True", "fwdbwd"),
    ("rows: L=1 S=2048 MHA causal fwd+bwd", 1, 8, 8, 1, 2048, 64, "causal=True", "fwdbwd"),
    ("rows: L=1 S=4096 GQA causal fwd+bwd", 1, 8, 2, 1, 4096, 64, "causal=True", "fwdbwd"),
    ("rows: L=1 S=16384 GQA causal fwd+bwd", 1, 8, 2, 1, 16384, 64, "causal=True", "fwdbwd"),
    ("rows: L=4 S=4096 GQA causal fwd+bwd", 1, 8, 2, 4, 4096, 64, "causal=True", "fwdbwd"),
    ("rows: L=16 S=8192 MHA causal fwd+bwd", 1, 8, 8, 16, 8192, 64, "causal=True", "fwdbwd"),
    ("rows: L=1 S=8192 MHA mask_mod causal fwd+bwd", 1, 8, 8, 1, 8192, 64, "mask=lambda b, h, i, j: j <= i + 8191",
     "fwdbwd"),
    ("rows: L=1 S=8192 GQA window 256 fwd+bwd", 1, 8, 2, 1, 8192, 64, "mask=masks.sliding_window(256)", "fwdbwd"),
    # a user's bool tensor mask (the kernel reads its tiles off its values; before: torch's flash kernel per run of
    # keys, SDPA at one tile); "bf16" in a name: bf16 inputs
    ("bool tensor: 4 documents L=2048 fwd", 1, 8, 8, 2048, 2048, 64, "mask=DOCS_T", "fwd"),
    ("bool tensor: 4 documents L=2048 fwd+bwd", 1, 8, 8, 2048, 2048, 64, "mask=DOCS_T", "fwdbwd"),
    ("bool tensor: band 128 L=2048 fwd", 1, 8, 8, 2048, 2048, 64, "mask=BAND_T", "fwd"),
    ("bool tensor: band 128 L=2048 fwd+bwd", 1, 8, 8, 2048, 2048, 64, "mask=BAND_T", "fwdbwd"),
    ("bool tensor: 4 documents L=2048 bf16 fwd+bwd", 1, 8, 8, 2048, 2048, 64, "mask=DOCS_T", "fwdbwd"),
    ("bool tensor: random 70% L=S=64 bf16 fwd+bwd", 1, 8, 8, 64, 64, 64, "mask=RAND64", "fwdbwd"),
    ("bool tensor: padding L=1 S=512 GQA bf16 fwd+bwd", 1, 8, 2, 1, 512, 64, "mask=PAD512", "fwdbwd"),
    # without gradients: a bool mask of one tile (SDPA before; the kernel, its bits read in C per call), and masks the
    # kernel runs as a tile map (rows of two stretches: its call replayed, each call's mask read in C)
    ("bool tensor: random 70% L=S=64 fwd", 1, 8, 8, 64, 64, 64, "mask=RAND64", "fwd"),
    ("bool tensor: random 70% L=S=64 bf16 fwd", 1, 8, 8, 64, 64, 64, "mask=RAND64", "fwd"),
    ("bool tensor: sinks + window 256 L=2048 fwd", 1, 8, 8, 2048, 2048, 64, "mask=SINKS_T", "fwd"),
    ("bool tensor: sinks + window 64 L=S=256 fwd", 1, 8, 8, 256, 256, 64, "mask=SINKS256", "fwd"),
    # the same masks written as a user's mask_mod (reading the tensor: keyed by its content), and with a score_mod
    ("mask_mod reading random 70% L=S=64 fwd", 1, 8, 8, 64, 64, 64, "mask=RAND64_MOD", "fwd"),
    ("mask_mod reading sinks + window 64 L=S=256 fwd", 1, 8, 8, 256, 256, 64, "mask=SINKS256_MOD", "fwd"),
    ("bool tensor: sinks + window 64 L=S=256 + soft cap fwd", 1, 8, 8, 256, 256, 64,
     "mask=SINKS256, score_mod=score_mods.softcap(30.0)", "fwd"),
]

WORKER = r'''
import json, sys, time, statistics, torch
torch.set_num_threads(int(sys.argv[1]))
import attnkit
from attnkit import masks, score_mods
def BAND_FN(b, h, q, kv):
    return (q - kv).abs() <= 128
BAND = masks.from_mod(BAND_FN)
def SINKS_FN(b, h, q, kv):
    return (kv < 4) | ((kv <= q) & (kv > q - 256))
SINKS = masks.from_mod(SINKS_FN)
# a FlexAttention BlockMask of one batch row and head (B = H = None), used at H = 8: its tile map asks once whether
# the mod reads the head (cached by content after that)
BM_CAUSAL = attnkit.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 2048, 2048)
_I = torch.arange(2048)
DOCS_T = (_I[:, None] // 512 == _I[None, :] // 512) & (_I[None, :] <= _I[:, None])  # causal within 4 documents
BAND_T = (_I[:, None] - _I[None, :]).abs() <= 128
RAND64 = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) < 0.7
RAND64[:, 0] = True
PAD512 = torch.arange(512) >= 7
SINKS_T = (_I[None, :] < 4) | ((_I[None, :] <= _I[:, None]) & (_I[None, :] > _I[:, None] - 256))
_J = torch.arange(256)
SINKS256 = (_J[None, :] < 4) | ((_J[None, :] <= _J[:, None]) & (_J[None, :] > _J[:, None] - 64))
def RAND64_MOD(b, h, q, kv):
    return RAND64[q, kv]
def SINKS256_MOD(b, h, q, kv):
    return SINKS256[q, kv]
for line in sys.stdin:
    c = json.loads(line)
    torch.manual_seed(0)
    B, H, Hkv, L, S, D = c["B"], c["H"], c["Hkv"], c["L"], c["S"], c["D"]
    grad = c["mode"] == "fwdbwd"
    dt = torch.bfloat16 if c.get("bf16") else torch.float32
    q = torch.randn(B, H, L, D).to(dt).requires_grad_(grad)
    k = torch.randn(B, Hkv, S, D).to(dt).requires_grad_(grad)
    v = torch.randn(B, Hkv, S, D).to(dt).requires_grad_(grad)
    kw = eval("dict(" + c["kw"] + ")")
    def step():
        if grad:
            out = attnkit.attention(q, k, v, **kw)
            out.sum().backward()
        else:
            with torch.no_grad():
                attnkit.attention(q, k, v, **kw)
    step()
    ts = []
    for _ in range(c["repeats"]):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    print(json.dumps({"median": statistics.median(ts)}), flush=True)
'''


def _worker(src: str, threads: int):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    return subprocess.Popen([sys.executable, "-c", WORKER, str(threads)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _ask(proc, case: dict) -> float:
    proc.stdin.write(json.dumps(case) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["median"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the old tree's src/ directory")
    ap.add_argument("--after", required=True, help="the new tree's src/ directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small cases only")
    ap.add_argument("--only", help="run only the cases whose name contains this text (several: a | b)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    wanted = [t.strip() for t in a.only.split("|")] if a.only else []
    cases = [c for c in CASES if (not a.quick or c[4] * c[5] <= 2048 * 2048)
             and (not wanted or any(t in c[0] for t in wanted))]
    procs = {"before": _worker(a.before, a.threads), "after": _worker(a.after, a.threads)}
    rows = []
    print("| case | before | after | before/after |\n|---|---|---|---|", flush=True)
    for name, B, H, Hkv, L, S, D, kw, mode in cases:
        c = dict(B=B, H=H, Hkv=Hkv, L=L, S=S, D=D, kw=kw, mode=mode, repeats=a.repeats, bf16="bf16" in name)
        got = {"before": [], "after": []}
        for r in range(a.rounds):  # interleaved: before, after, before, after, ...
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for which in order:
                got[which].append(_ask(procs[which], c))
        b, f = statistics.median(got["before"]), statistics.median(got["after"])
        rows.append(dict(case=name, before_s=b, after_s=f, ratio=b / f))
        unit, k = ("ms", 1e3) if b > 1e-3 else ("µs", 1e6)
        print(f"| {name} | {b * k:.1f} {unit} | {f * k:.1f} {unit} | {b / f:.2f}× |", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
