"""LayerNorm's and RMSNorm's plain-PyTorch math, below ``slimgrad.ops`` and ``slimgrad.kernels``.

The ops (``slimgrad/ops/layer_norm.py`` and ``ops/rms_norm.py``, whose docstrings have the math,
the Memory lines and NOTE [Normalization from its output: the fallback channels]) and their Triton
kernels (``slimgrad/kernels/layer_norm.py``, ``kernels/rms_norm.py``, which fall back to these for
float64 and rows too long for a tile) share: the fallback channels (:func:`fallback_channels`), the
rebuild of xhat from the output (:func:`rebuild_xhat`), and each norm's forward and chunked
backward (:func:`layer_norm_fwd_torch` / :func:`layer_norm_bwd_torch`, :func:`rms_norm_fwd_torch` /
:func:`rms_norm_bwd_torch`; the ops' ``_fwd_torch`` / ``_bwd_torch``). ``ops/group_norm.py`` uses
the same helpers. NOTE [Kernels are leaves] in ``slimgrad._math``.
"""

from __future__ import annotations

import bisect
import math
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from slimgrad import _ext
from slimgrad._autograd import compiling
from slimgrad._math import steps
from slimgrad._math.steps import anchor, epoch

try:  # NOTE [A search the modes never see] below
    from torch.utils._python_dispatch import _disable_current_modes as _modes_aside
except ImportError:  # pragma: no cover - depends on the torch release
    _modes_aside = None

__all__ = [
    "BETA_OVER_GAMMA_MAX",
    "CHUNK_ELEMS",
    "acc_dtype",
    "fallback_channels",
    "fallback_or_none",
    "layer_norm_bwd_torch",
    "layer_norm_fwd_torch",
    "layer_norm_gamma",
    "rebuild_xhat",
    "rms_norm_bwd_torch",
    "rms_norm_fwd_torch",
    "rowdot",
    "side_columns",
    "unseen",
]

#: A channel is rebuilt from the output only where ``|beta| <= BETA_OVER_GAMMA_MAX * |gamma|``: the
#: rebuilt xhat then errs by at most ~eps * (|xhat| + 2), which keeps every gradient within the
#: error rule (dense seed sweep in fp32/bf16/fp16; 4 already failed it once in 640 fp32 cases).
BETA_OVER_GAMMA_MAX = 2.0
#: Backward processes rows in chunks of max(CHUNK_ELEMS, numel / 16) elements: fp32 temporaries
#: stay a small fraction of the dropped input, with at most ~16 chunks of Python overhead.
CHUNK_ELEMS = 1 << 15


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # sum(a * b, dim=1, keepdim=True) for (rows, d) tensors as a batched GEMV: no (rows, d) product.
    return bmm_exact(a.unsqueeze(1), b.unsqueeze(2)).view(-1, 1)


# NOTE [Row dots without autocast]
# The norms' backwards take their row dots as a bmm (no (rows, D) product). bmm is one of
# autocast's lower-precision ops, and these backwards keep autocast as it is (``_AUTOCAST_BLIND``
# in slimgrad/_autograd.py: every other op in them is elementwise or a reduction), so a backward
# run inside ``torch.autocast`` took its row dots in bfloat16: the gradients upstream of a
# converted RMSNorm moved by a bf16 rounding (Linear -> RMSNorm -> Linear at 4 x 16 x 64: 2.4e-4
# at a gradient scale of 0.056, where eager's own backward gives the same bits inside or outside
# autocast). The bmm runs with autocast off where any autocast is on: the same bits as the
# backward outside autocast. The C++ body (``_ext/backward.cpp``) excludes autocast's keys too.
_any_autocast = torch._C._is_any_autocast_enabled


def bmm_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm`` in its operands' dtype, autocast or not (NOTE [Row dots without autocast])."""
    if _any_autocast():
        with torch.autocast(a.device.type, enabled=False):
            return torch.bmm(a, b)
    return torch.bmm(a, b)


def rebuild_xhat(y: torch.Tensor, w, b, acc: torch.dtype) -> torch.Tensor:
    # xhat = (y - b) / w in acc, as a fresh tensor (the caller updates it in place).
    t = y.to(acc, copy=True)
    if b is not None:
        t.sub_(b)
    if w is not None:
        t.div_(w)
    return t


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# NOTE [Fallback channels, once per weight version]
# The fallback channels (NOTE [Normalization from its output: the fallback channels] in
# ops/layer_norm.py) depend only on the weight and bias values and the output dtype. Finding them
# takes a ``nonzero``: on CUDA a host sync (the CPU waits for the GPU), once per norm per forward,
# 25 per GPT-2 step. So they are found once per *version* of the parameters: the answer is kept per
# (weight, bias) pair of tensor objects (by id, anchored on their storages: NOTE [Caches that hold
# no reference to a parameter] in _math/steps.py), keyed by each one's data pointer, strides, dtype
# and autograd version counter, which every in-place write that autograd can see bumps (optimizer
# steps, ``copy_``/``fill_`` under no_grad, ``load_state_dict``; views share their base's counter).
# Each call still returns a tensor of its own (a 0-element one, or a copy; on the straight path,
# :func:`fallback_or_none`, None when there is no fallback channel: nothing saved), so what a
# forward saves and what the memory tracker counts are unchanged. What the key cannot see: a write
# that bypasses the version counter (``weight.data.mul_(...)``, a raw kernel or collective writing
# into the parameter's memory): code that does that and then changes which channels are fallback
# channels must call ``torch.autograd.graph.increment_version(weight)``, as autograd's own in-place
# checks would need too. Inference-mode, fake and subclass tensors, and code being compiled, take no
# cache.
#
# The key's parameter facts are read by :func:`_norm_key`: in Python, six attribute reads per
# tensor; once slimgrad's C++ extension is loaded (``_ext.when_loaded``: never built for this),
# by its ``norm_key`` in one call, the same facts as ints (version, data pointer, dtype, device,
# dims, sizes, strides). The data pointer, shape, strides and dtype stay in the key because
# ``p.data = ...`` (``Module.to``, a user's swap) changes them and leaves ``_version`` as it was.
# Both keys are equal exactly when those facts are, so the same calls hit and miss; entries stored
# under the Python form before the extension loaded miss once and are found again (the same
# channels). An entry also keeps whether it has any channel, so a hit makes no ``idx.shape``.
_FB_CACHE: dict[int, tuple] = {}


