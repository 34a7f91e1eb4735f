"""The repeated call in a dictionary lookup: ``auto``'s decision for a call signature, remembered and replayed.

A decode step or a short prompt runs a kernel of 10-100 µs; the full path (``make_request`` →
the kernel table → the kernel) costs 20-40 µs of Python around it, and a model makes the same call,
with the same shapes and options, at every layer of every step. So the first call of a signature
takes the full path and, where the kernel the table chose can replay itself
(:meth:`attnkit.backends.sdpa.Fused.replay`), its prepared call is kept under that signature; the
next call with the same signature runs it directly. No rule is restated here: the table decides,
once per signature.

The signature holds everything the table's decision reads that can change between calls
(:func:`_signature`): the tensors' type, shapes, dtypes, devices and whether each wants a
gradient, the grad mode, the mask (a built-in mask is an immutable value, keyed by itself; a
user's ``mask_mod`` — bare, in ``&`` ``|`` ``~`` or in a plan — and a score_mod by their content
key: code plus the values they read, tensors by a digest of their bytes taken on this call; a
tensor mask by its shape, dtype, device and gradient flag — its *values* are the call's own: a replayed call
reads them at every call where the decision did (the decode entry takes a bool mask whose rows are one stretch of
keys each, read off that call's mask; a mask it refused for its values is asked again per call, and the full path
serves one it would now take; the kernel's bf16 call with gradients, a decision the values do not enter, runs the
forward and backward prepared for the mask's content, a digest of its bytes — from 64 KB on, of its tile map read in
C — taken at every call; the kernel's call without gradients reads each call's mask into its tile map in C and, above
one tile, hands a call whose mask the route would send elsewhere to the full path), ``causal``, the
kind of ``scale``, the thread count and the switches tests flip (``tiled.NATIVE`` / ``tiled.FUSED``). A replayed
call returns
``None`` where the full path must look closer (an all-zero output row: torch's CPU kernel writes
zeros where a row's scores hold NaN/inf; a NaN row: an inf in a key the mask hides reaches the row
there) and the caller then takes the full path.

A decode loop makes every step a new signature (the cache is one key longer): where the chosen kernel's decision
does not read the key count S (the decode entry's ``replay_family``), one prepared call serves the signature
without S, re-deriving per step what depends on S (the user's mask and score_mod validated at S, the row
intervals, the score program's bound) and handing the call to the full path where anything differs. A user's
``mask_mod`` and a plan (a ``BlockMask``) enter the family by their code alone, a tensor mask by its shape with S
as -1 (its rank kept): a decode loop builds a new mod (or
BlockMask) at every step, capturing the step's offset, and the family's call evaluates each call's *own* mod at
every point of its few rows (``native._dense_row_intervals``): nothing learned from an earlier step's mod is used
but the decision.

Not replayed: NumPy inputs, dropout, lse / weights / sinks, named backends, a score_mod where
gradients are wanted, mods without a key (reading a list, a dict, an object's attribute: their
data may change unseen), the logger at DEBUG (the full path logs every decision).
"""

from __future__ import annotations

import logging
import types
from collections import OrderedDict, deque
from math import isfinite as _isfinite

import torch

from . import _calibrate, _dispatch, _lru, _mods
from . import masks as _masks
from . import plans as _plans
from . import score_mods as _score_mods
from ._request import make_request
from .backends import tiled

_T = torch.Tensor
_log = logging.getLogger("attnkit")

# Built-in masks: immutable values (see attnkit.masks), each its own key; and the masks a user writes (a mask_mod, the
# combinators & | ~), replayed where they have a content key (their code and the values it reads: Mask.cache_key).
MASKS = _masks.BUILT_IN | {_masks.FromMod, _masks.And, _masks.Or, _masks.Not, types.FunctionType, _plans.BlockPlan}

