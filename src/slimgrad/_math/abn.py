"""In-Place ABN's math in plain PyTorch, below both ``slimgrad.ops`` and ``slimgrad.kernels``.

The op (``slimgrad/ops/inplace_abn.py``, whose docstring has the math and NOTE [Invertibility] and
NOTE [Chunked backward]) and the Triton kernels (``slimgrad/kernels/inplace_abn.py``, which fall
back to these for the side channels, the batch statistics and layouts they cannot take) share:
the batch statistics (:func:`stats`), the side channels (:func:`side_channels`), the forward
(:func:`fwd_torch`) and the chunked backward (:func:`bwd_torch`). NOTE [Kernels are leaves] in
``slimgrad._math``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.weak import WeakIdKeyDictionary

from slimgrad._errors import internal_error
from slimgrad._math.norms import unseen
from slimgrad._math.steps import anchor, epoch, pinned, stepped_optimizers
from slimgrad._math.tables import unsized

__all__ = [
    "ELU_MIN_PREACT",
    "REBUILD_MAX_BIAS_RATIO",
    "ParamChannels",
    "act_",
    "act_grad",
    "act_inverse",
    "acc_dtype",
    "affine",
    "apply_torch_",
    "bshape",
    "bwd_torch",
    "chunks",
    "fwd_torch",
    "host_list",
    "overlaps",
    "plan",
    "side_channels",
    "stats",
]

REBUILD_MAX_BIAS_RATIO = 4.0  # NOTE [Invertibility]
ELU_MIN_PREACT = -math.log(256.0)
CHUNK_ELEMS = 1 << 15  # NOTE [Chunked backward]
MAX_CHUNKS = 16
MIN_CHUNK = 1 << 12


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def bshape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def plan(x: torch.Tensor) -> tuple[int, int | None]:
    # NOTE [Chunked backward]: (channels per chunk, None) for whole channels, or (1, batch rows per
    # part) when one channel holds more than 4 * max(budget, MIN_CHUNK) values.
    n, c = x.shape[0], x.shape[1]
    per_channel = max(1, x.numel() // max(1, c))
    budget = max(1, min(x.numel() // MAX_CHUNKS, CHUNK_ELEMS))
    if per_channel <= 4 * max(budget, MIN_CHUNK):
        return max(1, budget // per_channel), None
    return 1, max(1, max(budget, MIN_CHUNK) // max(1, per_channel // max(1, n)))


def chunks(x: torch.Tensor):
    # yields (c0, c1, [(n0, n1), ...]): channel groups, each split into batch ranges
    n, c = x.shape[0], x.shape[1]
    step, rows = plan(x)
    parts = [(0, n)] if rows is None else [(n0, min(n, n0 + rows)) for n0 in range(0, n, rows)]
    for c0 in range(0, c, step):
        yield c0, min(c, c0 + step), parts


def affine(weight, bias, c, device, acc):
    w = weight.to(acc) if weight is not None else torch.ones(c, device=device, dtype=acc)
    b = bias.to(acc) if bias is not None else torch.zeros(c, device=device, dtype=acc)
    return w, b


def act_(x: torch.Tensor, activation: str, param: float) -> None:
    if activation == "leaky_relu":
        torch.nn.functional.leaky_relu_(x, param)
    elif activation == "elu":
        torch.nn.functional.elu_(x, param)
    elif activation != "identity":
        raise internal_error(f"unknown activation {activation!r} reached the kernel")


def act_inverse(z: torch.Tensor, activation: str, param: float) -> torch.Tensor:
    # With activation == "identity" the result may be a view of the saved z: never write into it.
    if activation == "leaky_relu":
        return torch.nn.functional.leaky_relu(z, 1.0 / param)
    if activation == "elu":
        neg = torch.log1p(z / param)
        return torch.where(z < 0, neg, z)
    return z


def act_grad(dz: torch.Tensor, z: torch.Tensor, activation: str, param: float) -> torch.Tensor:
    if activation == "leaky_relu":
        return torch.ops.aten.leaky_relu_backward(dz, z, param, True)
    if activation == "elu":
        return torch.ops.aten.elu_backward(dz, param, 1.0, 1.0, True, z)
    return dz


def stats(x, running_mean, running_var, training, momentum, eps, merge=None):
    # (mean, invstd, count) in float32 (float64 for float64 input); updates the running statistics.
    c = x.shape[1]
    acc = acc_dtype(x.dtype)
    count = x.numel() // c if c else 0
    if not training:
        if running_mean is None or running_var is None:
            raise ValueError(
                "slimgrad.ops.inplace_abn: running statistics are needed in eval mode; expected "
                "running_mean and running_var tensors, got None. Pass training=True or the buffers."
            )
        return running_mean.to(acc), 1.0 / torch.sqrt(running_var.to(acc) + eps), count
    if x.numel() == 0:
        mean = torch.zeros(c, device=x.device, dtype=acc)
        var = torch.ones(c, device=x.device, dtype=acc) if merge is None else torch.zeros_like(mean)
    elif merge is None:
        # eager BatchNorm's own kernel: the same statistics and running update, bit for bit
        mean, var = torch.batch_norm_update_stats(x, running_mean, running_var, momentum)
    else:
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    if merge is not None:
        count, mean, var = merge(count, mean, var)
        with torch.no_grad():
            if count > 0 and running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if count > 0 and running_var is not None:
                unbiased = (var * (count / max(count - 1, 1))).to(running_var.dtype)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return mean.to(acc), 1.0 / torch.sqrt(var.to(acc) + eps), count


# NOTE [Decided once per parameter version]
# Which channels of a BatchNorm cannot be rebuilt from its output (ops/batch_norm.py's bad
# channels; In-Place ABN's side channels, NOTE [Invertibility]) depends, for most activations, on
# γ and β alone, and it picks what forward saves, so the host must know it before forward returns:
# reading it from the device each call was one host sync per layer per step (a CUDA host then waits
# for the GPU to drain its queue, and cannot run ahead of it). ParamChannels keeps each decision
# with the parameters' (version, data_ptr) and reuses it while they are unchanged (autograd's own
# test of a saved tensor: an in-place write bumps the version, a new storage moves data_ptr). When
# one parameter is stale, every stale parameter seen before that an optimizer that stepped holds
# is decided with it, in one read (the entries hold no parameter: NOTE [Caches that hold
# no reference to a parameter] in _math/steps.py): after an optimizer step the first BatchNorm
# of a forward decides them all, so a training step costs one host sync, not one per layer (and
# none while the parameters do not change). Bits: the same mask, the same ascending channel
# order as nonzero(); only where it is computed changes. A write through ``.data``, which
# autograd does not see either, is not seen here. Another layer's parameters are decided along
# only while their memory can be read (_readable).
_HOST_LISTS = WeakIdKeyDictionary()  # a decided channel tensor -> its channels as a list


def host_list(idx: torch.Tensor) -> list[int]:
    # the channels of idx; no device read when ParamChannels made it
    lst = _HOST_LISTS.get(idx)
    return lst if lst is not None else idx.tolist()


def _readable(t: torch.Tensor | None) -> bool:
    # another layer's parameter may be decided along with this one only while its memory is there
    # to read: a plain tensor whose storage covers it (FSDP2 frees a parameter's storage between
    # uses, resize_(0), and reading it crashed the process; tests/distributed/test_fsdp2.py)
    if t is None:
        return True
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return False
    if t.numel() == 0:
        return False
    extent = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() >= extent * t.element_size()


class ParamChannels:
    def __init__(self, mask: Callable) -> None:
        # mask(weight, bias, extra) -> (C,) bool tensor: the channels to treat apart
        self.mask = mask
        # {id(weight, or bias without weight): (the anchors of weight's and bias's storages,
        # state, (id(weight), id(bias)) with None for an absent one, channel list, the same as a
        # long tensor or None)}: no reference to the parameters (NOTE [Caches that hold no
        # reference to a parameter] in _math/steps.py)
        self.entries: dict[int, tuple] = {}
        # device reads so far (a .cpu() copy: a host sync on CUDA that count_host_syncs, which
        # counts at the dispatcher on CPU tensors, cannot see; tests count them here)
        self.reads = 0

    @staticmethod
    def _state(weight, bias, extra):
        # + optimizer steps: fused steps skip the version counter (NOTE [Steps that skip the
        # version counter] in _math/steps.py)
        return tuple(
            (t._version, t.data_ptr(), t.dtype, t.device) if t is not None else None
            for t in (weight, bias)
        ) + (epoch(), extra)

    def lookup(self, weight, bias, extra=None) -> tuple[list[int], torch.Tensor | None]:
        """(channel list, the same as a long tensor on the parameters' device or None if empty)."""
        if not (pinned(weight) and pinned(bias)):
            # NOTE [Caches that hold no reference to a parameter] in _math/steps.py: decided for
            # this call alone
            return unseen(self._decide, None, weight, bias, extra)
        key = id(weight) if weight is not None else id(bias)
        entry = self.entries.get(key)
        # the state holds both parameters' memory and versions (None for an absent one)
        if entry is not None and entry[1] == self._state(weight, bias, extra):
            return entry[3], entry[4]
        # NOTE [A channel search no mode sees] in ops/batch_norm.py
        return unseen(self._decide, key, weight, bias, extra)

    def _stale_held(self, key) -> list:
        # the other entries gone stale whose parameters an optimizer that stepped holds (an
        # entry holds no parameter: NOTE [Caches that hold no reference to a parameter])
        if len(self.entries) <= (key in self.entries):
            return []
        held = {
            id(p): p for opt in stepped_optimizers() for g in opt.param_groups for p in g["params"]
        }
        todo = []
        for k, e in list(self.entries.items()):
            wid, bid = e[2]
            if k == key or (wid is not None and wid not in held):
                continue
            if bid is not None and bid not in held:
                continue
            w = held[wid] if wid is not None else None
            b = held[bid] if bid is not None else None
            if not (_readable(w) and _readable(b)):
                continue  # e.g. an FSDP2 parameter resharded since: its storage is freed
            if e[1] != self._state(w, b, e[1][-1]):
                todo.append((k, w, b, e[1][-1]))
        return todo

    def _decide(self, key, weight, bias, extra):
        # (channel list, tensor) of weight and bias; stored, with every stale entry decided along,
        # unless key is None
        todo = [(key, weight, bias, extra)]
        if key is not None:
            todo += self._stale_held(key)
        first = None
        with torch.no_grad():
            masks = [self.mask(w, b, ex) for _, w, b, ex in todo]
        by_device: dict = {}
        for item, m in zip(todo, masks, strict=True):
            by_device.setdefault(m.device, []).append((item, m))
        for device, group in by_device.items():
            # one read per device (a host sync on CUDA) for every stale decision at once
            flat = torch.cat([m.reshape(-1) for _, m in group]).cpu().tolist()
            self.reads += 1
            lists, pos = [], 0
            for _, m in group:
                lists.append([i for i, bad in enumerate(flat[pos : pos + m.numel()]) if bad])
                pos += m.numel()
            # the channel tensors in one copy; from pinned memory without a sync on CUDA
            every = torch.tensor([i for lst in lists for i in lst], dtype=torch.long)
            if every.numel() and device.type == "cuda":
                every = every.pin_memory().to(device, non_blocking=True)
            elif every.numel():
                every = every.to(device)
            pos = 0
            for ((k, w, b, ex), _), lst in zip(group, lists, strict=True):
                dev = every[pos : pos + len(lst)] if lst else None
                pos += len(lst)
                if dev is not None:
                    _HOST_LISTS[dev] = lst
                if w is weight and b is bias and first is None:
                    first = (lst, dev)
                if k is None:
                    continue
                anchors = (anchor(self.entries, k, w), anchor(self.entries, k, b))
                ids = (id(w) if w is not None else None, id(b) if b is not None else None)
                self.entries[k] = (anchors, self._state(w, b, ex), ids, lst, dev)
        return first


def _side_mask(weight, bias, extra):
    dtype, acc = extra
    c = (weight if weight is not None else bias).shape[0]
    device = (weight if weight is not None else bias).device
    w, b = affine(weight, bias, c, device, acc)
    tiny = torch.finfo(dtype).tiny
    return ~((w.abs() > tiny) & (b.abs() <= REBUILD_MAX_BIAS_RATIO * w.abs()))


_SIDE = ParamChannels(_side_mask)


def side_channels(x, w, b, mean, invstd, activation, params=None, uniform: bool = False):
    # NOTE [Invertibility]: (side_idx, side_xhat) for the channels not rebuilt from z. Runs before
    # x is overwritten. ``params``: the (weight, bias) that w, b were made from, or None: then the
    # channels that only γ and β decide are looked up per parameter version (NOTE [Decided once
    # per parameter version]) instead of read from the device on every call. ``uniform``: the
    # same ops whichever channels x's values put aside (under selective checkpointing: NOTE
    # [Value-dependent saves under torch.utils.checkpoint] in slimgrad/ops/_derived.py).
    acc = acc_dtype(x.dtype)
    if unsized(x):  # a fake tensor without symbolic sizes: no values, assume no side channel
        empty = x.new_empty((x.shape[0], 0, *x.shape[2:]), dtype=acc)
        return x.new_empty(0, dtype=torch.long), empty
    shape = bshape(x)
    if (
        params is not None
        and activation != "elu"
        and not any(is_fake(t) for t in params if t is not None)
    ):
        # no affine parameters: γ = 1, β = 0 rebuild every channel
        none = all(t is None for t in params)
        dev = None if none else _SIDE.lookup(*params, (x.dtype, acc))[1]
        if dev is None or x.numel() == 0:
            return (
                torch.zeros(0, dtype=torch.long, device=x.device),
                x.new_empty((x.shape[0], 0, *x.shape[2:]), dtype=acc),
            )
        xs = x.index_select(1, dev).to(acc)  # fresh: NOTE [Side channels normalised in place]
        return dev, xs.sub_(mean[dev].view(shape)).mul_(invstd[dev].view(shape))
    tiny = torch.finfo(x.dtype).tiny
    side = ~((w.abs() > tiny) & (b.abs() <= REBUILD_MAX_BIAS_RATIO * w.abs()))
    if activation == "elu" and x.numel() > 0:
        dims = [0] + list(range(2, x.dim()))
        lo = torch.where(w >= 0, x.amin(dim=dims).to(acc), x.amax(dim=dims).to(acc))
        side |= (lo - mean) * invstd * w + b < ELU_MIN_PREACT
    if x.numel() == 0 or not (uniform or bool(side.any())):
        return (
            torch.zeros(0, dtype=torch.long, device=x.device),
            x.new_empty((x.shape[0], 0, *x.shape[2:]), dtype=acc),
        )
    idx = side.nonzero().flatten()
    if uniform:  # no channel aside sizes the views too
        shape = [1, idx.shape[0]] + shape[2:]
    # NOTE [Side channels normalised in place]: xs is index_select's fresh copy (or its cast);
    # (xs - mean) * invstd computed out of place held three k/C-sized float tensors at once, in
    # backward beside dz and z (bfloat16 InPlaceABN in eval, 2 of 8 channels aside at 2x8x6x6:
    # peak 6,480 B against eager's 5,768); in place, one, with the same bits (the same kernels)
    xs = x.index_select(1, idx).to(acc)
    return idx, xs.sub_(mean[idx].view(shape)).mul_(invstd[idx].view(shape))


def fwd_torch(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    param: float,
    merge: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Writes act(BN(x)) over x. Returns (mean, invstd, side_idx, side_xhat, count).

    ``merge(count, mean, var) -> (count, mean, var)`` combines per-rank statistics (sync variant);
    the running statistics are then updated here with the merged figures.
    """
    mean, invstd, count = stats(x, running_mean, running_var, training, momentum, eps, merge)
    w, b = affine(weight, bias, x.shape[1], x.device, mean.dtype)
    side_idx, side_xhat = side_channels(x, w, b, mean, invstd, activation, (weight, bias))
    apply_torch_(x, w, b, mean, invstd, activation, param)
    return mean, invstd, side_idx, side_xhat, count


def apply_torch_(x, w, b, mean, invstd, activation, param):
    if x.numel() == 0:
        return
    scale = w * invstd
    shift = b - mean * scale
    shape = bshape(x)
    # the same alpha/beta form as eager BatchNorm's CPU kernel: x * (w * invstd) + shift
    torch.addcmul(shift.view(shape), x, scale.view(shape), out=x)
    act_(x, activation, param)


def bwd_torch(
    z: torch.Tensor,
    dz: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    invstd: torch.Tensor,
    side_idx: torch.Tensor,
    side_xhat: torch.Tensor,
    count: int,
    training: bool,
    eps: float,
    activation: str,
    param: float,
    need_dx: bool = True,
    need_dparams: bool = True,
    allreduce: Callable | None = None,
    owned: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Returns (dx or None, dweight, dbias); NOTE [Chunked backward].

    ``owned``: dz is dead (``slimgrad.ownership.take`` granted it): dx is written into its buffer.

    ``allreduce(sum_dy, sum_dy_xhat, count) -> (sum_dy, sum_dy_xhat, count)`` makes the sums
    global (sync variant).
    """
    c = z.shape[1]
    acc = acc_dtype(z.dtype)
    w, b = affine(weight, bias, c, z.device, acc)
    shape = bshape(z)
    sum_dy = torch.zeros(c, device=z.device, dtype=acc)
    sum_dy_xhat = torch.zeros(c, device=z.device, dtype=acc)
    # x̂ = (inp - mean_p) * invstd_p, where inp is the rebuilt y, or the side tensor's x̂ itself.
    mean_p, invstd_p = b.clone(), 1.0 / w
    side_pos = {int(ch): s for s, ch in enumerate(host_list(side_idx))} if side_idx.numel() else {}
    if side_pos:
        mean_p[side_idx] = 0
        invstd_p[side_idx] = 1
    need_inp = training or need_dparams
    weight_p = w * invstd / invstd_p
    # dγ = Σ dy (inp - mean_p) / γ, accumulated in float64 and divided once (side channels: inp is
    # x̂ itself, divided by 1): the kernel's Σ dy x̂' multiplies by a rounded 1/γ (a systematic
    # relative error on every term) and on CUDA accumulates in float32; both put dγ past the
    # error rule on an H200 (float32, identity: 2.77e-6 against a bound of 2.73e-6)
    dot64 = torch.zeros(c, device=z.device, dtype=torch.float64) if need_dparams else None
    den64 = w.double() if side_idx.numel() == 0 else w.double().index_fill(0, side_idx, 1.0)

    def dweight_part(c0, dy, inp, mp):
        t = inp - mp.view(shape)
        t.mul_(dy)
        dot64[c0 : c0 + dy.shape[1]] += t.sum(dim=[0] + list(range(2, z.dim())), dtype=dot64.dtype)

    def rebuild(zc, dzc, c0, n0, n1):
        zf = zc if zc.dtype == acc else zc.to(acc)
        dy = act_grad(dzc if dzc.dtype == acc else dzc.to(acc), zf, activation, param)
        if not need_inp:
            return dy, None
        inp = act_inverse(zf, activation, param)
        if not side_pos:
            return dy, inp
        c1 = c0 + zc.shape[1]
        sides = [(ch - c0, s) for ch, s in side_pos.items() if c0 <= ch < c1]
        if sides:
            if inp is zc:
                inp = inp.clone()
            for j, s in sides:
                inp[:, j] = side_xhat[n0:n1, s]
        return dy, inp

    def inputs(c0, c1, n0, n1):
        return rebuild(z[n0:n1, c0:c1], dz[n0:n1, c0:c1], c0, n0, n1)

    def reduce(c0, c1, dy, inp):
        # partial sums over a batch range add up: a channel may span several parts
        if inp is None:
            sum_dy[c0:c1] += dy.sum(dim=[0] + list(range(2, z.dim())))
            return
        # a weight must be passed for CUDA's kernel to return the weight's gradient (with None it
        # returns an empty one); any weight gives the same sums: dγ' = Σ dy x̂, dβ' = Σ dy
        _, gw, gb = torch.ops.aten.native_batch_norm_backward(
            dy, inp, weight_p[c0:c1], None, None, mean_p[c0:c1], invstd_p[c0:c1], True, eps,
            [False, True, True],
        )  # fmt: skip
        sum_dy_xhat[c0:c1] += gw
        sum_dy[c0:c1] += gb
        if need_dparams:
            dweight_part(c0, dy, inp, mean_p[c0:c1])

    dx = None
    if need_dx:
        dx = dz if owned else torch.empty_like(z)

    def coefs(c0, c1, n_total, sdy, sdyx):
        k = w[c0:c1] * invstd[c0:c1]
        if not training:
            return k, None, None
        m2 = sdyx[c0:c1] / n_total
        p = -k * m2 * invstd_p[c0:c1]
        q = -p * mean_p[c0:c1] - k * (sdy[c0:c1] / n_total)
        return k, p, q

    def write(c0, c1, n0, n1, dy, inp, k, p, q):
        slot = dx[n0:n1, c0:c1]
        kv = k.view(shape)
        if p is None:
            res = dy * kv
        elif slot.dtype == acc and not overlaps(slot, dy):
            torch.addcmul(q.view(shape), inp, p.view(shape), out=slot)
            slot.addcmul_(dy, kv)
            return
        else:
            res = torch.addcmul(q.view(shape), inp, p.view(shape))
            res.addcmul_(dy, kv)
        slot.copy_(res)

    reducing = training or need_dparams
    step, rows = plan(z) if z.numel() > 0 else (1, None)
    if training and need_dx and allreduce is None and rows is None and z.numel() > 0:
        # Common case, one pass per channel group: aten's fused BatchNorm backward on the rebuilt
        # input, with mean' = mean_p, invstd' = invstd_p and weight' = w * invstd / invstd_p,
        # gives this group's dx and Σ dy (dγ: dweight_part). Views come from split() to keep
        # per-chunk overhead low.
        gbs = []
        groups = zip(
            z.split(step, 1), dz.split(step, 1), dx.split(step, 1), weight_p.split(step),
            mean_p.split(step), invstd_p.split(step), range(0, c, step),
        )  # fmt: skip
        for zc, dzc, slot, wp, mp, ip, c0 in groups:
            dy, inp = rebuild(zc, dzc, c0, 0, z.shape[0])
            dxc, _, gb = torch.ops.aten.native_batch_norm_backward(
                dy, inp, wp, None, None, mp, ip, True, eps, [True, False, True]
            )
            if need_dparams:  # before dx is written: dy may be a view of dz, dx's buffer
                dweight_part(c0, dy, inp, mp)
            slot.copy_(dxc)
            gbs.append(gb)
            del dy, inp, dxc  # free this chunk's temporaries before the next chunk's
        return dx, _dweight(dot64, den64, acc, c, z.device), torch.cat(gbs)
    if z.numel() > 0:
        for c0, c1, parts in chunks(z):
            if allreduce is None and len(parts) == 1:
                # one pass: the reduction of these channels is complete before their dx is written
                dy, inp = inputs(c0, c1, *parts[0])
                if reducing:
                    reduce(c0, c1, dy, inp)
                if need_dx:
                    write(c0, c1, *parts[0], dy, inp, *coefs(c0, c1, count, sum_dy, sum_dy_xhat))
                del dy, inp
                continue
            if reducing:
                for n0, n1 in parts:
                    reduce(c0, c1, *inputs(c0, c1, n0, n1))
            if allreduce is None and need_dx:
                for n0, n1 in parts:
                    dy, inp = inputs(c0, c1, n0, n1)
                    write(c0, c1, n0, n1, dy, inp, *coefs(c0, c1, count, sum_dy, sum_dy_xhat))
                    del dy, inp
    if allreduce is not None:
        g_dy, g_dyx, g_count = allreduce(sum_dy, sum_dy_xhat, count)
        if need_dx and z.numel() > 0:
            for c0, c1, parts in chunks(z):
                for n0, n1 in parts:
                    dy, inp = inputs(c0, c1, n0, n1)
                    write(c0, c1, n0, n1, dy, inp, *coefs(c0, c1, g_count, g_dy, g_dyx))
                    del dy, inp
    return dx, _dweight(dot64, den64, acc, c, z.device), sum_dy


def _dweight(dot64, den64, acc, c, device):
    if dot64 is None:  # not asked for (need_dparams=False): zeros, as the kernel's unused output
        return torch.zeros(c, device=device, dtype=acc)
    return (dot64 / den64).to(acc)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