# NOTE [A search the modes never see]
# The per-version searches of the norms (the fallback channels here; GroupNorm's channels and
# non-finite groups in ops/group_norm.py) are caches of the parameters and run with the dispatch
# modes set aside, for the reason NOTE [A channel search no mode sees] in ops/batch_norm.py gives
# for BatchNorm's. Measured here: selective checkpointing around LayerNorm -> Linear raised
# CheckpointError (different metadata) or "Autograd not support dtype: Long" from every step's
# first forward, the search's abs/nonzero having gone into SAC's cache in the forward and not in the
# recompute (a cache hit there). ``unseen(fn, *args)`` is that call; the callers use it for cached
# searches only (an uncached one runs in the forward and its recompute alike).
def unseen(fn, *args):
    if _modes_aside is None:
        return fn(*args)
    with _modes_aside():
        return fn(*args)


def _py_norm_key(weight, bias):
    # (weight part, bias part): None, or (version, data_ptr, dtype, shape, stride, device)
    w_key = b_key = None
    if weight is not None:
        w_key = (weight._version, weight.data_ptr(), weight.dtype, weight.shape)
        w_key += (weight.stride(), weight.device)
    if bias is not None:
        b_key = (bias._version, bias.data_ptr(), bias.dtype, bias.shape, bias.stride())
        b_key += (bias.device,)
    return w_key, b_key


_norm_key = _py_norm_key  # the extension's norm_key once it is loaded (_use_ext_key)


def _use_ext_key(mod) -> None:
    global _norm_key
    fn = getattr(mod, "norm_key", None)
    if fn is not None:
        _norm_key = fn


_ext.when_loaded(_use_ext_key)


def _key(t: torch.Tensor | None):
    if t is None:
        return None
    return (t.data_ptr(), t._version, t.dtype, t.shape, t.stride(), t.device)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_Parameter = torch.nn.Parameter


def _cacheable(t: torch.Tensor | None) -> bool:
    return t is None or (type(t) in _PLAIN and not t.is_inference())


def _fresh(idx: torch.Tensor) -> torch.Tensor:
    # a tensor of the caller's own (saved by the op, counted by the tracker as a new one)
    if idx.numel() == 0:
        return torch.empty(0, dtype=idx.dtype, device=idx.device)
    return idx.clone()


def fallback_channels(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gamma_of=None,
) -> torch.Tensor:
    """Indices (int64, flat over the normalized dims) of channels that keep their input column,
    found once per version of ``weight`` and ``bias`` (NOTE [Fallback channels, once per weight
    version]); ``gamma_of`` as in :func:`fallback_or_none`."""
    if weight is None and bias is None:
        dev = torch.device("cpu")
        return torch.empty(0, dtype=torch.int64, device=dev)
    ref = weight if weight is not None else bias
    # a Tensor or Parameter is never fake (a fake parameter is a FakeTensor)
    if type(ref) not in _PLAIN and torch._subclasses.fake_tensor.is_fake(ref):
        # Fake weights have no values (slimgrad.memory.estimate): assume no fallback channel.
        return torch.empty(0, dtype=torch.int64, device=ref.device)
    # _cacheable and the key for both; an inference tensor has no version counter: reading
    # _version raises for it (no is_inference() call per norm)
    if (weight is not None and type(weight) not in _PLAIN) or (
        bias is not None and type(bias) not in _PLAIN
    ):
        return _find_scaled(weight, bias, out_dtype, gamma_of)
    if (weight is not None and type(weight) is not _Parameter and not weight.requires_grad) or (
        bias is not None and type(bias) is not _Parameter and not bias.requires_grad
    ):
        # a tensor nothing pins (NOTE [Caches that hold no reference to a parameter] in
        # _math/steps.py): searched each call
        return _find_scaled(weight, bias, out_dtype, gamma_of)
    try:
        w_key, b_key = _norm_key(weight, bias)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return _find_scaled(weight, bias, out_dtype, gamma_of)
    if compiling():  # NOTE [One-frame compile check] in slimgrad/_autograd.py
        return _find_scaled(weight, bias, out_dtype, gamma_of)
    # + optimizer steps (NOTE [Steps that skip the version counter] in _math/steps.py); epoch()
    # without its frame once its hook is in place
    key = (w_key, b_key, out_dtype, steps._count[0] if steps._hooked[0] else epoch())
    if gamma_of is not None:
        key += (gamma_of,)
    slot = id(ref)
    # NOTE [Caches that hold no reference to a parameter] in _math/steps.py: the entry at this id
    # whose key (data pointers, versions) matches is this tensor's, its storage anchored
    hit = _FB_CACHE[slot] if slot in _FB_CACHE else None
    if hit is not None and hit[1] == key:
        idx = hit[2]  # _fresh(idx), inline: a tensor of the caller's own
        if idx.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=idx.device)
        return idx.clone()
    # NOTE [A search the modes never see]
    idx = unseen(_find_scaled, weight, bias, out_dtype, gamma_of)
    _store(slot, ref, key, idx, weight, bias, out_dtype, gamma_of)
    return _fresh(idx)