_REPLAY: OrderedDict = OrderedDict()  # signature -> the prepared call, or None (this signature takes the full path)
_REPLAY_MAX = 512
# signatures holding a mask keyed by identity (a document's ids, a key-padding pattern: their own tensors), newest
# last: a model that builds a new such mask every step must not fill the cache with masks it never uses again
_BY_IDENTITY: deque = deque()
_BY_IDENTITY_MAX = 8
# A decode loop brings one key more every step: a new signature each time. A kernel whose decision does not read S
# (the decode entry: ``replay_family``) prepares one call for every S, kept under the signature without S (its
# "family"): a step of a new length runs it (it re-derives what does depend on S, or returns None: the full path).
_FAMILY: OrderedDict = OrderedDict()
_FAMILY_MAX = 64
_threads = torch.get_num_threads
_grad = torch.is_grad_enabled
_transform_level = torch._C._functorch.maybe_current_level  # None outside torch.func's grad / vmap / jacrev


def _signature(q, k, v, mask, causal, scale, score_mod=None):
    """Everything the decision for this call reads that can change between calls (see the module docstring)."""
    # a built-in mask is an immutable value: its cache_key() (e.g. ("sliding_window", 128, align): equal for equal
    # masks built anew each call), or the mask itself, which the key keeps alive (so even its identity is safe)
    m: object
    if type(mask) is _T:
        m = (mask.shape, mask.dtype, mask.device, mask.requires_grad)
    elif mask is None:
        m = None
    elif type(mask) is types.FunctionType:  # a mask_mod passed as it is: the key from_mod(mask) would have
        m = _mods.value_key(mask)
        if m is None:
            return None
        m = ("from_mod", m)
    else:
        m = mask.cache_key()
        if m is None:  # a mask with no key (a mod reading data the key cannot follow) is never replayed: its None
            return None  # would stand for "no mask" in the signature
    sm: object = None
    if score_mod is not None:  # a score_mod by its content key (code and the values it reads), as a mask_mod
        sm = _mods.value_key(score_mod) if type(score_mod) is types.FunctionType else _score_key(score_mod)
        if sm is None:
            return None
    # devices: True where all three are on the CPU (one check, no device objects built), else the three; gradients:
    # False under no_grad (nothing the decision reads can want one: Request.requires_grad), else the three flags
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
            (q.is_cpu and k.is_cpu and v.is_cpu) or (q.device, k.device, v.device),
            _grad() and (q.requires_grad, k.requires_grad, v.requires_grad), m, causal,
            type(scale), _threads(), tiled.NATIVE, tiled.FUSED, sm)


_MASK_AT = 8  # where _signature puts the mask's key
_SCORE_AT = 14  # and the score_mod's


_score_key = _score_mods.builtin_key  # an attnkit score mod's own content key, or None (a subclass has none)


def attention(q, k, v, mask, causal, scale, score_mod=None):
    """``out`` for a call whose signature has a replayable decision, else None (take the full path)."""
    if type(q) is not _T or type(k) is not _T or type(v) is not _T or _log.isEnabledFor(logging.DEBUG):
        return None
    if _transform_level() is not None:  # inside a torch.func transform: the full path (its tensors have no memory)
        return None
    if causal is not True and causal is not False:
        return None
    if scale is not None:
        if (type(scale) is not float and type(scale) is not int) or not _isfinite(scale) or scale <= 0:
            return None  # the full path says what is wrong with it (or rewrites a scale <= 0: positive_scale)
        scale = float(scale)
    key = _signature(q, k, v, mask, causal, scale, score_mod)
    if key is None:
        return None
    try:
        run = _REPLAY[key]
    except KeyError:
        fam = _lru.get(_FAMILY, _family(key), None)
        if fam is not None:
            exact = getattr(fam, "exact", None)
            if exact is not None:  # a user's mod, new this step: its prepared call kept for this exact signature
                run = exact(q, k, v, mask)  # (the same mod at the model's other layers replays it)
                if run is not None:
                    _keep(key, run)
                    return run(q, k, v, mask, scale)
            else:
                out = fam(q, k, v, mask, scale)
                if out is not None:
                    return out
        run = _learn(key, q, k, v, mask, causal, scale, score_mod)
    except TypeError:  # an unhashable part (cannot happen for the types above; kept for safety)
        return None
    if run is None:
        return None
    return run(q, k, v, mask, scale)


