"""``auto``'s crossovers measured on the machine that runs: attnkit's compiled kernel against torch SDPA.

Shape legend: B batch · H query heads · L query length · S key length · D head dim. Every measurement
runs q, k, v of shape (1, 8, L, 64) (L = S), the shape the default table was measured on.

``auto`` hands a call with no mask, or with a causal mask (L = S or top-left), to attnkit's compiled
kernel instead of SDPA from a size on; keeps bf16 on torch's kernel where the CPU multiplies bf16
in hardware; and sends a bf16 call that wants gradients to the kernel where torch's bf16 backward is the
slower (a CPU without bf16 instructions: torch's flash backward there ran 4-5x its fp32 time). Those rules
were measured on one CPU. This module measures them on this one:

* :func:`crossovers` — the table ``auto`` reads (a dict lookup after the first call of a process):
  from this machine's calibration file when there is one for this CPU, torch version, attnkit version
  and thread count, else :class:`Crossovers`' defaults (today's table). ``source`` says which.
* :func:`calibrate` — measures, bounded by ``budget_s`` of wall time (2 s by default), and writes the
  file (``attnkit calibrate`` is the command line for it). A calibration that fails or is interrupted
  never breaks attention: it returns the defaults, with one warning.

Where the file lives: ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
``~/.cache/attnkit``; one file per CPU model (with its ISA flags), torch version, attnkit version and
thread count, ``calibration-<digest>-<N>t.json``. A file that is corrupt, or whose recorded key does not
match this machine, is ignored (the defaults decide, ``source`` says why) and rewritten by the next
calibration.

``ATTNKIT_CALIBRATION`` (read once per process and thread count; :func:`forget` re-reads it):

* ``on`` (or unset) — use this machine's file when there is one; measure nothing on its own;
* ``off`` — always the defaults (the test suite sets this, so its decisions are deterministic);
* ``first-use`` — as ``on``, and when there is no valid file, the first call that reads the table
  calibrates (at most 2 s, once per process and thread count) and writes it; not while the machine is
  busy (1-minute load above its core count), when the times would mostly measure the waiting.

Nothing runs on its own by default: a 2 s pause inside someone's first attention call, measured while
their program is busy with something else, would surprise them and could mislead the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Crossovers", "Point", "OrderPoint", "crossovers", "calibrate", "cache_dir", "cache_path", "machine_key",
           "forget", "reset", "WIN_MARGIN", "DEFAULT_NATIVE_CAUSAL_MIN", "DEFAULT_NATIVE_DENSE_MIN_LS",
           "DEFAULT_BUDGET_S", "SCHEMA"]

# Today's table (2 threads, fp32, D = 64, an AMD EPYC (Zen 3, AVX2): benchmarks/auto_grid.py): the compiled kernel
# beats SDPA's is_causal from min(L, S) = 64 (measured 2026-11-27 with the kernel's replayed call: L = 64 forward
# 0.25 ms against SDPA's 0.32, forward + backward 1.00 / 0.99; L = 128 0.39 / 0.55 and 1.41 / 1.71; the table's
# earlier 256 predates the replayed call), and SDPA with no mask from L·S = 1024².
DEFAULT_NATIVE_CAUSAL_MIN = 64
DEFAULT_NATIVE_DENSE_MIN_LS = 1024 * 1024
DEFAULT_BUDGET_S = 2.0
SCHEMA = 5  # the file's layout (2: bf16_grad; 3: bf16_small, fp16_small; 4: decode_order, order_points; 5:
# small_mask); another schema is ignored and rewritten

ENV_SWITCH = "ATTNKIT_CALIBRATION"
ENV_DIR = "ATTNKIT_CACHE_DIR"
_OFF = ("off", "0", "false", "no")
_ON = ("", "on", "1", "true", "yes")
_FIRST_USE = "first-use"

H, D = 8, 64  # the measured shape (B = 1, L = S): the default table's
CAUSAL_LENGTHS = (64, 128, 256, 512, 1024)
DENSE_LENGTHS = (256, 512, 1024, 2048)  # L = S; the crossover is in L·S
DTYPE_LENGTH = 512  # bf16 / fp16: kernel against torch's kernel at this L = S, causal and no mask
GRAD_LENGTH = 256  # bf16 with gradients: kernel against torch's kernel at this L = S, no mask (SDPA's ground)
SMALL_LENGTH = 64  # bf16 / fp16 below the fp32 crossovers: kernel against torch's kernel in that dtype, no mask
# (and fp32 with a bool tensor mask of one tile, "mask": the kernel reading its bits against SDPA applying it)
ROWS_KEYS = 4096  # fp32 with gradients at a few query rows: one query row over this many keys, no mask ("rows")
# the decode entry's read order of K and V: one fp32 query row per head over this many keys of D = ORDER_D, MHA and
# GQA (ORDER_HEADS: H / Hkv), K and V 32 MiB (four times the 8 MB from which today's rule learns the order per call
# shape)
ORDER_KEYS, ORDER_D, ORDER_HEADS = 4096, 128, ((8, 8), (32, 8))
_POINT_TARGET_S = 0.06  # time spent on one point (both peers), rounds in [_MIN_ROUNDS, _MAX_ROUNDS]
_MIN_ROUNDS, _MAX_ROUNDS = 3, 15

# the kernel must be at least this much faster to take a size from SDPA: closer is within the jitter of shared
# cores, and SDPA's path costs less per call
WIN_MARGIN = 1.03

_CHOICES = ("kernel", "torch")
_ORDERS = ("blocked", "memory")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Point:
    """One measured point: ``case`` ``"causal"``, ``"none"`` (no mask), ``"rows"`` (a few query rows, no mask) or
    ``"mask"`` (a random bool tensor mask, every tile partial) at q (1, 8, L, 64), k/v (1, 8, S, 64);
    the fastest round's milliseconds of the compiled kernel (``attnkit.attention(..., backend="tiled")``) and of
    ``torch.nn.functional.scaled_dot_product_attention``, over ``rounds`` interleaved rounds."""

    case: str
    dtype: str
    L: int
    S: int
    mode: str  # "fwd" or "fwd+bwd"
    kernel_ms: float
    sdpa_ms: float
    rounds: int

    @property
    def ratio(self) -> float:
        """SDPA's time over the kernel's: above 1 the kernel is faster."""
        return self.sdpa_ms / self.kernel_ms if self.kernel_ms > 0 else math.inf

    @property
    def kernel_wins(self) -> bool:
        """The kernel at least :data:`WIN_MARGIN` faster (a closer race is a tie, and a tie stays on SDPA)."""
        return self.ratio >= WIN_MARGIN


@dataclass(frozen=True)
class OrderPoint:
    """The decode entry's two read orders of K and V, measured: one fp32 query row per head, q (1, H, 1, D), k / v
    (1, Hkv, S, D), no mask; the fastest round's milliseconds reading them register-blocked (each unit of query rows
    scores a register block of keys at a time) and in memory order (each key's row, then each value's, read through
    in turn: the hardware prefetcher follows it), over ``rounds`` interleaved rounds. The same bits either way."""

    H: int
    Hkv: int
    S: int
    D: int
    dtype: str
    blocked_ms: float
    memory_ms: float
    rounds: int

    @property
    def ratio(self) -> float:
        """Memory order's time over register-blocked's: above 1 register-blocked is faster."""
        return self.memory_ms / self.blocked_ms if self.blocked_ms > 0 else math.inf


@dataclass(frozen=True)
class Crossovers:
    """The sizes and dtypes where ``auto`` prefers attnkit's compiled kernel to torch's kernels (CPU).

    * ``native_causal_min``: causal (L = S or top-left) runs on the kernel from ``min(L, S) >=`` this;
    * ``native_dense_min_ls``: no mask runs on the kernel from ``L * S >=`` this;
    * ``bf16`` / ``fp16``: ``"kernel"`` (the compiled kernel takes this dtype), ``"torch"`` (torch's kernel
      keeps it) or None (today's rule: bf16 stays on torch's kernel where the CPU has bf16 instructions);
    * ``bf16_small`` / ``fp16_small``: ``"kernel"`` (a call in that dtype without gradients, no mask or causal,
      goes to the compiled kernel below the fp32 crossovers too, where SDPA would take it on size grounds: torch's
      kernel in that dtype measured slower than ours at L = S = 64), ``"torch"`` or None (today's rule: the kernel
      where the CPU has no bf16 instructions);
    * ``bf16_grad``: ``"kernel"`` (a bf16 call that wants gradients goes to the compiled kernel where SDPA would
      have taken it), ``"torch"`` (SDPA keeps it) or None (today's rule: the kernel where the CPU has no bf16
      instructions);
    * ``few_rows_grad``: ``"kernel"`` (an fp32 call that wants gradients at a few query rows over a long cache goes
      to the compiled kernel's few-rows backward), ``"torch"`` (SDPA keeps it) or None (today's rule: the kernel);
    * ``small_mask``: ``"kernel"`` (a call without gradients with a bool tensor mask of one 64 x 64 tile goes to the
      compiled kernel, which reads the tile's bits per call), ``"torch"`` (SDPA applies the mask) or None (today's
      rule: the kernel);
    * ``decode_order``: how the decode entry reads K and V — ``"blocked"`` (register-blocked at every size: measured
      faster here over a long cache), ``"memory"`` (today's rule, register-blocked not faster here: from 8 MB of K and
      V the order the kernel learns on each call shape's first calls, timing both; register-blocked below) or None
      (today's rule, not measured); ``order_points``: its measurements;
    * ``source``: which table decided, in words (``dispatch`` quotes it);
    * ``calibrated``: measured on this machine (else the defaults); ``path``: the file it came from or
      went to; ``points``: the measurements; ``failure``: why a calibration gave the defaults instead.
    """

    native_causal_min: int = DEFAULT_NATIVE_CAUSAL_MIN
    native_dense_min_ls: int = DEFAULT_NATIVE_DENSE_MIN_LS
    bf16: str | None = None
    fp16: str | None = None
    bf16_grad: str | None = None
    bf16_small: str | None = None
    fp16_small: str | None = None
    few_rows_grad: str | None = None
    decode_order: str | None = None
    small_mask: str | None = None
    source: str = "defaults"
    calibrated: bool = False
    path: str | None = None
    points: tuple[Point, ...] = ()
    order_points: tuple[OrderPoint, ...] = ()
    failure: str | None = None
    elapsed_s: float | None = None

    def dtype_choice(self, dtype: torch.dtype) -> str | None:
        """``"kernel"``, ``"torch"`` or None (today's rule) for a low-precision ``dtype``; None for others."""
        if dtype == torch.bfloat16:
            return self.bf16
        if dtype == torch.float16:
            return self.fp16
        return None

    def case_choice(self, dtype: torch.dtype, case: str) -> str | None:
        """The choice measured for ``dtype``'s forward at L = S = :data:`DTYPE_LENGTH` at this mask ``case``
        (``"causal"`` or ``"none"``) alone; None where that point was not measured. (An Intel Xeon with AMX measured
        the kernel 1.2x faster than torch's bf16 kernel causal and 1.3x slower with no mask: one choice for both
        sent causal bf16 calls to the slower kernel.)"""
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
        return _dtype_choice([p for p in self.points if p.dtype == name and p.case == case and p.mode == "fwd"
                              and p.L == DTYPE_LENGTH and p.S == DTYPE_LENGTH])

    def torch_keeps(self, dtype: torch.dtype, bf16_hardware: Callable[[], bool], case: str | None = None
                    ) -> str | None:
        """Why a call in ``dtype`` stays on torch's kernel instead of the compiled kernel (None: the kernel may
        take it): the choice measured at this mask ``case`` (``"causal"``, ``"none"``; None: a mask of another
        kind), else the one measured for the dtype, else today's rule (bf16 on a CPU with bf16 instructions, asked
        of ``bf16_hardware`` only then)."""
        measured = self.case_choice(dtype, case) if case is not None else None
        choice = measured or self.dtype_choice(dtype)
        if choice == "torch":
            name = "bfloat16" if dtype == torch.bfloat16 else "float16"
            kind = "causal" if case == "causal" else "no mask"
            at = f" at {kind}, {DTYPE_LENGTH} x {DTYPE_LENGTH}" if measured else ""
            return f"{name}: torch's kernel measured faster than the compiled kernel here{at} ({self.source})"
        if choice is None and dtype == torch.bfloat16 and bf16_hardware():
            return ("bfloat16 on a CPU that multiplies bf16 in hardware (torch's kernel keeps bf16 GEMMs; ours is "
                    "fp32)")
        return None

    def small_to_kernel(self, dtype: torch.dtype, bf16_hardware: Callable[[], bool]) -> str | None:
        """Why a call in ``dtype`` without gradients (no mask or causal) goes to the compiled kernel below the fp32
        crossovers, where SDPA would take it on size grounds (None: SDPA keeps it): bf16 / fp16 only — the measured
        choice at L = S = 64, else today's rule (a CPU without bf16 instructions, asked of ``bf16_hardware`` only
        then: torch's CPU kernels convert bf16 / fp16 through fp32, ours widens them per tile)."""
        choice = self.bf16_small if dtype == torch.bfloat16 else self.fp16_small if dtype == torch.float16 else "torch"
        if choice == "torch":
            return None
        name = "bfloat16" if dtype == torch.bfloat16 else "float16"
        if choice == "kernel":
            return (f"{name} below the fp32 crossovers: torch's kernel in {name} measured slower than the compiled "
                    f"kernel here ({self.source})")
        if bf16_hardware():
            return None
        return (f"{name} on a CPU without bf16 instructions: torch's kernel converts through fp32 (1.2-3x its fp32 "
                f"time at L = S = 64 on a 2-core AMD EPYC); the compiled kernel widens per tile")

    def grad_to_kernel(self, dtype: torch.dtype, bf16_hardware: Callable[[], bool]) -> str | None:
        """Why a call in ``dtype`` that wants gradients goes to the compiled kernel rather than torch SDPA (None:
        SDPA may keep it): bf16 only — the measured choice, else today's rule (the kernel unless ``bf16_hardware``
        says torch alone multiplies bf16 in hardware here). fp16 never reaches SDPA with gradients (its backward is
        inexact)."""
        if dtype != torch.bfloat16 or self.bf16_grad == "torch":
            return None
        if self.bf16_grad == "kernel":
            return f"bfloat16 with gradients: the compiled kernel measured faster than torch's here ({self.source})"
        if bf16_hardware():
            return None
        return ("bfloat16 with gradients where only the compiled kernel's backward avoids torch's slow bf16 one (no "
                "bf16 instructions: torch's converts through fp32, 4-5x its fp32 time at L = 256-1024 on a 2-core AMD "
                "EPYC; AMX: the kernel multiplies bf16 on tiles, 2.4x faster than torch's at 256 x 256 on an Intel "
                f"Xeon) (table: {self.source})")

    def few_rows_grad_to_kernel(self, min_keys: int) -> str | None:
        """Why an fp32 call that wants gradients at a few query rows whose rows reach at least ``min_keys`` keys goes
        to the compiled kernel rather than torch SDPA (None: SDPA keeps it): the measured choice (one query row over
        :data:`ROWS_KEYS` keys), else today's rule (the kernel: forward + backward faster than auto's SDPA
        call from 2048 keys: 1.3-2.0x on a 2-core AMD EPYC, BENCHMARKS.md)."""
        if self.few_rows_grad == "torch":
            return None
        where = (f"the compiled kernel measured faster than SDPA here ({self.source})" if self.few_rows_grad == "kernel"
                 else f"the compiled kernel's few-rows backward is faster than SDPA's there (table: {self.source})")
        return f"a few query rows with gradients over >= {min_keys} keys: {where}"


    def small_mask_to_kernel(self) -> str | None:
        """Why a call without gradients with a bool tensor mask of one 64 x 64 tile goes to the compiled kernel
        rather than SDPA (None: SDPA keeps it): the measured choice, else today's rule (the kernel: its replayed call
        0.121 ms against SDPA's 0.158 at L = S = 64, 8 heads, D = 64, fp32, on an Intel Xeon with AMX, 2 threads, in
        this calibration's own point)."""
        if self.small_mask == "torch":
            return None
        where = ("measured faster than SDPA here" if self.small_mask == "kernel"
                 else "faster than SDPA applying it as it is")
        return (f"a bool mask of one {SMALL_LENGTH} x {SMALL_LENGTH} tile: attnkit's compiled kernel reads its bits "
                f"in one C pass and masks the scores by them, {where} (table: {self.source})")


_MEMO: dict[int, Crossovers] = {}
_LOCK = threading.Lock()


class _Local(threading.local):
    """Per thread: inside a calibration (``measuring``), and whether first-use calibration was tried. Class
    attributes as defaults: reading one is a plain attribute lookup (a getattr default raises inside)."""

    measuring = False
    tried = False


_local = _Local()
# what crossovers() answers inside a calibration (the measuring thread only): every dtype on the kernel, so the
# kernel is what gets measured, and no calibration starts inside one
_MEASURING = Crossovers(bf16="kernel", fp16="kernel", source="calibrating (the kernel takes every dtype while it "
                                                             "is measured)")


def crossovers(threads: int | None = None) -> Crossovers:
    """The table ``auto`` decides by, for ``threads`` (default: ``torch.get_num_threads()``).

    Memoised per process and thread count (a dict lookup after the first call). Never raises for a
    missing, corrupt or foreign file: the defaults decide then, and ``source`` says why.
    """
    if _local.measuring:
        return _MEASURING
    n = torch.get_num_threads() if threads is None else threads
    got = _MEMO.get(n)
    if got is None:
        with _LOCK:
            got = _MEMO.get(n)
            if got is None:
                got = _MEMO[n] = _load(n)
    return got


def forget() -> None:
    """Drop the in-process memo: the next :func:`crossovers` re-reads the environment and the file (and the
    fast path's remembered decisions go with it: they were taken by the old table)."""
    _MEMO.clear()
    _forget_decisions()


# What to call when the table in use may change (forget, a calibration in this process): the fast path registers
# its clear() here (it sits above this module and imports it; this module never imports it back)
_ON_NEW_TABLE: list[Callable[[], None]] = []


def _forget_decisions() -> None:
    for fn in _ON_NEW_TABLE:
        fn()


def cache_dir() -> Path:
    """Where calibration files live: ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
    ``~/.cache/attnkit``."""
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "attnkit"


_KEY: dict[str, object] | None = None


def _attnkit_version() -> str:
    """The installed attnkit's version (read from its metadata: the package face sits above this module)."""
    from importlib import metadata

    try:
        return metadata.version("attnkit")
    except metadata.PackageNotFoundError:
        return "unknown"


def _kernel_name() -> str:
    """The compiled kernel as it runs here: its instruction set, "+ AMX bf16" where its bf16 forward multiplies on
    tiles, "+ avx512_bf16 decode" where its bf16 decode takes vector dot products ("unavailable" without it)."""
    from .backends import _native  # lazy: the kernel's own entry points (the layer below everything that reads us)

    if not _native.available():
        return "unavailable"
    return (_native.isa() + (" + AMX bf16" if _native.bf16_dot() else "")
            + (" + avx512_bf16 decode" if _native.bf16_vdot() else ""))


def machine_key(threads: int | None = None) -> dict[str, object]:
    """What a calibration file must match: CPU model (with the ISA flags that change the kernels' speed),
    torch version, attnkit version, the compiled kernel's instruction set and bf16 products (a rebuild that
    multiplies bf16 on AMX changes which kernel wins), schema and thread count."""
    global _KEY
    if _KEY is None:
        _KEY = {"cpu": _cpu_name(), "torch": torch.__version__, "attnkit": _attnkit_version(),
                "kernel": _kernel_name(), "schema": SCHEMA}
    return {**_KEY, "threads": torch.get_num_threads() if threads is None else int(threads)}


def cache_path(threads: int | None = None) -> Path:
    """This machine's calibration file for ``threads`` (default: ``torch.get_num_threads()``)."""
    key = machine_key(threads)
    digest = hashlib.sha1(json.dumps({k: v for k, v in key.items() if k != "threads"}, sort_keys=True)
                          .encode()).hexdigest()[:12]
    return cache_dir() / f"calibration-{digest}-{key['threads']}t.json"


def reset() -> list[Path]:
    """Delete every calibration file in :func:`cache_dir` (any CPU, torch version, thread count); the
    paths deleted. The memo is dropped too."""
    gone = []
    d = cache_dir()
    if d.is_dir():
        for p in sorted(d.glob("calibration-*.json")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                gone.append(p)
    forget()
    return gone


_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "asimd", "sve")


def _cpu_name() -> str:
    """The CPU model and the ISA flags that matter here, e.g. ``"AMD EPYC [avx2 fma]"``."""
    name, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(val.split())
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    have = [f for f in _FLAGS if f in flags]
    return f"{name} [{' '.join(have)}]" if have else name


def _home(p: Path | str) -> str:
    s, home = str(p), str(Path.home())
    return "~" + s[len(home):] if home and home != "/" and s.startswith(home + os.sep) else s


def _switch() -> str:
    v = os.environ.get(ENV_SWITCH, "").strip().lower()
    if v in _OFF:
        return "off"
    if v == _FIRST_USE:
        return _FIRST_USE
    if v not in _ON:
        warnings.warn(f"{ENV_SWITCH}: expected 'on', 'off' or 'first-use', got {v!r}; using 'on' (this machine's "
                      "calibration file when there is one). Set it to one of the three.", RuntimeWarning, stacklevel=4)
    return "on"


def _load(threads: int) -> Crossovers:
    """The table for ``threads`` from the environment and the file (never raises)."""
    switch = _switch()
    if switch == "off":
        return Crossovers(source=f"defaults (calibration switched off: {ENV_SWITCH}=off)")
    try:
        path = cache_path(threads)
    except Exception as e:  # no home directory, an unreadable key: the defaults, said so
        return Crossovers(source=f"defaults (no calibration cache: {type(e).__name__}: {e})")
    table, why = _read(path, threads)
    if table is not None:
        return table
    if _CORRUPT in why:  # (a file of another machine or version is expected after an upgrade: no warning)
        warnings.warn(f"attnkit: {why}; auto uses its default crossovers until then (`attnkit calibrate`).",
                      RuntimeWarning, stacklevel=4)
    if switch == _FIRST_USE and not _local.tried:
        _local.tried = True  # once per thread, even when it fails
        busy = _busy()
        if busy:
            return Crossovers(source=f"defaults ({why}; first-use calibration skipped: {busy})")
        return calibrate(DEFAULT_BUDGET_S, threads=threads, write=True)  # failed: the defaults, saying why
    return Crossovers(source=f"defaults ({why})")


def _busy() -> str | None:
    """Why this machine is too busy to calibrate on its own (the 1-minute load above the core count: the
    times would include waiting for other work), or None."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    cores = os.cpu_count() or 1
    return f"load {load:.1f} on {cores} cores" if load > cores else None


_CORRUPT = " corrupt: "  # in _read's reason for a corrupt file (and in no other): what _load warns about


def _read(path: Path, threads: int) -> tuple[Crossovers | None, str]:
    """The calibrated table in ``path``, or None and why not (for ``source``)."""
    key = machine_key(threads)
    if not path.exists():
        cmd = "attnkit calibrate" + ("" if threads == torch.get_num_threads() else f" --threads {threads}")
        if path.parent.exists() and not path.parent.is_dir():
            return None, (f"no calibration for this CPU, torch {key['torch']}, {_threads(threads)}: the cache "
                          f"directory {_home(path.parent)} is a file; set ATTNKIT_CACHE_DIR to a folder, then run "
                          f"`{cmd}`")
        return None, f"no calibration for this CPU, torch {key['torch']}, {_threads(threads)}: run `{cmd}`"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("key"), dict):
            raise ValueError("no 'key' object")
        got = data["key"]
        if got.get("schema") != SCHEMA:
            return None, (f"calibration file {_home(path)} has schema {got.get('schema')!r}, not {SCHEMA}; "
                          "will be rewritten by the next calibration")
        differ = [f"{k} {got.get(k)!r} (this machine: {key[k]!r})" for k in ("cpu", "torch", "attnkit", "threads")
                  if got.get(k) != key[k]]
        if differ:
            return None, (f"calibration file {_home(path)} is for another " + "; ".join(differ)
                          + "; will be rewritten by the next calibration")
        table = _from_json(data, path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        return None, (f"calibration file {_home(path)}{_CORRUPT}{type(e).__name__}: {e}; "
                      "will be rewritten by the next calibration")
    return table, ""


def _from_json(data: dict, path: Path) -> Crossovers:
    c = data["crossovers"]
    causal, dense = c["native_causal_min"], c["native_dense_min_ls"]
    for name, val in (("native_causal_min", causal), ("native_dense_min_ls", dense)):
        if not (isinstance(val, int) and not isinstance(val, bool) and val >= 1):
            raise ValueError(f"{name}: expected a whole number >= 1, got {val!r}")
    choice = {}
    for name in ("bf16", "fp16", "bf16_grad", "bf16_small", "fp16_small", "few_rows_grad", "small_mask"):
        val = c.get(name)
        if val is not None and val not in _CHOICES:
            raise ValueError(f"{name}: expected one of {_CHOICES} or null, got {val!r}")
        choice[name] = val
    order = c.get("decode_order")
    if order is not None and order not in _ORDERS:
        raise ValueError(f"decode_order: expected one of {_ORDERS} or null, got {order!r}")
    points = tuple(_point(p) for p in _typed(data.get("points", []), list, "points"))
    order_points = tuple(_order_point(p) for p in _typed(data.get("order_points", []), list, "order_points"))
    elapsed = data.get("elapsed_s")
    if elapsed is not None and not _is_number(elapsed):
        raise ValueError(f"elapsed_s: expected a number of seconds or null, got {elapsed!r}")
    kept = _typed(data.get("defaults_kept", []), list, "defaults_kept")
    if not all(isinstance(x, str) for x in kept):
        raise ValueError(f"defaults_kept: expected a list of names, got {kept!r}")
    key, when = data["key"], str(data.get("created", "?"))[:10]
    return Crossovers(causal, dense, choice["bf16"], choice["fp16"], choice["bf16_grad"], choice["bf16_small"],
                      choice["fp16_small"], choice["few_rows_grad"], decode_order=order,
                      small_mask=choice["small_mask"], source=_source(key, when, path, kept), calibrated=True,
                      path=str(path), points=points, order_points=order_points, elapsed_s=elapsed)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _typed(x, kind: type, name: str):
    if not isinstance(x, kind):
        raise ValueError(f"{name}: expected a {kind.__name__}, got {x!r}")
    return x


def _point(p) -> Point:
    """A stored point, each field of its own type (a file whose table is sound but whose points are not would
    pass here and break ``attnkit calibrate --show`` later)."""
    _typed(p, dict, "points[]")
    want = {"case": str, "dtype": str, "mode": str, "L": int, "S": int, "rounds": int}
    for name, kind in want.items():
        if not isinstance(p[name], kind) or isinstance(p[name], bool):
            raise ValueError(f"points[].{name}: expected a {kind.__name__}, got {p[name]!r}")
    for name in ("kernel_ms", "sdpa_ms"):
        if not (_is_number(p[name]) and p[name] >= 0):
            raise ValueError(f"points[].{name}: expected milliseconds >= 0, got {p[name]!r}")
    return Point(**{f.name: p[f.name] for f in dataclasses.fields(Point)})


def _order_point(p) -> OrderPoint:
    """A stored :class:`OrderPoint`, each field of its own type."""
    _typed(p, dict, "order_points[]")
    for name in ("H", "Hkv", "S", "D", "rounds"):
        if not isinstance(p[name], int) or isinstance(p[name], bool) or p[name] < 1:
            raise ValueError(f"order_points[].{name}: expected a whole number >= 1, got {p[name]!r}")
    if not isinstance(p["dtype"], str):
        raise ValueError(f"order_points[].dtype: expected a str, got {p['dtype']!r}")
    for name in ("blocked_ms", "memory_ms"):
        if not (_is_number(p[name]) and p[name] >= 0):
            raise ValueError(f"order_points[].{name}: expected milliseconds >= 0, got {p[name]!r}")
    return OrderPoint(**{f.name: p[f.name] for f in dataclasses.fields(OrderPoint)})


def _threads(n) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _source(key, when: str, path: Path | None, kept) -> str:
    cpu = str(key["cpu"]).split(" [")[0]
    where = f" ({_home(path)})" if path is not None else " (not written)"
    line = f"calibrated {when} on {cpu}, torch {key['torch']}, {_threads(key['threads'])}{where}"
    return line + (f"; defaults kept for {', '.join(kept)} (not measured in the budget)" if kept else "")


# --- measuring ----------------------------------------------------------------------------------------------

_clock: Callable[[], float] = time.perf_counter  # the wall clock the budget is kept by (tests replace it)


class _NoKernel(Exception):
    """The compiled kernel cannot run here (not built, or refuses the call): nothing to calibrate."""


def _measure_point(case: str, dtype: str, L: int, backward: bool, deadline: float,
                   clock: Callable[[], float], S: int | None = None) -> tuple[float, float, int] | None:
    """The fastest round's seconds (kernel, SDPA) over interleaved rounds at q (1, 8, L, 64), k / v (1, 8, S, 64)
    (S = L unless given; ``case`` "rows": no mask, the forward on the kernel's decode entry and its few-rows
    backward, as ``auto`` runs a few query rows with gradients; "mask": a random bool tensor mask (1, 1, L, S),
    every tile partial, as ``auto`` replays such a call: the kernel reading the mask's tiles in C every call, SDPA
    applying the mask, forward only); None when even the fewest rounds would not end
    before ``deadline``. Raises :class:`_NoKernel` when the call would not run on the compiled kernel."""
    import torch.nn.functional as F

    from . import masks
    from .backends import _native  # lazy: the kernel's own entry points (the layer below everything that reads us)

    if not _native.available():
        raise _NoKernel(f"the compiled kernel is not available here ({_native.unavailable_reason()})")
    dt = _DTYPES[dtype]
    S = L if S is None else S
    g = torch.Generator().manual_seed(L)
    q = torch.randn(1, H, L, D, generator=g).to(dt).requires_grad_(backward)
    k, v = (torch.randn(1, H, S, D, generator=g).to(dt).requires_grad_(backward) for _ in range(2))
    go = torch.randn(1, H, L, D, generator=g).to(dt)
    causal = case == "causal"
    iv = (masks.causal() if causal else masks.full()).row_intervals(1, L, S)
    assert iv is not None  # both are one stretch of keys per row
    lo, hi = iv
    scale = D ** -0.5
    attn_mask, masked = None, None
    if case == "mask":
        read = _native.dense_tiles_fn()
        if read is None:  # (a build without the C pass: auto's call reads the tiles with torch ops; not measured)
            return None
        from .backends import _tilebits

        bools = (torch.rand(1, 1, L, S, generator=g) < 0.85) | (torch.arange(S) == 0)  # (no row left empty)
        nq, nk = -(-L // _tilebits.TILE), -(-S // _tilebits.TILE)
        tiles = _tilebits.TileBits(torch.zeros(1, 1, nq, nk, dtype=torch.int8),
                                   torch.full((1, 1, nq, nk), -1, dtype=torch.int32),
                                   torch.zeros(nq * nk, 2, _tilebits.TILE, dtype=torch.int32))
        rows_lo, rows_hi = torch.zeros(1, L, dtype=torch.int32), torch.full((1, L), S, dtype=torch.int32)
        read(bools, L, S, tiles.kinds, tiles.index, tiles.bits)
        step = _native.forward_step(q, k, v, rows_lo, rows_hi, tiles, rounded=True)

        def masked():  # the replayed call: this call's mask read into the prepared tile map, then the kernel
            read(bools, L, S, tiles.kinds, tiles.index, tiles.bits)
            step(q, k, v, scale)

        attn_mask = bools

    def kernel():  # what the native kernel runs for such a call: forward (and backward), outputs rounded to dt
        with torch.no_grad():  # by the kernel itself (bf16 / fp16)
            if masked is not None:
                masked()
                return
            if case == "rows":  # (fp32) a few rows' forward on the decode entry, as backends/native.py runs it
                out, lse = _native.decode(q, k, v, lo, hi, scale, need_lse=True)
            else:
                out, lse, _ = _native.forward(q, k, v, lo, hi, scale, rounded=True)
            if backward:
                _native.backward(q, k, v, lo, hi, scale, out, lse, go, rounded=True)

    # attnkit's SDPA path reads the first column of SDPA's output after every call (torch's fused CPU kernel writes
    # an all-zero row where a NaN / inf should show: backends/sdpa.py may_hide_nan); the kernel path has no such
    # check. Measured with it, the crossover compares the two paths attnkit runs, not the bare kernels (at L = 64
    # on a 2-core AMD EPYC the bare kernels tie, and the check decides)
    hides_nan = _native.suspect_rows_fn()

    def sdpa():
        if backward:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if hides_nan is not None:
                hides_nan(out.detach())
            out.backward(go)
        else:
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
                if hides_nan is not None:
                    hides_nan(out)

    def timed(f):
        t0 = clock()
        f()
        return clock() - t0

    pair = timed(kernel) + timed(sdpa)  # the warm-up, and what one round costs
    left = deadline - clock()
    rounds = min(_MAX_ROUNDS, max(_MIN_ROUNDS, int(_POINT_TARGET_S / max(pair, 1e-9))), int(left / max(pair, 1e-9)))
    if rounds < _MIN_ROUNDS:
        return None
    tk: list[float] = []
    ts: list[float] = []
    for r in range(rounds):  # interleaved, alternating who goes first: drift and turbo hit both alike
        if r and clock() + min(tk) + min(ts) > deadline:
            break  # rounds ran slower than the warm-up promised (other work on the cores): keep the budget
        if r % 2:
            ts.append(timed(sdpa))
            tk.append(timed(kernel))
        else:
            tk.append(timed(kernel))
            ts.append(timed(sdpa))
    if len(tk) < _MIN_ROUNDS:
        return None
    # the fastest round of each: other work on shared cores only ever adds time (a preempted OpenMP thread
    # holds up the whole call), so the minimum is the estimate least moved by it
    return min(tk), min(ts), len(tk)


def _measure_order(deadline: float, clock: Callable[[], float]) -> list[OrderPoint]:
    """The decode entry's two read orders (:class:`OrderPoint`) at each of :data:`ORDER_HEADS`, one fp32 query row
    over :data:`ORDER_KEYS` keys of D = :data:`ORDER_D` (K and V shared by both: 32 MiB), interleaved round by round,
    alternating which goes first; the fastest round of each. Empty when even the fewest rounds would not end before
    ``deadline``. Raises :class:`_NoKernel` when the kernel is not here."""
    from .backends import _native  # lazy: the kernel's own entry points (the layer below everything that reads us)

    if not _native.available():
        raise _NoKernel(f"the compiled kernel is not available here ({_native.unavailable_reason()})")
    g = torch.Generator().manual_seed(ORDER_KEYS)
    Hkv = ORDER_HEADS[0][1]
    k, v = (torch.randn(1, Hkv, ORDER_KEYS, ORDER_D, generator=g) for _ in range(2))
    lo = torch.zeros(1, 1, dtype=torch.int32)
    hi = torch.full((1, 1), ORDER_KEYS, dtype=torch.int32)
    scale = ORDER_D ** -0.5
    got: list[OrderPoint] = []
    for H, hkv in ORDER_HEADS:
        assert hkv == Hkv  # (one K and V for every layout)
        q = torch.randn(1, H, 1, ORDER_D, generator=g)
        run = {o: _native.decode_step(q, k, v, lo, hi, order=o) for o in _ORDERS}

        def timed(o, q=q, run=run):
            t0 = clock()
            run[o](q, k, v, scale)
            return clock() - t0

        pair = timed("blocked") + timed("memory")  # the warm-up, and what one round costs
        rounds = min(_MAX_ROUNDS, max(_MIN_ROUNDS, int(_POINT_TARGET_S / max(pair, 1e-9))),
                     int((deadline - clock()) / max(pair, 1e-9)))
        if rounds < _MIN_ROUNDS:
            break
        ts: dict[str, list[float]] = {o: [] for o in _ORDERS}
        for r in range(rounds):
            if r and clock() + min(ts["blocked"]) + min(ts["memory"]) > deadline:
                break
            for o in (_ORDERS if r % 2 == 0 else _ORDERS[::-1]):
                ts[o].append(timed(o))
        if len(ts["blocked"]) < _MIN_ROUNDS:
            break
        got.append(OrderPoint(H, Hkv, ORDER_KEYS, ORDER_D, "float32", min(ts["blocked"]) * 1e3,
                              min(ts["memory"]) * 1e3, len(ts["blocked"])))
    return got


def _warm_backward() -> None:
    """One tiny SDPA forward and ``out.backward(grad)``, as the measured SDPA call runs them: torch's first backward
    given a gradient tensor in a process imports sympy (``torch.autograd`` checks the gradient's shape through
    torch.fx's symbolic shapes: 3.5-3.8 s on a 2-core AMD EPYC, torch 2.13), which the first measured point would
    otherwise charge to SDPA and to the budget."""
    import torch.nn.functional as F

    q = torch.zeros(1, 1, 2, 8, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q).backward(torch.ones(1, 1, 2, 8))


def _plan(backward: bool) -> list[tuple[str, str, int, int, str]]:
    """The points ``(case, dtype, L, S, mode)`` in the order they are measured (most useful first; the budget cuts
    the tail)."""
    modes = ["fwd", "fwd+bwd"] if backward else ["fwd"]
    pts = [("causal", "float32", L, L, m) for L in CAUSAL_LENGTHS for m in modes]
    # a bool mask of one tile (cheap: ~0.2 ms a round), after causal 64 and 128
    pts.insert(2 * len(modes), ("mask", "float32", SMALL_LENGTH, SMALL_LENGTH, "fwd"))
    if backward:  # (cheap: one query row, ~30 ms a round on a 2-core AMD EPYC; after causal 64 and 128)
        pts.insert(2 * len(modes), ("rows", "float32", 1, ROWS_KEYS, "fwd+bwd"))
    # the decode entry's read order (~0.1 s on an Intel Xeon with AMX: 4 decode steps a round over 32 MiB)
    pts.append(("order", "float32", 1, ORDER_KEYS, "fwd"))
    pts += [("none", "float32", L, L, m) for L in DENSE_LENGTHS[:-1] for m in modes]
    small = SMALL_LENGTH
    pts += [("none", dt, small, small, "fwd") for dt in ("bfloat16", "float16")]  # (cheap: before the 512s)
    pts += [(c, dt, DTYPE_LENGTH, DTYPE_LENGTH, "fwd") for dt in ("bfloat16", "float16") for c in ("causal", "none")]
    if backward:  # (not at first use: torch's first bf16 SDPA backward in a process took 4.3 s on a 2-core AMD EPYC)
        pts += [("none", "bfloat16", GRAD_LENGTH, GRAD_LENGTH, "fwd+bwd")]
    pts += [("none", "float32", DENSE_LENGTHS[-1], DENSE_LENGTHS[-1], m) for m in modes]
    return pts


def _crossover(points: list[Point], default: int, unit: Callable[[int], int]) -> int | None:
    """The smallest measured size from which the kernel wins at every larger measured size (all modes);
    None when nothing was measured. When the kernel loses at the largest measured size: the default if
    it lies beyond it, else twice that size (the kernel not before what was measured)."""
    if not points:
        return None
    sizes = sorted({p.L for p in points})
    wins = {s: all(p.kernel_wins for p in points if p.L == s) for s in sizes}
    best = None
    for s in reversed(sizes):
        if not wins[s]:
            break
        best = s
    if best is not None:
        return unit(best)
    return default if default > unit(sizes[-1]) else unit(2 * sizes[-1])


def _dtype_choice(points: list[Point]) -> str | None:
    """``"kernel"`` when the kernel is faster than torch's kernel in this dtype (geometric mean over the
    measured cases), ``"torch"`` otherwise; None when nothing was measured."""
    if not points:
        return None
    g = math.exp(sum(math.log(max(p.ratio, 1e-12)) for p in points) / len(points))
    return "kernel" if g > 1.0 else "torch"


def _margin_choice(points: list[Point]) -> str | None:
    """``"kernel"`` when the kernel won every one of these points (the few-rows one, the bool mask of one tile) by
    :data:`WIN_MARGIN` (a tie stays on SDPA, as for the crossovers), ``"torch"`` otherwise; None when none was
    measured."""
    if not points:
        return None
    return "kernel" if all(p.kernel_wins for p in points) else "torch"


def _order_choice(points: list[OrderPoint]) -> str | None:
    """``"blocked"`` when reading K and V register-blocked was at least :data:`WIN_MARGIN` faster than memory order
    (geometric mean over the measured layouts), ``"memory"`` otherwise (today's rule, which learns the order per call
    shape from 8 MB, stays: a tie keeps it); None when nothing was measured."""
    if not points:
        return None
    g = math.exp(sum(math.log(max(p.ratio, 1e-12)) for p in points) / len(points))
    return "blocked" if g >= WIN_MARGIN else "memory"


def _decide(points: list[Point], backward: bool = False, order_points: list[OrderPoint] | None = None
            ) -> tuple[dict, list[str]]:
    """({native_causal_min, native_dense_min_ls, bf16, fp16, bf16_grad, bf16_small, fp16_small, few_rows_grad,
    decode_order, small_mask}, what kept its default) from the points of a calibration (``backward``: one that planned
    forward + backward points; ``order_points``: the decode entry's read orders)."""
    f32 = [p for p in points if p.dtype == "float32"]
    causal = _crossover([p for p in f32 if p.case == "causal"], DEFAULT_NATIVE_CAUSAL_MIN, lambda n: n)
    dense = _crossover([p for p in f32 if p.case == "none"], DEFAULT_NATIVE_DENSE_MIN_LS, lambda n: n * n)

    def choice(dtype: str, mode: str, small: bool) -> str | None:
        return _dtype_choice([p for p in points if p.dtype == dtype and p.mode == mode
                              and (p.L == SMALL_LENGTH) == small])

    values = {"native_causal_min": DEFAULT_NATIVE_CAUSAL_MIN if causal is None else causal,
              "native_dense_min_ls": DEFAULT_NATIVE_DENSE_MIN_LS if dense is None else dense,
              "bf16": choice("bfloat16", "fwd", False), "fp16": choice("float16", "fwd", False),
              "bf16_grad": choice("bfloat16", "fwd+bwd", False),
              "bf16_small": choice("bfloat16", "fwd", True), "fp16_small": choice("float16", "fwd", True),
              "few_rows_grad": _margin_choice([p for p in points if p.case == "rows"]),
              "small_mask": _margin_choice([p for p in points if p.case == "mask"]),
              "decode_order": _order_choice(order_points or [])}
    # (named as the table's rows read: a bf16 decision at 512 × 512 is kept even where the 64 × 64 bf16 points are
    # listed as measured, so the size is in the name)
    big, small = f"{DTYPE_LENGTH} × {DTYPE_LENGTH}", f"{SMALL_LENGTH} × {SMALL_LENGTH}"
    kept = [name for name, v in (("causal", causal), ("no mask", dense), (f"bf16 at {big}", values["bf16"]),
                                 (f"fp16 at {big}", values["fp16"]), (f"bf16 at {small}", values["bf16_small"]),
                                 (f"fp16 at {small}", values["fp16_small"])) if v is None]
    if values["bf16_grad"] is None and backward:  # (planned with backward only: not "kept" by a forward calibration)
        kept.append(f"bf16 with gradients at {GRAD_LENGTH} × {GRAD_LENGTH}")
    if values["few_rows_grad"] is None and backward:
        kept.append("a few rows with gradients")
    if values["decode_order"] is None:
        kept.append("the decode's read order")
    if values["small_mask"] is None:
        kept.append(f"a bool mask of one {small} tile")
    return values, kept


def calibrate(budget_s: float = DEFAULT_BUDGET_S, threads: int | None = None, write: bool = True,
              backward: bool = False, progress: Callable[[Point], None] | None = None) -> Crossovers:
    """Measure this machine's crossovers within ``budget_s`` seconds of wall time and (``write``) store them.

    Shape legend: every point runs q, k, v of shape (B, H, L, D) = (1, 8, L, 64), L = S.

    Measured, interleaved round by round (the fastest round of each): ``attnkit.attention(..., backend="tiled")`` on the
    compiled kernel against ``torch.nn.functional.scaled_dot_product_attention`` — causal at L = 64 … 1024,
    no mask at L = S = 256 … 2048, and bf16 / fp16 at L = 512 (causal and no mask: ``bf16`` / ``fp16``) and at
    L = 64 (no mask: ``bf16_small`` / ``fp16_small``) against torch's kernel in the same dtype;
    forward only, or forward and forward+backward with ``backward`` (the kernel must win both; and bf16 with
    no mask at L = S = 256 forward + backward, which decides ``bf16_grad``: torch's first bf16 backward in a
    process can take seconds, more than the budget; and one fp32 query row over 4096 keys forward + backward, the
    kernel's decode entry and few-rows backward, which decides ``few_rows_grad``); and the decode entry's two read
    orders of K and V, one fp32 query row over 4096 keys of D = 128, MHA 8/8 and GQA 32/8 (:class:`OrderPoint`,
    ``decode_order``: on an AMD EPYC memory order won past 8 MB, on an Intel Xeon with AMX register-blocked won
    everywhere). Points are measured most useful first; what the budget leaves unmeasured keeps its default.

    Args:
        budget_s: wall-time bound in seconds (> 0) of the measuring; the calibration stops before it would exceed
            it (with ``backward``, a warm-up of a few seconds at most runs before it, outside the bound).
        threads: torch thread count to measure at (default: ``torch.get_num_threads()``; restored after).
        write: store the result in :func:`cache_path` (atomically: a temporary file renamed over it).
        backward: measure forward+backward too (after one tiny SDPA backward outside the budget: torch's first
            ``backward(grad)`` in a process imports sympy, seconds that are not the race).
        progress: called with each :class:`Point` as it is measured.

    Returns:
        The measured :class:`Crossovers` (``calibrated=True``). On any failure or interrupt (Ctrl-C):
        the defaults with ``failure`` set, after one warning; the file is left as it was.

    Raises:
        ValueError / TypeError: a bad ``budget_s`` or ``threads`` (named, with what was got).
    """
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not (0 < budget_s < math.inf):
        raise ValueError(f"budget_s: expected a number of seconds > 0, got {budget_s!r}. Pass e.g. budget_s=2.0.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected a whole number >= 1 or None (torch's current count), got {threads!r}.")
    clock = _clock
    t0 = clock()
    try:
        load: float | None = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    deadline = t0 + float(budget_s)
    before = torch.get_num_threads()
    n = before if threads is None else threads
    was_measuring = _local.measuring
    points: list[Point] = []
    order_points: list[OrderPoint] = []
    try:
        _local.measuring = True
        if n != before:
            torch.set_num_threads(n)
        if backward:  # outside the budget (in the time reported): not part of the race
            from .backends import _native

            if _native.available():  # (else nothing is measured: the first point says why)
                _warm_backward()
                deadline = clock() + float(budget_s)
        for case, dtype, L, S, mode in _plan(backward):
            if clock() >= deadline:
                break
            # what one round of this point costs, from the nearest smaller one measured (work grows as L·S): a
            # warm-up and the fewest rounds must fit in what is left, else it is skipped (a cheaper point later
            # may still fit); _measure_point then runs only the rounds that fit
            near = [p for p in points if p.L * p.S <= L * S]
            last = max(near, key=lambda p: p.L * p.S) if near else None
            est = 0.0 if last is None else (last.kernel_ms + last.sdpa_ms) / 1e3 * (L * S) / (last.L * last.S)
            if clock() + (1 + _MIN_ROUNDS) * est > deadline:
                continue
            if case == "order":  # (its own rounds within the deadline; none when they would not fit)
                order_points += _measure_order(deadline, clock)
                continue
            try:
                got = _measure_point(case, dtype, L, mode == "fwd+bwd", deadline, clock, S=S)
            except _NoKernel:
                if dtype == "float32":
                    raise
                continue  # the kernel refuses this dtype here: its rule stays today's
            if got is None:
                continue  # does not fit in what is left; a cheaper point later may
            tk, ts, rounds = got
            p = Point(case, dtype, L, S, mode, tk * 1e3, ts * 1e3, rounds)
            points.append(p)
            if progress is not None:
                progress(p)
        values, kept = _decide(points, backward, order_points)
        key = machine_key(n)
        elapsed = clock() - t0
        path = cache_path(n) if write else None
        created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        data = {"key": key, "created": created, "budget_s": float(budget_s), "elapsed_s": round(elapsed, 3),
                "load_before": load,  # the 1-minute load average as it began: high means shared cores, noisy times
                "crossovers": values, "defaults_kept": kept, "points": [dataclasses.asdict(p) for p in points],
                "order_points": [dataclasses.asdict(p) for p in order_points],
                "defaults": {"native_causal_min": DEFAULT_NATIVE_CAUSAL_MIN,
                             "native_dense_min_ls": DEFAULT_NATIVE_DENSE_MIN_LS, "bf16": None, "fp16": None,
                             "bf16_grad": None, "bf16_small": None, "fp16_small": None, "few_rows_grad": None,
                             "decode_order": None, "small_mask": None}}
        unstored = None
        if path is not None:
            try:
                _write_atomic(path, data)
            except OSError as e:  # measured, but the cache cannot take it: this process still decides by it
                unstored = f"{type(e).__name__}: {e}"
                warnings.warn(f"attnkit: the calibration could not be stored in {_home(path)} ({unstored}); this "
                              f"process uses it, the next starts from the defaults. Set {ENV_DIR} to a writable "
                              "folder.", RuntimeWarning, stacklevel=2)
                path = None
        source = _source(key, created[:10], path, kept)
        if unstored is not None:
            source = source.replace(" (not written)", f" (not stored: {unstored})", 1)
        result = Crossovers(**values, source=source, calibrated=True,
                            path=None if path is None else str(path), points=tuple(points),
                            order_points=tuple(order_points), elapsed_s=elapsed)
    except _NoKernel as e:  # nothing to measure: not a failure, nothing written
        return Crossovers(source=f"defaults (nothing to calibrate: {e})", failure=str(e), points=tuple(points),
                          elapsed_s=clock() - t0)
    except (Exception, KeyboardInterrupt) as e:
        what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed ({type(e).__name__}: {e})"
        warnings.warn(f"attnkit: the calibration {what}; nothing was written: auto decides as before "
                      "(by the calibration stored for this machine if there is one, else the defaults). "
                      "Run `attnkit calibrate` to try again.", RuntimeWarning, stacklevel=2)
        return Crossovers(source=f"defaults (calibration {what})", failure=what, points=tuple(points),
                          elapsed_s=clock() - t0)
    finally:
        _local.measuring = was_measuring
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
    if write:
        _MEMO[n] = result  # this process decides by it from now on (the memo is per process, not per switch)
        _forget_decisions()
    return result


def _write_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same folder, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