def fallback_or_none(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gamma_of=None,
) -> torch.Tensor | None:
    """:func:`fallback_channels` for a caller past the gate of NOTE [One gate per call] (eager,
    plain tensors: no compile or fake check), or None where there is no fallback channel (the
    common case: nothing to allocate or save). ``gamma_of``: the channels are those of the scale
    ``gamma_of(weight)`` (an HF RMSNorm's ``1 + w``, ...), cached per version of ``weight``."""
    if weight is not None:
        ref = weight
    elif bias is not None:
        ref = bias
    else:
        return None
    try:  # an inference tensor has no version counter: reading _version raises
        if (weight is not None and type(weight) is not _Parameter and not weight.requires_grad) or (
            bias is not None and type(bias) is not _Parameter and not bias.requires_grad
        ):
            # a tensor nothing pins (NOTE [Caches that hold no reference to a parameter] in
            # _math/steps.py): searched each call
            raise RuntimeError
        w_key, b_key = _norm_key(weight, bias)
    except RuntimeError:  # "Inference tensors do not track version counter"
        idx = _find_scaled(weight, bias, out_dtype, gamma_of)
        return idx if idx.shape[0] else None
    # the key of fallback_channels, the same cache (NOTE [Fallback channels, once per weight
    # version])
    key = (w_key, b_key, out_dtype, steps._count[0] if steps._hooked[0] else epoch())
    if gamma_of is not None:
        key += (gamma_of,)
    slot = id(ref)
    hit = _FB_CACHE[slot] if slot in _FB_CACHE else None
    if hit is None or hit[1] != key:
        # NOTE [A search the modes never see]
        idx = unseen(_find_scaled, weight, bias, out_dtype, gamma_of)
        hit = _store(slot, ref, key, idx, weight, bias, out_dtype, gamma_of)
    return hit[2].clone() if hit[4] else None  # a tensor of the caller's own


def _find_scaled(weight, bias, out_dtype, gamma_of):
    if gamma_of is not None and weight is not None:
        with torch.no_grad():
            weight = gamma_of(weight.detach())
    return _find_fallback_channels(weight, bias, out_dtype)


def _find_fallback_channels(weight, bias, out_dtype):
    return torch.nonzero(_fallback_mask(weight, bias, out_dtype)).reshape(-1)


def _fallback_mask(weight, bias, out_dtype):
    # True at the fallback channels (flat): computed on the parameters' device, no host read
    ref = weight if weight is not None else bias
    acc = acc_dtype(ref.dtype)
    w = weight.detach().reshape(-1).to(acc) if weight is not None else None
    b = bias.detach().reshape(-1).to(acc) if bias is not None else None
    aw = w.abs() if w is not None else torch.ones_like(b)
    ok = aw >= torch.finfo(out_dtype).tiny
    if b is not None:
        ok &= b.abs() <= BETA_OVER_GAMMA_MAX * aw
    # isfinite(aw), for aw = |w| >= 0 or NaN: aw <= the largest finite value (False for inf and
    # NaN), the same booleans in one op where isfinite's composite makes four
    ok &= aw <= torch.finfo(acc).max
    return ~ok


# NOTE [Fallback channels renewed at the optimizer step]
# A training loop's optimizer step writes every norm's weight, so the next forward of each norm
# found its key stale and ran a ``nonzero`` (NOTE [Fallback channels, once per weight version]):
# on CUDA one host sync per norm per step inside the forward, where the GPU queue is deepest and
# a captured step (CUDA graphs) cannot have any. So the answers are renewed in the optimizer step
# itself: a global optimizer step post-hook (``register_optimizer_step_post_hook``, public API,
# registered once after the epoch counter's, so it runs after that count moved) recomputes, for
# every cache entry whose weight or bias that optimizer holds, the fallback mask on the device,
# concatenates the masks of each device and reads once whether any channel falls back (``any``):
# one host read per device per optimizer step, not one per norm in the forward (an entry of
# another optimizer's parameters is left to its next forward, as before). Only a device where
# some channel falls back runs one ``nonzero`` over the masks and reads the positions (a second
# read); the common answer, none, costs no ``nonzero`` and no index list (tiny HF Llama, 5 norms,
# SGD: 11 ATen ops per renewal, 14 before, ``tests/test_compile_renew.py``; the mask's
# ``isfinite`` is one compare against the largest finite value, the same booleans). The ids of an
# optimizer's parameters are kept between its steps (``_stepped_ids``). Each entry is stored
# under the key the next forward computes (the parameters' versions and the step count after
# the step), so that forward hits the cache and reads no device value; when it does not hit
# (another write after the step, a new dtype), it finds its channels itself as before. An
# optimizer step being compiled renews nothing (the forward then finds them itself). A compiled
# HF RMSNorm reads no entry: it runs HF's ops inside a checkpoint, with no fallback table (NOTE
# [RMSNorm's backward traced under torch.compile] in ops/rms_norm.py); the uncompiled norm's
# ``hf_rms_norm_side`` op (off the straight path) reads the renewed entries at run time.
#
# NOTE [Another optimizer's step]
# The key counts every optimizer step in the process (NOTE [Steps that skip the version counter]
# in _math/steps.py), so with two optimizers (two models trained in one process, a GAN's generator
# and discriminator, one model's parameters split between two optimizers) each step made the
# entries of the other's parameters stale, and their next forwards missed the cache and ran a
# ``nonzero`` each (the compile_step benchmark steps compiled eager and the converted model
# alternately in one process: 5 per converted tiny-Llama step). A step
# writes only the memory of the parameters its optimizer holds, so the renewal moves every entry it
# does not renew that was current before the step (its count one less) to the new count, keeping
# its versions, unless its weight's or bias's storage shares memory with the storage of a parameter
# this optimizer holds (``w.data = flat.data[:d]``: a step on ``flat`` writes ``w`` without moving
# ``w``'s version; review24c, where the first form of this carried such an entry over). Memory
# ranges are compared, not storage objects or start addresses: ``torch.from_dlpack`` of a slice,
# an ``UntypedStorage`` slice or two numpy views share memory through two storages with two
# starts (review25c). Not seen: one file mapped twice (two addresses, one memory). A write that
# skips the version counter (``p.data.zero_()``) must call ``increment_version`` (NOTE [Steps that
# skip the version counter]); before this carry, any optimizer's step also repaired such a write,
# now only a step of the optimizer holding that weight does. The storages are read
# from the optimizer's groups at that step (no memo that could miss a swapped parameter), and only
# when some entry is not this optimizer's: one optimizer over the whole model pays nothing. A
# visible write since the step still misses; an entry already stale stays stale.
_RENEW_HOOKED = [False]