_USERS = frozenset(("from_mod", "plan", "And", "Or", "Not"))  # mask keys that may hold a user's mod


def _family(key):
    """The signature without the key count S (k's and v's third dim; a tensor mask's last), for 4-d inputs, and with
    a user's ``mask_mod`` by its code alone (the values it captures left out: a decode loop's mod captures the
    step's offset, a new value every step; the family's call evaluates the call's own mod at every step); None
    otherwise."""
    ks, vs = key[1], key[2]
    if len(ks) != 4 or len(vs) != 4:
        return None
    m = key[_MASK_AT]
    if type(m) is tuple and type(m[0]) is torch.Size:  # a tensor mask: its shape with the key count S as -1
        m = ((*m[0][:-1], -1) if len(m[0]) and m[0][-1] == ks[2] else tuple(m[0]), *m[1:])  # (its rank kept)
    elif type(m) is tuple and m[0] in _USERS:
        m = _plan_family(m) if m[0] == "plan" and len(m) == 4 else _mods.code_only(m)
    return (key[0], (ks[0], ks[1], ks[3]), (vs[0], vs[1], vs[3]), *key[3:_MASK_AT], m, *key[_MASK_AT + 1:])


def _plan_family(m):
    """A plan's key (``("plan", mask key, (B, H, L, S), block)``) without what is this S's (its sizes' S; a
    BlockMask's kinds) or this step's (its mod's captured values): its block size and its mod's code."""
    inner = m[1]
    if type(inner) is tuple and len(inner) == 4 and inner[0] == "block_mask":
        inner = ("block_mask", inner[2], _mods.code_only(inner[3]))
    else:
        inner = _mods.code_only(inner)
    return ("plan", inner, m[2][:3], m[3])


def _learn(key, q, k, v, mask, causal, scale, score_mod):
    """The full path's decision for this signature, and the kernel's prepared call if it replays itself."""
    if q.is_neg() or k.is_neg() or v.is_neg():  # a lazily negated view (torch._neg_view): the full path reads its
        return None  # values; a replay would read its memory (not remembered: the next plain call learns)
    try:
        req = make_request(q, k, v, mask=mask, causal=causal, scale=scale, score_mod=score_mod, dropout_p=0.0,
                           return_lse=False, backend="auto")
    except (TypeError, ValueError):
        return None  # the full path raises the error, with its message
    d = _dispatch.decide(req, "auto")
    replay = getattr(d.kernel, "replay", None)
    run = None if replay is None or req.input_rank != 4 or req.numpy_in else replay(req, mask)
    family = getattr(d.kernel, "replay_family", None)
    if run is not None and family is not None:
        fam = family(req, mask, causal)
        if fam is not None:
            _lru.put(_FAMILY, _family(key), fam, _FAMILY_MAX)
    _keep(key, run)
    return run


def _keep(key, run) -> None:
    """``run`` (or None: the full path) remembered for the signature ``key``."""
    _lru.put(_REPLAY, key, run, _REPLAY_MAX)
    if isinstance(key[_MASK_AT], _masks.Mask) or _mods.holds_data(key[_MASK_AT]) or _mods.holds_data(key[_SCORE_AT]):
        # keyed by a tensor's identity or content (a document's ids, a mod reading the batch's lengths): a few kept
        _BY_IDENTITY.append(key)
        if len(_BY_IDENTITY) > _BY_IDENTITY_MAX:
            _REPLAY.pop(_BY_IDENTITY.popleft(), None)


def clear() -> None:
    """Forget every remembered decision (tests; a change the signature cannot see, e.g. calibration)."""
    _REPLAY.clear()
    _BY_IDENTITY.clear()
    _FAMILY.clear()


_calibrate._ON_NEW_TABLE.append(clear)  # a new table in this process (forget, calibrate): the routes decided anew