def _store(slot, ref, key, idx, weight, bias, out_dtype, gamma_of):
    # a cache entry: (the anchors of weight's and bias's storages, key, idx, how to renew it at an
    # optimizer step: the ids of weight and bias, whether idx has any channel: read per call
    # without making idx's shape); no reference to weight or bias (NOTE [Caches that hold no
    # reference to a parameter] in _math/steps.py)
    how = (
        None if weight is None else id(weight),
        None if bias is None else id(bias),
        out_dtype,
        gamma_of,
    )
    anchors = (anchor(_FB_CACHE, slot, weight), anchor(_FB_CACHE, slot, bias))
    entry = _FB_CACHE[slot] = (anchors, key, idx, how, idx.shape[0] > 0)
    if not _RENEW_HOOKED[0]:
        epoch()  # the counter's hook first: the renewal reads the count after the step
        register_optimizer_step_post_hook(_renew)
        _RENEW_HOOKED[0] = True
    return entry


# {optimizer: (its groups' parameter lists as (id, length), the ids of their parameters)}: the
# set is made again only when a group or a group's length changed. A set that missed an in-place
# swap of one parameter for another (same list, same length) only renews an entry this optimizer
# no longer steps, or leaves one to its next forward: what each entry holds is found from its
# parameters' current values and versions either way.
_STEPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stepped_ids(optimizer) -> set:
    groups = optimizer.param_groups
    sig = tuple([(id(g["params"]), len(g["params"])) for g in groups])
    hit = _STEPPED.get(optimizer)
    if hit is not None and hit[0] == sig:
        return hit[1]
    ids = {id(p) for g in groups for p in g["params"]}
    try:
        _STEPPED[optimizer] = (sig, ids)
    except TypeError:  # an optimizer that cannot be weakly referenced: no memo
        pass
    return ids


def _stepped_storages(optimizer) -> tuple[list, list] | None:
    # the memory ranges [start, end) of the storages of every parameter the optimizer holds, made
    # at this step (no memo: a parameter swapped into a group, or ``p.data = ...``, is seen),
    # merged and sorted: (starts, ends); None where some parameter's memory cannot be read (a
    # DTensor under FSDP2, a tensor subclass without storage): then nothing is carried
    spans = []
    try:
        for g in optimizer.param_groups:
            for p in g["params"]:
                st = p.untyped_storage()
                a = st.data_ptr()
                spans.append((a, a + st.nbytes()))
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    spans.sort()
    starts: list = []
    ends: list = []
    for a, b in spans:
        if starts and a < ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def _untouched(st_ref, written) -> bool:
    # whether the storage ``st_ref`` anchors (None: no tensor) shares no byte with a written
    # range: memory shared through two storage objects (``torch.from_dlpack`` of a slice, an
    # ``UntypedStorage`` slice, two numpy views) has two start addresses, so ranges are compared,
    # not starts (review25c)
    if st_ref is None:
        return True
    s = st_ref()
    if written is None or s is None:
        return False
    try:
        a = s.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    b = a + max(s.nbytes(), 1)
    starts, ends = written
    i = bisect.bisect_right(starts, a) - 1  # the last range starting at or before a
    if i >= 0 and ends[i] > a:
        return False
    return not (i + 1 < len(starts) and starts[i + 1] < b)


def _renew(optimizer=None, args=None, kwargs=None) -> None:
    # NOTE [Fallback channels renewed at the optimizer step]; the masks of entries alike found by
    # one _fallback_mask over their concatenated parameters (NOTE [One mask per kind of norm])
    if compiling() or not _FB_CACHE or optimizer is None:
        return
    # the ids of the parameters this optimizer holds; the parameters by id, made at the first
    # entry it holds (an entry holds none: NOTE [Caches that hold no reference to a parameter])
    stepped = _stepped_ids(optimizer)
    held = None
    written = ()  # the storages it writes, made at the first entry it does not hold (() not yet)
    # {(device, scale dtype, bias dtype, out_dtype, slot or None, rows): ([(slot, entry, key,
    # n)], [scales], [biases])}; rows: the scales are LayerNorm weights whose non-finite rule
    # (layer_norm_gamma) is applied per entry over the concatenation (NOTE [One mask per kind of
    # norm])
    kinds: dict = {}
    count = steps._count[0]
    for slot, entry in list(_FB_CACHE.items()):
        anchors, _, _, (wid, bid, out_dtype, gamma_of), _ = entry
        if wid not in stepped and bid not in stepped:
            # not this optimizer's: an entry current before the step whose parameters share no
            # storage with what it steps stays current (NOTE [Another optimizer's step])
            k = entry[1]
            if k[3] == count - 1:
                if written == ():
                    written = _stepped_storages(optimizer)
                if _untouched(anchors[0], written) and _untouched(anchors[1], written):
                    _FB_CACHE[slot] = (
                        anchors,
                        k[:3] + (count,) + k[4:],
                        entry[2],
                        entry[3],
                        entry[4],
                    )
            continue
        if held is None:
            held = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        if (wid is not None and wid not in held) or (bid is not None and bid not in held):
            continue  # a parameter this optimizer does not hold: left to the next forward
        weight = held[wid] if wid is not None else None
        bias = held[bid] if bid is not None else None
        try:
            # the anchors of the storages the renewed key's data pointers are in
            w_st = weight.untyped_storage() if weight is not None else None
            b_st = bias.untyped_storage() if bias is not None else None
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # no storage (a tensor subclass): not cached in the first place
        if (anchors[0]() if anchors[0] is not None else None) is not w_st or (
            anchors[1]() if anchors[1] is not None else None
        ) is not b_st:
            anchors = (anchor(_FB_CACHE, slot, weight), anchor(_FB_CACHE, slot, bias))
        try:
            w_key, b_key = _norm_key(weight, bias)
        except RuntimeError:  # an inference tensor (not cached in the first place)
            continue
        key = (w_key, b_key, out_dtype, count)
        if gamma_of is not None:
            key += (gamma_of,)
        # read under no_grad below (cat, the mask): no detach needed, no graph recorded
        w, b = weight, bias
        rows = gamma_of is layer_norm_gamma and w is not None
        if gamma_of is not None and w is not None and not rows:
            with torch.no_grad():
                w = gamma_of(w.detach())
        n = w.numel() if w is not None else b.numel()
        alone = None
        if w is not None and b is not None and b.numel() != n:
            # weight and bias of different lengths (broadcast): a kind of its own, its mask as long
            # as the broadcast
            alone, n = slot, max(n, b.numel())
        kind = (
            (w if w is not None else b).device,
            None if w is None else w.dtype,
            None if b is None else b.dtype,
            out_dtype,
            alone,
            rows,
        )
        items, ws, bs = kinds[kind] if kind in kinds else kinds.setdefault(kind, ([], [], []))
        items.append((slot, entry, key, n, anchors))
        if w is not None:
            ws.append(w if w.dim() == 1 else w.reshape(-1))
        if b is not None:
            bs.append(b if b.dim() == 1 else b.reshape(-1))
    groups: dict = {}
    with torch.no_grad():
        for (dev, _, _, out_dtype, _, rows), (items, ws, bs) in kinds.items():
            w = (torch.cat(ws) if len(ws) > 1 else ws[0]) if ws else None
            if rows:
                w = _layer_norm_gamma_rows(w, ws)
            b = (torch.cat(bs) if len(bs) > 1 else bs[0]) if bs else None
            mask = _fallback_mask(w, b, out_dtype)
            group = groups[dev] if dev in groups else groups.setdefault(dev, ([], []))
            group[0].extend(items)
            group[1].append(mask)
    for dev, (items, masks) in groups.items():
        mask = torch.cat(masks) if len(masks) > 1 else masks[0]
        # the one host read: whether any channel falls back (the common answer: none, and then
        # no nonzero), else where (NOTE [Fallback channels renewed at the optimizer step])
        if mask.any():
            hits = torch.nonzero(mask).reshape(-1)
            pos = hits.tolist()
        else:
            hits, pos = None, []
        start, j = 0, 0
        empty = None  # one 0-element table for the device (never handed out: callers copy)
        for slot, entry, key, n, anchors in items:
            end = start + n
            a = j
            while j < len(pos) and pos[j] < end:
                j += 1
            if a == j:
                if empty is None:
                    empty = torch.empty(0, dtype=torch.int64, device=dev)
                idx = empty
            else:
                idx = hits[a:j] - start
            if _FB_CACHE.get(slot) is entry:
                _FB_CACHE[slot] = (anchors, key, idx, entry[3], a != j)
            start = end


# NOTE [One mask per kind of norm]
# An optimizer step renews every cached norm's fallback channels (NOTE [Fallback channels renewed
# at the optimizer step]). ``_fallback_mask`` is elementwise in (scale, bias) given the output
# dtype and the scale's dtype (its accumulation dtype), so the entries that share a device, the
# dtypes of their scale (``gamma_of(weight)``, or the weight) and bias, and the output dtype are
# renewed by one mask over their concatenated parameters: entry by entry the same booleans as one
# mask each, in a fixed number of ops per kind instead of per norm (on a GPU each is a launch).
# Tiny HF Llama (12 layers x 64 wide, 25 RMSNorms), AdamW's step: 1,390 ATen ops before, 1,126
# now (eager's step: 1,112). A scale whose ``gamma_of`` is not elementwise is computed per entry
# first; LayerNorm's ``layer_norm_gamma`` (NaN in every channel of a weight with a non-finite
# entry) is applied over the kind's concatenated weights instead, as the rows of one view when the
# weights have one length (``_layer_norm_gamma_rows``): the same scales in four ops per kind, not
# eight per LayerNorm (tiny HF GPT-2, 5 LayerNorms, SGD: 58 ATen ops per renewal before, 25 now;
# 25 LayerNorms: 218 before, 25 now; ``tests/test_compile_gpt2_renew.py``). An entry whose bias
# and weight differ in length is a kind of its own.


# NOTE [LayerNorm with a non-finite gamma]
# Eager's CPU backward (aten's layer_norm_kernel.cpp) sums per row ``ds = sum(dy * gamma * x)``
# and ``db = sum(dy * gamma)``, then ``dx = rstd * dy * gamma + b * x + c`` with ``b = (db * mu -
# ds) * rstd^3 / D`` and ``c = -b * mu - db * rstd / D``. With every value finite the output-
# keeping backward is the same math in another order; with an infinite gamma the order decides
# which values are NaN and which inf: ds and db are inf (NaN where dy is 0), b is inf or NaN by
# whether db * mu and ds cancel, and each dx is NaN or inf by the sign of its own raw x (against
# mu's), which a rebuilt xhat does not carry exactly. So in a LayerNorm whose weight has a
# non-finite entry every channel is a fallback channel (``layer_norm_gamma``, the fallback
# rule's scale: NaN everywhere then; found once per weight version like every fallback set).
# Where every channel falls back (that, or every gamma ~ 0) the Function saves x itself, what
# eager saves, instead of y and a gathered copy of x (``_keep_x`` in ops/layer_norm.py), and the
# backward is eager's own ``aten.native_layer_norm_backward`` on it: eager's bits, NaN/inf
# pattern and bytes (the traced path keeps its tables and runs the same backward here). Before:
# (3, 5, 16) with w[1] = inf gave 141 NaN/99 inf in dx against eager's 222 NaN/18 inf; (29, 97)
# with every channel a fallback channel (gamma 1e-3, beta 5) saved 23,512 B and peaked at 68,916
# B under the tracker, against eager's 11,484 and 23,520 (now equal). A NaN
# gamma already matched (every dx of a row NaN either way), as does RMSNorm (no mean term: its
# dx is NaN or inf by the sign of xhat, which the rebuild keeps), and an inf or NaN beta leaves dx
# finite in both (a fallback channel, whose xhat comes from x).
def _layer_norm_gamma_rows(w: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    # layer_norm_gamma of each of ``parts`` (1-D), given their concatenation ``w``: NOTE [One mask
    # per kind of norm]. Parts of one length (every LayerNorm of a model, the common case) are the
    # rows of one (parts, length) view: four ops for the kind (abs, le, all, where) where one
    # layer_norm_gamma per entry made eight (the composite isfinite among them); the same values
    # (|w| <= the largest finite value is isfinite's boolean, NaN and inf False).
    n = parts[0].numel()
    if any(t.numel() != n for t in parts):
        return torch.cat([layer_norm_gamma(t) for t in parts])  # two or more parts here
    m = w.view(len(parts), n)
    ok = (m.abs() <= torch.finfo(m.dtype).max).all(1, keepdim=True)
    return m.where(ok, float("nan")).view(-1)


def layer_norm_gamma(w: torch.Tensor) -> torch.Tensor:
    """LayerNorm's scale for the fallback rule: ``w``, or NaN in every channel where an entry of
    ``w`` is not finite (NOTE [LayerNorm with a non-finite gamma])."""
    return w.where(torch.isfinite(w).all(), float("nan"))


def layer_norm_fwd_torch(x, normalized_shape, weight, bias, eps):
    y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
    idx = fallback_channels(weight, bias, y.dtype, layer_norm_gamma)
    if idx.device != x.device:
        idx = idx.to(x.device)
    return y, mean, rstd, idx, side_columns(x, math.prod(normalized_shape), idx)


def side_columns(x: torch.Tensor, d: int, idx: torch.Tensor) -> torch.Tensor:
    """x's input columns of the fallback channels ``idx``, (rows, k); no gather when k = 0."""
    if idx.shape[0] == 0:
        return x.new_empty((x.numel() // d if d else 0, 0))
    return x.reshape(-1, d).index_select(1, idx)


# NOTE [LayerNorm fallback backward peak]
# layer_norm_bwd_torch (float32 CPU with a fallback channel, CUDA without Triton, non-contiguous
# input) runs over row chunks of an eighth of the rows (at most an eighth of the shared
# CHUNK_ELEMS chunk), so its temporaries, xhat and the exact float64 products dy * xhat for
# dgamma, are an eighth and a quarter of dx; g = dy * gamma is written into dx's own chunk
# (dy's, when dx overwrites dy: its last read is dgamma's product) where dx is in the acc
# dtype. Every op but dgamma's sum over rows is row-wise, so the chunking leaves dx's bits
# alone; dgamma sums exact float64 products in float64 before its one rounding to the weight's
# dtype, which the grouping does not reach at the error rule's scale (the conformance tests pin
# the bits). The peaks, exact under the tracker: tests/ops/test_layer_norm_fallback_peak.py.
# Against eager's backward (dx, dgamma, dbeta) it holds the fallback columns and indices it saved,
# float64 dgamma and its chunk sum (16 B per channel), and a chunk's xhat and its float64 copy,
# and writes dx into a granted dy (eager allocates dx): on few rows these outweigh dx's bytes
# (LN(w[1] = 1e-9) -> Linear on (3, 16): 2,000 B against eager's 1,760; 95 of 165 shapes of N
# 1-33 x D 2-97 peaked above eager's). So where they would (``layer_norm_bwd_torch_fits``, from
# the shape alone), the forward keeps x instead and the backward is eager's, with eager's bits
# and bytes (``_keeps_x`` in ops/layer_norm.py; on the PyTorch and C paths, not Triton's): every
# shape of that sweep then at most eager's (tests/ops/test_layer_norm_tiny_shapes.py).
# Without a fallback channel the same temporaries (xhat's chunk, its float64 products, the float64
# sums) are made wherever this backward runs: float64, or float32 without the C kernel. There the
# same check (k = 0) decides, and where x is a leaf of the graph, which the graph's AccumulateGrad
# node holds anyway, keeping y saves nothing and x is kept at any extra (``_torch_bwd_over`` in
# ops/layer_norm.py). Before: float64 LayerNorm((4, 5)) on a (4, 5) input between Linears peaked
# 1,224 B against eager's 1,064; Linear -> ReLU -> LayerNorm(5) -> Linear at (3, 5), 880 against
# 784; LayerNorm(64) on a (4, 64) leaf, 40,024 against 39,496.
def layer_norm_bwd_torch(
    dy, y, mean, rstd, idx, xside, weight, bias, normalized_shape, output_mask, out=None
):
    # Row chunks bound the fp32 temporary xhat (g lives in dx: NOTE [LayerNorm fallback backward
    # peak]); dgamma and dbeta accumulate in float64 (fp32 sums over rows exceeded the error rule
    # at small shapes in the seed sweeps). Runs without
    # grad mode only (double backward runs norm_double, ops/layer_norm.py), so in-place updates of
    # the temporaries are safe.
    # out: dy itself (contiguous, y's dtype) when its buffer is dead (slimgrad.ownership.take); dx
    # is then written into it chunk by chunk, each chunk after its last read (dbeta reads dy first).
    acc = acc_dtype(y.dtype)
    d = math.prod(normalized_shape)
    n = math.prod(y.shape[: y.dim() - len(normalized_shape)])
    if d and idx is not None and idx.shape[0] == d:
        # every channel kept its input (idx is then 0..D-1 in order): eager's own backward on it
        # (NOTE [LayerNorm with a non-finite gamma])
        mask = [bool(output_mask[0]), weight is not None and bool(output_mask[1])]
        mask.append(bias is not None and bool(output_mask[2]))
        x = xside.reshape(y.shape)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, x, normalized_shape, mean, rstd, weight, bias, mask
        )
        return dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None
    dy2, y2 = dy.reshape(n, d), y.reshape(n, d)
    mu, r = mean.reshape(n, 1), rstd.reshape(n, 1).to(acc)
    w = weight.reshape(d).to(acc) if weight is not None else None
    b = bias.reshape(d).to(acc) if bias is not None else None
    need_dx, need_dw = output_mask[0], weight is not None and output_mask[1]
    db = None
    if bias is not None and output_mask[2]:
        db = dy2.sum(0, dtype=torch.float64).to(bias.dtype).reshape(bias.shape)
    if need_dx:
        dx = out.view(n, d) if out is not None else y.new_empty((n, d))
    dw = None  # the first chunk's float64 sum, then the others added (0 + s is s, bit for bit)
    step = _bwd_rows(n, d)
    for i in range(0, n, step):
        sl = slice(i, i + step)
        xh = rebuild_xhat(y2[sl], w, b, acc)
        if idx is not None and idx.numel():
            xh.index_copy_(1, idx, (xside[sl].to(acc) - mu[sl]) * r[sl])
        dyc = dy2[sl].to(acc)
        if need_dw:  # exact float32 products, summed in float64
            s = xh.to(torch.float64, copy=True).mul_(dyc).sum(0)
            dw = s if dw is None else dw.add_(s)
            del s
        if need_dx:
            if dx.dtype == acc:  # g in dx's own chunk (dy's when out is dy: read last above)
                g = dx[sl]
                if w is not None:
                    torch.mul(dyc, w, out=g)
                else:
                    g.copy_(dyc)
            else:
                g = dyc * w if w is not None else dyc.clone()
            c1 = g.mean(1, keepdim=True)
            c2 = rowdot(g, xh).div_(d)  # no chunk-sized temporary
            g.sub_(c1).sub_(xh.mul_(c2)).mul_(r[sl])
            if g.data_ptr() != dx[sl].data_ptr():
                dx[sl] = g
            del g
        del xh, dyc  # free this chunk's temporaries before the next one
    if need_dx:
        dx = dx.reshape(y.shape)
    else:
        dx = None
    if need_dw:
        if dw is None:  # no rows
            dw = torch.zeros(d, dtype=torch.float64, device=y.device)
        dw = dw.to(weight.dtype).reshape(weight.shape)
    return dx, dw, db


def _bwd_rows(n: int, d: int) -> int:
    # layer_norm_bwd_torch's rows per chunk: an eighth of the rows, at most an eighth of the
    # shared chunk (NOTE [LayerNorm fallback backward peak])
    return max(1, min(max(CHUNK_ELEMS, (n * d) // 16) // max(d, 1) // 8, -(-n // 8)))


def layer_norm_bwd_torch_fits(n: int, d: int, k: int, itemsize: int) -> bool:
    """Whether :func:`layer_norm_bwd_torch` on ``n`` rows of ``d`` with ``k`` fallback channels
    holds at most what eager's backward holds (NOTE [LayerNorm fallback backward peak]): integer
    arithmetic on the shape, no tensor touched."""
    step = _bwd_rows(n, d)
    acc = 8 if itemsize == 8 else 4  # acc_dtype's itemsize
    extra = k * (n * itemsize + 8) + (16 - itemsize) * d + step * d * (acc + 8)
    extra += 4 * step * acc + 64
    return extra <= n * d * itemsize


# NOTE [A weight gradient over one or two rows]
# RMSNorm's dgamma sums float products over the rows in float64, then rounds once to the weight's
# dtype. Over one row that sum is the product itself, and over two rows it is the float sum of the
# two products, bit for bit, where the weight's dtype is the product's: a float64 sum of two
# floats is exact unless their exponents differ by more than 29, and then the smaller one lies far
# below half an ulp of the larger, so both roundings give the larger. (Over two rows with a
# bfloat16 weight the float64 sum stays: rounding to float, then to bfloat16, can differ from
# rounding the exact sum once; over one row the product is already a float, and is rounded once.)
# So there (a norm of one normalized row: ``RMSNorm(64)`` on a (64,) input) the float64 sum and
# its rounding copy are not made: they peaked 2 x D x 4 B above eager's backward, which holds
# neither (RMSNorm(64) on one row, then a Linear: 18,188 B against 18,184; bfloat16
# RMSNorm((4, 5)) on a (4, 5) input between Linears: 632 B against 588). The C++ body
# (``_ext/backward.cpp``) does the same.
# NOTE [A weight-only backward sums into the dead dy]
# A weight-only RMSNorm backward from y (a norm whose input needs no gradient) makes xhat * dy in
# one temporary and sums its rows in float64 (NOTE [A weight gradient over one or two rows]); eager
# makes the same product from its saved xhat and sums it in float, so the float64 sum (8 B per
# channel) peaked above eager's wherever that backward was the step's peak (RMSNorm(64) -> Linear
# on 8 rows: 23,560 B against 23,048). Where dy's buffer is dead (granted: NOTE [Gradient-buffer
# ownership] in slimgrad/ownership.py) and its values are all read (the product is made; one
# chunk), the float64 sum is written into its first 2 x D floats, reinterpreted as float64, and
# only the weight's gradient is new: eager's bytes. The same sum, so the same bits.
def _f64_rows(dy: torch.Tensor, d: int) -> torch.Tensor | None:
    # dy's first 2 * d floats as d float64 values, where dy is a contiguous float tensor with room
    # and an offset float64 can start at; else None
    if dy.dtype != torch.float32 or not dy.is_contiguous() or dy.numel() < 2 * d:
        return None
    if (dy.storage_offset() * 4) % 8:
        return None
    return dy.view(-1)[: 2 * d].view(torch.float64)


def rms_norm_fwd_torch(x, normalized_shape, weight, eps):
    y, rstd = torch.ops.aten._fused_rms_norm(x, normalized_shape, weight, eps)
    idx = fallback_channels(weight, None, y.dtype).to(x.device)
    return y, rstd, idx, side_columns(x, math.prod(normalized_shape), idx)


def rms_norm_bwd_torch(
    dy, y, rstd, idx, xside, weight, normalized_shape, output_mask, out=None, from_input=False
):
    # Same chunked scheme as layer_norm_bwd_torch; out: dy itself when its buffer is dead
    # (slimgrad.ownership.take), dx then overwrites each chunk of it after the chunk's last read.
    # from_input: ``y`` is the input x (half precision, NOTE [RMSNorm and GroupNorm in half
    # precision]) and xhat = x * rstd, as eager computes it.
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32  # acc_dtype, inline
    d = math.prod(normalized_shape)
    # the rows: y.numel() // d, or the leading dims' product when d == 0
    n = y.numel() // d if d else math.prod(y.shape[: y.dim() - len(normalized_shape)])
    need_dx, need_dw = output_mask[0], weight is not None and output_mask[1]
    # max(1, max(CHUNK_ELEMS, (n * d) // 16) // max(d, 1)), without max()'s calls
    step = (n * d) // 16
    if step < CHUNK_ELEMS:
        step = CHUNK_ELEMS
    step //= d if d > 1 else 1
    if step < 1:
        step = 1
    single = step >= n  # one chunk: the whole tensors, no slices
    if (
        single
        and need_dx
        and weight is not None
        and not from_input
        and (idx is None or idx.shape[0] == 0)
        and y.dtype == acc
        and dy.dtype == acc
        and rstd.dtype == acc
        and rstd.ndim == y.ndim
        and (out is dy or (out is None and dy.is_contiguous()))
    ):
        # NOTE [RMSNorm's one-chunk backward in the tensors' own shapes]
        # The loop below for its usual case (one chunk, a weight, no fallback channel, no casts),
        # on y, dy, rstd and the weight in their own shapes, which broadcast as the (rows, D)
        # views do: the same elementwise ops on the same operands, so the same bits, without the
        # row views, the cast copy and the final reshape. The two reductions see what they saw:
        # dw's float64 row sum over the (rows, D) product, the row dots as a bmm of (rows, 1, D)
        # by (rows, D, 1) contiguous operands (a reshape of a tensor that is not contiguous
        # copies it, as the row views did).
        wt = weight  # the weight's own shape broadcasts against y's trailing dims
        if wt.dtype != acc:
            wt = wt.to(acc)
        xh = torch.div(y, wt)  # rebuild_xhat: (y - 0) / w, one rounding
        dw = None
        if need_dw:
            # NOTE [A weight gradient over one or two rows]
            if n == 1:
                dw = (dy * xh).view(d)
                if wt is not weight:
                    dw = dw.to(weight.dtype)
            elif n == 2 and wt is weight:
                dw = (dy * xh).reshape(n, d).sum(0)
            else:  # the product dropped before the cast, as one expression drops it
                dw = (dy * xh).reshape(n, d).sum(0, dtype=torch.float64).to(weight.dtype)
            if weight.ndim != 1:
                dw = dw.reshape(weight.shape)
        g = dy.mul_(wt) if out is dy else dy * wt
        c2 = bmm_exact(g.reshape(n, 1, d), xh.reshape(n, d, 1)).view(rstd.shape).div_(d)
        g.sub_(xh.mul_(c2)).mul_(rstd)
        return g, dw
    # no-op calls skipped (a view or cast to the tensor's own shape or dtype): the same bits
    dy2, y2 = dy.reshape(n, d), y.reshape(n, d)
    # an empty rstd: a weight-only backward from y (NOTE [A weight-only backward keeps no rstd]
    # in ops/rms_norm.py)
    r = rstd.reshape(n, 1) if rstd.numel() or not n else None
    if r is not None and r.dtype != acc:
        r = r.to(acc)
    w = None
    if weight is not None and (need_dx or not from_input):  # from x, dw needs no weight
        w = weight if weight.ndim == 1 else weight.reshape(d)
        if w.dtype != acc:
            w = w.to(acc)
    dx = None  # a fresh dx is made at its first write (one chunk: the chunk's result itself)
    if need_dx and out is not None:
        dx = dy2 if out is dy else out.view(n, d)  # out is dy: dy2 is that view already
    # the first chunk's float64 sum, then the others added (0 + s is s, bit for bit)
    dw, cast = None, False
    for i in range(0, n, step):
        if single:
            sl, ych, dyc, rch = slice(None), y2, dy2, r
        else:
            sl = slice(i, i + step)
            ych, dyc, rch = y2[sl], dy2[sl], (r[sl] if r is not None else None)
        xh = ych.to(acc, copy=True)
        if from_input:
            xh.mul_(rch)
        elif w is not None:  # rebuild_xhat(y2[sl], w, None, acc), inline
            xh.div_(w)
        if idx is not None and idx.numel():
            xh.index_copy_(1, idx, (xside if single else xside[sl]).to(acc) * rch)
        # dy's own rows when out is dy (no cast): dx is written there, g made in place
        own = out is dy and dyc.dtype == acc
        if dyc.dtype != acc and need_dx:
            # without dx, xh.mul_ below reads dy in its own dtype: the same float32 product
            # (half-precision values widen exactly), no float32 copy of the chunk
            dyc = dyc.to(acc)
        if need_dw:
            # without dx, xh's last use: the product made over it (the same bits, one temporary
            # fewer: the weight-only backward of a norm on the model's input peaked 1.28x eager's)
            s = xh.mul_(dyc) if not need_dx else dyc * xh
            # NOTE [A weight gradient over one or two rows]: no float64 sum there
            if single and n == 1:
                s = s.view(d)
            elif single and n == 2 and weight.dtype == acc:
                s = s.sum(0)
            elif single and not need_dx and out is dy and (scratch := _f64_rows(dy, d)) is not None:
                # NOTE [A weight-only backward sums into the dead dy]
                s = torch.sum(s, 0, dtype=torch.float64, out=scratch)
            else:
                s = s.sum(0, dtype=torch.float64)
            if dw is not None:
                dw.add_(s)
            elif i + step >= n:  # the only chunk: in the weight's dtype now, before g is made
                dw, cast = s.to(weight.dtype), True
            else:
                dw = s
            del s
        if need_dx:
            if own:  # every read of this chunk of dy is done: g in place, dx's own rows
                g = dyc.mul_(w) if w is not None else dyc
            else:
                g = dyc * w if w is not None else dyc.clone()
            # rowdot(g, xh), inline: no chunk-sized temporary
            c2 = bmm_exact(g.unsqueeze(1), xh.unsqueeze(2)).view(-1, 1).div_(d)
            g.sub_(xh.mul_(c2)).mul_(rch)
            if not own:
                if dx is None and single and g.dtype == y.dtype and g.is_contiguous():
                    dx = g  # the result is dx: no copy
                else:
                    if dx is None:
                        dx = y.new_empty((n, d))
                    dx[sl] = g
            del g
        del xh, dyc  # free this chunk's temporaries before the next one
    if need_dx and dx is None:  # no rows
        dx = y.new_empty((n, d))
    if need_dx and dx.shape != y.shape:  # (a 2-D y of one row over 2 normalized dims too)
        dx = dx.reshape(y.shape)
    if need_dw:
        if dw is None:  # no rows
            dw = torch.zeros(d, dtype=torch.float64, device=y.device)
        if not cast:
            dw = dw.to(weight.dtype)
        if weight.ndim != 1:
            dw = dw.reshape(weight.shape)
    return dx, dw
