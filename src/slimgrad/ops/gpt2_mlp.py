"""HF GPT-2's MLP as one autograd node: ``dropout(c_proj(gelu(c_fc(x))))``.

Math: ``h = x W_fc + b_fc`` (HF ``Conv1D``, W ``(in, out)``), ``y = gelu(h)`` (erf or tanh form),
``z = y W_proj + b_proj``, ``out = dropout(z, p)`` (training; otherwise ``out = z``). Backward:
each step's backward in reverse order, the very functions the per-op Functions run.

Memory: saves x (if W_fc needs grad), y (if W_proj needs grad or anything before it does), y's
branch bits (1/8 B/elt of h) + the GELU's sparse exact table, and the dropout mask as bits (1/8
B/elt of out): the per-op converted path's tensors, byte for byte (eager: x, h, y and a float mask:
4 B/elt each in float32). All of it goes through ``save_for_backward``. Under bf16/fp16
autocast: x's cast (2 B/elt of x), h (2 B/elt of h) and the mask's bits; y is recomputed in
backward (NOTE [GPT-2's MLP under autocast]); eager keeps x's cast, h, y, the weights' casts and a
byte mask.

# NOTE [One node for GPT-2's MLP]
A converted GPT-2 block ran one autograd Function per op of its MLP (Conv1D, GELU, Conv1D,
Dropout): four Python forwards, four Python backwards, three gradient hand-overs through the
engine. :class:`_GPT2MLPFn` runs the same four steps in one Function. Its forward calls each op's
own Function ``forward`` on a :class:`_Step` (a stand-in for ``ctx`` that records what the step
saves and the attributes it sets) in the order eager runs them, so the outputs, the saved tensors
and the dropout mask (the same draw from the same generator, after the same ops) are the per-op
path's; the node then saves every step's tensors with one ``save_for_backward`` (saved-tensor
hooks, checkpointing and offloading see each of them, as before). Backward hands each step its
share of the saved tensors and runs that op's backward math in reverse order: dropout, c_proj,
GELU, c_fc: the same functions on the same tensors, so every gradient is the per-op path's bit for
bit. Ownership: the block's incoming gradient is taken (``ownership.grant``) as the per-op
Dropout's backward takes it; the gradients between the steps are made inside the node and seen by
nobody else, so the GELU writes its dx into c_proj's dx without asking (the per-op path asked
``ownership`` for the same buffer; in place and out of place give the same bits). What the node
holds longer than the per-op path: the per-op GELU node released y and its bits when its backward
returned; the block node holds them until c_fc's backward has run (y is also what c_proj keeps,
so up to GELU's backward nothing changes). Where c_fc's backward is the step's peak, the peak is
up to y's bytes above the per-op path's (2-layer GPT-2, 32 wide, 2x24 tokens: +9,344 B, still
0.37x eager's); at the host-overhead model (12 x 64, 1x16 tokens) and at GPT-2 small 4x256 the
step's peak is elsewhere (the embedding's backward) and the saved, forward-peak and peak bytes
are the per-op path's exactly (``tests/ops/test_gpt2_mlp.py``). Keeping c_fc a node of its own
would end that, but then h, the node's input, stays alive through c_proj's and dropout's forward
(+3,192 B at the first shape): the per-op path frees it after the GELU.

# NOTE [GPT-2's MLP under autocast]
Under bfloat16/float16 autocast (float32 leaf weights, :func:`autocast_ok`) the MLP runs as
:class:`_GPT2MLPAutocastFn`, one node that keeps x's cast (c_fc's input, 2 B/elt of x), h (c_fc's
output, 2 B/elt of h) and dropout's bits (1/8 B/elt of out), and recomputes y = gelu(h) in
backward for c_proj's weight gradient: one GELU forward per backward, the same kernel on the same
h, so y has forward's bits. Its steps are the per-op path's: x's ``.to`` and each bias as
autocast's cache hands it over (made in the per-op path's order, so backward casts each weight's
gradient to float32 before its bias's, as per op), c_fc and c_proj as ``_AutocastLinearFn``'s
forward on a :class:`_Step` (each weight cast from its master, used and dropped; its gradient
through the cast token: NOTE [Autocast weight casts] in ``ops/linear.py``), eager's GELU kernel
on h, the per-op Dropout's forward. Backward: dropout's, then c_proj's weight and bias gradients
on the recomputed y (dropped before c_proj's dx is made), c_proj's dx, eager's ``gelu_backward``
on h (written into that dx, made here), c_fc's: eager autocast's operands and ops, so the loss
and every gradient are eager autocast's bits where eager runs ``F.gelu`` (HF ``gelu``, erf), and
the per-op converted path's where HF's ``gelu_new`` runs its own tanh formula (the converted GELU
runs ``F.gelu``'s tanh form there; within the error rule of eager's). c_fc's dx is written into the
incoming gradient's buffer where it is the node's (dropout's output, or dy granted by
``ownership``; the engine holds dy until the node returns).
What it keeps (tracker; 3 layers, 64 wide, intermediate 256, 2x32 tokens under CPU bf16 or fp16
autocast; ``tests/ops/test_gpt2_mlp.py``): 41,472 B a layer (x's cast 8,192, h 32,768, bits 512),
where the per-op path kept 74,240 (y too: 2 B/elt of h more) and eager 245,760. The per-op
GELU kept h densely on CPU up to ``HALF_DENSE_MAX`` (131,072 elements, NOTE [Few elements] in
ops/_output_act.py) and at GPT-2-like inputs at every size (about 9% of N(0, s) elements lie in
the 16-bit window around x*, more than the fallback's 1/16); past it, on inputs with fewer hard
elements, it kept y + bits + table instead of h, whose gradient was not eager's bits: the node
keeps h at every size and gives eager's bits there too. Standalone MLP, 263 tokens, 64 wide,
intermediate 256, bf16, p = 0.1: saved 237,752 B (per-op 372,408, eager 469,504), peak 439,744
(574,400 and 671,496); the 3-layer model's step: saved 429,056 B (per-op 527,360, eager
1,532,548), peak 773,640 (its peak is elsewhere; per-op the same, eager 1,639,320). Saved and
peak bytes are below eager's and the peak at most the per-op path's over a tiny-to-small sweep
(``tests/ops/test_gpt2_mlp_autocast.py``). Second derivatives (``create_graph=True``): the
backward with differentiable ops, h recomputed from x's cast, c_fc's weight and fp32 bias (both
saved, Parameters: no bytes) so its gradients carry h's history; first derivatives are eager's
bits, second derivatives eager's formulas (autograd sums the paths through h in another order
where dy depends on the output: within 2 ulp of the largest element). With c_fc's weight frozen
x's cast is not kept: first derivatives only there (the second raise). Not taken (the children
run one by one, as before): a non-leaf or non-float32 weight, a non-contiguous x, torch.compile,
``torch.func``, TorchScript tracing, a hooked child (NOTE [GPT-2 MLP: which path]).

# NOTE [A LayerNorm folded into its consumer's node]
A converted LayerNorm is a Python autograd Function of its own: most of its host cost over
eager's is the floor of any Python Function and ``ownership.grant`` on its incoming gradient (a
view there), twice per GPT-2 block (issue 32's measurements). GPT-2's two LayerNorms per
block each feed one consumer that has a node of its own, so each
runs as the first step of that node: ``ln_2`` in :class:`_GPT2LNMLPFn` (then the MLP's steps) and
``ln_1`` in ``slimgrad.ops.gpt2_attention._GPT2LNConv1DFn`` (then ``c_attn``, HF's addmm on the
2-D view); which calls take them is NOTE [GPT-2's block with its LayerNorms folded] in
``slimgrad/convert_handlers/hf_gpt2_block.py``. The LayerNorm's step is ``_LayerNormFn.forward``
on a :class:`_Step`, on the path ``slimgrad.nn.LayerNorm``'s forward takes for the same call (the
straight path's PyTorch forward and its C backward chosen in forward, or under a dispatch mode the
custom op), with the module's ``y_kept_after``: the same y, mean, rstd, fallback columns (or x
where the module keeps x) and bits. Backward runs the consumer's step, then
:func:`layer_norm_backward`, ``_LayerNormFn.backward``'s first-order body with the incoming
gradient granted: it is the consumer's dx, made inside the node, which nobody else holds (the
per-op LayerNorm asked ``ownership`` for the same buffer and was granted it; in place and out of
place give the same bits). What the node keeps is the per-op path's set (y, which the consumer
keeps too, + mean and rstd: 8 B/row); where the LayerNorm's backward runs the node still holds
the consumer's other saved tensors (the MLP's GELU and dropout bits) until it returns, where the
per-op path had released them: at the bench's shapes the step's peak is elsewhere and saved, peak
and forward-peak bytes are the per-op path's (``tests/ops/test_gpt2_block.py``). One Python node
and one ownership question fewer per LayerNorm.

Second derivatives: first derivatives only (``create_graph=True`` gives them, differentiating
them raises a ``slimgrad.ops.gpt2_mlp`` error). The per-op path's float32 GELU refuses them too
except where it falls back to keeping x (at most 512 elements, or more than 1/16 of them in the
hard windows); :mod:`slimgrad.nn.gpt2_mlp` runs the node only for float32 tensors of more than
512 elements of h, so the data-dependent fallback is the one case where a double backward that
worked per op now raises.
"""

from __future__ import annotations

import sys

import torch

import slimgrad.ops.dropout  # noqa: F401 - the modules, not the functions ops/__init__ exports
import slimgrad.ops.gelu  # noqa: F401
import slimgrad.ops.layer_norm  # noqa: F401
from slimgrad import _ext, ownership
from slimgrad._autograd import (
    CTX_FIELDS,
    backward_without_autocast,
    compiling,
    direct_apply,
    refuse_forward_ad,
    refuse_second_order,
)
from slimgrad._library import straight
from slimgrad.kernels import _backend, _cpu
from slimgrad.ops._output_act import (
    DENSE_MAX,
    c_backward,
    reuse_ok,
    side_tensors,
    smooth_backward,
)
from slimgrad.ops.linear import (
    _autocast_cast,
    _AutocastLinearFn,
    _FakeTensor,
    _LinearFn,
    _product_after,
    _top_hooks,
    autocast_linear_setup,
    autocast_weight,
    fresh,
    keeps_master,
    later_ok,
)
from slimgrad.ops.linear import (
    _bwd_torch as _linear_bwd,
)

__all__ = ["gpt2_mlp"]

_dr = sys.modules["slimgrad.ops.dropout"]
_ge = sys.modules["slimgrad.ops.gelu"]
_ln = sys.modules["slimgrad.ops.layer_norm"]
_grad_on = torch._C.is_grad_enabled
# NOTE [The lean MLP ops refuse second derivatives] in slimgrad/ops/gated_mlp.py
_DOUBLE_FIX = (
    "the lean MLP op does not support second derivatives; convert with "
    "ConvertConfig(activations=False) (MLPs and activations stay torch's), or leave this MLP "
    "unconverted with convert_(model, filter_fn=...)"
)
_Tensor = torch.Tensor
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_gelu_bwd_into = torch.ops.aten.gelu_backward.grad_input
_gelu_bwd = torch.ops.aten.gelu_backward.default


class _Step:
    # a ctx stand-in for one op's Function forward/backward inside the block: what the op saves
    # (``to_save``) and the attributes it sets (``needs_input_grad`` set by the block); filled
    # ``saved_tensors`` in backward. No __init__: made by the type's C call alone.
    to_save = ()
    y_seen = None  # NOTE [A kept output written under saved-tensor hooks] in slimgrad/_errors.py

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors

    def set_materialize_grads(self, value: bool) -> None:
        pass  # the block node's own setting applies

    def mark_non_differentiable(self, *tensors) -> None:
        pass  # the side outputs stay inside the node


def _save_steps(ctx, steps: tuple) -> None:
    # one save_for_backward of every step's tensors, in step order (None: a step not run); each
    # step remembers how many are its own. The block nodes are applied by direct_apply alone
    # (eager, never traced): saved through ctx's field (NOTE [Saving through ctx's fields])
    to_save = []
    for st in steps:
        if st is not None:
            s = st.to_save
            st.n_saved = len(s)
            to_save += s
            st.to_save = ()
    ctx.steps = steps
    if CTX_FIELDS:
        ctx.to_save = tuple(to_save)
    else:
        ctx.save_for_backward(*to_save)


def _hand_out_saved(ctx) -> None:
    # backward: each step's ``saved_tensors`` is its run of the node's saved tensors
    saved = ctx.saved_tensors
    i = 0
    for st in ctx.steps:
        if st is not None:
            st.saved_tensors = saved[i : i + st.n_saved]
            i += st.n_saved


def _release_saved(steps: tuple) -> None:
    for st in steps:
        if st is not None:
            st.saved_tensors = ()


def _dropout_backward(st: _Step, grad: torch.Tensor, owned: bool) -> torch.Tensor:
    # _DropoutFn.backward's first-order body with ``owned`` decided by the block's backward
    (bits,) = st.saved_tensors
    lib = st.lib
    if lib is not None and type(grad) is _Tensor and not _dispatch_stack_len():
        g = grad
        if g.is_contiguous():
            out = g if owned else torch.empty_like(g)
        elif not owned:
            g = g.contiguous()
            out = torch.empty_like(g)
        else:
            g = None
        if g is not None:
            return _dr._c_bwd(lib, g, bits, st.p, st.n, out)
    k = st.k
    if k is not _dr._UNDECIDED and not owned and straight():
        g = grad.contiguous()
        if k is not None and k.supports(g):
            return k._bwd_triton(g, bits, st.p, st.fused)
        return _dr._apply_mask_torch(g, bits, st.p, st.fused)
    return _dr._backward(grad, bits, st.p, st.fused, owned)


def _gelu_backward(st: _Step, g: torch.Tensor) -> torch.Tensor:
    # _GeluFn.backward's first-order body; g is c_proj's dx, made in this node: its buffer is free
    if st.cpath is not None and g.is_contiguous():
        dx = c_backward(st, g, g, _ge._C_BWD[st.approximate])
        if dx is not None:
            return dx
    buf = g if reuse_ok(g, st.perm) else None
    bwd = _ge._gelu_bwd.impl if buf is None and straight() else _ge._gelu_bwd
    return smooth_backward(st, g, buf, bwd, _ge._bwd_any, _ge._bwd_exact, st.approximate)


def layer_norm_forward(n, x, arg, weight, bias, eps: float, y_kept_after: bool, direct):
    # the converted LayerNorm's step in a block node (NOTE [A LayerNorm folded into its
    # consumer's node]): _LayerNormFn's forward on a _Step, on the path slimgrad.nn.LayerNorm's
    # forward takes for the same call; n: needs_input_grad of (x, weight, bias)
    ln = _Step()
    ln.needs_input_grad = (n[0], False, n[1], n[2], False, False, False)
    if (
        direct
    ):  # the straight path's forward choice (nn/layer_norm.py, NOTE [Kernel backend choice])
        backend = _backend._resolved[0] or _backend.get_backend()
        d = _ln._TORCH if not x.is_cuda and backend in _ln._NO_TRITON else True
    else:
        d = False
    y = _ln._LayerNormFn.forward(ln, x, arg, weight, bias, eps, d, y_kept_after)
    # NOTE [LayerNorm's straight forward returns y alone] in ops/layer_norm.py
    return ln, (y if d is _ln._TORCH else y[0])


def layer_norm_backward(st: _Step, dy: torch.Tensor) -> tuple:
    # _LayerNormFn.backward's first-order body (ops/layer_norm.py first_order_bwd) with dy
    # granted: dy is the consumer's dx, made inside the block node, so nobody else holds it
    # (NOTE [A LayerNorm folded into its consumer's node]); returns (dx, dweight, dbias)
    y, mean, rstd, idx, xside, weight, bias = st.saved_tensors
    if y is None:  # x kept (_keep_x): eager's backward, which never reuses dy
        r = _ln._eager_bwd(st, dy, xside, mean, rstd, weight, bias)
        return r[0], r[2], r[3]
    dx, dw, db, mask = _ln.first_order_bwd(st, dy, dy, y, mean, rstd, idx, xside, weight, bias)
    return (
        dx if mask[0] else None,
        dw if weight is not None and mask[1] else None,
        db if bias is not None and mask[2] else None,
    )


_EXT_MLP = None  # the C++ extension's gpt2_mlp_bwd, once it is loaded


def _use_extension(mod) -> None:
    global _EXT_MLP
    _EXT_MLP = getattr(mod, "gpt2_mlp_bwd", None)


_ext.when_loaded(_use_extension)
_GELU_BWD_ADDR: dict = {}  # CPath -> the address of its bound smooth_bwd_f32


# NOTE [GPT-2's MLP backward from C++]
# Where the MLP's steps ran straight (c_proj and c_fc HF Conv1Ds on a 3-D input, the GELU on its C
# path: NOTE [The straight C path of the smooth activations] in ops/_output_act.py, the residual
# dropout, if any, on its C kernel: NOTE [Dropout's straight path] in ops/dropout.py) and backward
# runs on a plain gradient outside dispatch modes (the conditions under which the Python body
# below takes those same paths), the extension's ``gpt2_mlp_bwd`` (``_ext/backward.cpp``, NOTE
# [Backward bodies from C++]) issues :func:`_mlp_backward`'s ATen ops from C++: the dropout's C
# pass (into dy where ``ownership.grant`` granted it, as :func:`_dropout_backward`),
# ``_LinearFn.backward``'s 3-D Conv1D case for c_proj, :func:`_output_act.c_backward` into c_proj's
# dx (the hard elements' ``index_select``, the C pass, ``aten.gelu_backward`` and ``index_put_``),
# then c_fc's: the same ops on the same operands in the same order, each temporary dropped where
# Python drops it; the two C passes call the same C functions the Python body calls through ctypes
# (their addresses read once from those ctypes functions). The same bits, buffers and peak; a
# dispatch mode (the tracker, the estimate's fake tensors) never gets here and runs the Python
# body. Every case check runs before the first op, so None (a tensor subclass, a torch function
# mode, a gradient that is not a contiguous float32 CPU tensor, saved tensors of other layouts)
# hands back with nothing written and the Python body runs. A folded LayerNorm's backward (NOTE
# [A LayerNorm folded into its consumer's node]) stays in Python. tests/ops/test_gpt2_mlp_ext.py
# compares the bodies bit for bit and byte for byte.


def _ext_mlp_backward(steps, dy, owned: bool):
    # NOTE [GPT-2's MLP backward from C++]; None where it does not apply
    fc, act, proj, drop = steps
    if not (
        proj.lead is not None
        and fc.lead is not None
        and type(dy) is _Tensor
        and not _dispatch_stack_len()
    ):
        return None
    if drop is not None:
        lib = drop.lib
        if lib is None:
            return None
        key = (drop.p, _dr._F32, dy.device)
        scale = _dr._SCALES[key] if key in _dr._SCALES else _dr._scale(drop.p, dy)
        bits_r, n_r = drop.saved_tensors[0], drop.n
        daddr = _dr.BWD_ADDR[lib] if lib in _dr.BWD_ADDR else _dr.c_addr(lib, "bwd")
    else:
        bits_r, n_r, scale, daddr = None, 0, 0.0, 0
    y, w_proj = proj.saved_tensors
    mp, mf = proj.needs_input_grad, fc.needs_input_grad
    if mp[0]:
        cp = act.cpath
        if cp is None:
            return None
        if act.held:  # NOTE [Side tables under torch.utils.checkpoint]: rebuilt, unpacked once
            saved = side_tensors(act)
            if saved[0] is None:  # the recompute's dense fallback: the Python body takes it
                act.side = saved
                return None
        else:
            saved = act.saved_tensors
        ay, abits, idx, xs = saved
        gaddr = _GELU_BWD_ADDR.get(cp)
        if gaddr is None:
            gaddr = _GELU_BWD_ADDR[cp] = _cpu.address(cp.bwd)
        x, w_fc = fc.saved_tensors
        tn, y_hi, y_lo, s2, sc_r, sc_l = cp.bwd_args
        r = _EXT_MLP(
            dy, owned, bits_r, n_r, scale, daddr, y, w_proj, True, mp[1], mp[2] and proj.has_bias,
            ay, abits, idx, xs, act.n, gaddr, cp.tab, tn, y_hi, y_lo, s2, sc_r, sc_l,
            act.approximate, x, w_fc, mf[0], mf[1], mf[2] and fc.has_bias,
        )  # fmt: skip
        if r is None and act.held:  # declined: the Python body reads what was rebuilt here
            act.side = saved
        return r
    return _EXT_MLP(
        dy, owned, bits_r, n_r, scale, daddr, y, w_proj, False, mp[1], mp[2] and proj.has_bias,
        None, None, None, None, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, "none", None, None, False,
        False, False,
    )  # fmt: skip


def _mlp_backward(steps, dy, owned: bool):
    # the MLP's steps' backward in reverse order (dropout, c_proj, GELU, c_fc): (dx, dw_fc, db_fc,
    # dw_proj, db_proj); dx is c_fc's, made here (a buffer nobody else holds)
    if _EXT_MLP is not None:
        r = _ext_mlp_backward(steps, dy, owned)
        if r is not None:
            return r
    fc, act, proj, drop = steps
    g = _dropout_backward(drop, dy, owned) if drop is not None else dy
    del dy
    # c_proj's gradient arrives as its 2-D product's (NOTE [Linear's 2-D product] in ops/linear.py)
    g2 = g.reshape(-1, g.shape[-1]) if proj.lead is not None else g
    del g
    dh, dw_proj, db_proj = _LinearFn.backward(proj, g2)[:3]
    del g2
    dw_fc = db_fc = dx = None
    if dh is not None:
        if act is not None:
            dh = _gelu_backward(act, dh)
        dh2 = dh.reshape(-1, dh.shape[-1]) if fc.lead is not None else dh
        del dh
        dx, dw_fc, db_fc = _LinearFn.backward(fc, dh2)[:3]
    return dx, dw_fc, db_fc, dw_proj, db_proj


def _backward(ctx, dy, owned: bool = False):
    _hand_out_saved(ctx)
    dx, dw_fc, db_fc, dw_proj, db_proj = _mlp_backward(ctx.steps, dy, owned)
    del dy
    _release_saved(ctx.steps)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dw_fc,
        db_fc,
        dw_proj,
        db_proj,
        None,
        None,
        None,
        None,
    )


def _mlp_forward(n, x, w_fc, b_fc, w_proj, b_proj, approximate, p, direct, later=None):
    # the MLP's steps in eager's order; n: needs_input_grad of (x, w_fc, b_fc, w_proj, b_proj);
    # ``later`` (no dropout step): a list where c_proj's product is left to run after the saves
    # (NOTE [c_proj's product after the saves]), or None
    need_h = n[0] or n[1] or n[2]
    fc = _Step()
    fc.needs_input_grad = (n[0], n[1], n[2], False, False)
    h = _LinearFn.forward(fc, x, w_fc, b_fc, True, direct)
    if fc.lead is not None:
        h = h.view(fc.lead + h.shape[-1:])
    if need_h:
        act = _Step()
        y = _ge._GeluFn.forward(act, h, approximate, direct)
        if not direct:
            y = y[0]
        act.approximate = approximate
    else:
        act = None
        y = _ge._fwd_torch(h, approximate)
    del h
    proj = _Step()
    proj.needs_input_grad = (need_h, n[3], n[4], False, False)
    # NOTE [c_proj's product after the saves]: only where c_proj keeps y anyway (its weight
    # needs a gradient), so y waiting for the product holds no bytes of its own
    if later is not None and p is None and n[3]:
        # _LinearFn.forward's bookkeeping (w_in_out), its product left to the caller
        proj.w_in_out, proj.has_bias = True, b_proj is not None
        proj.to_save = (y if n[3] else None, w_proj if need_h else None)
        proj.lead = y.shape[:-1] if y.ndim > 2 else None
        later.append((y, w_proj, None, b_proj, True))
        return (fc, act, proj, None), y.new_empty((*y.shape[:-1], w_proj.shape[-1]))
    z = _LinearFn.forward(proj, y, w_proj, b_proj, True, direct)
    if proj.lead is not None:
        z = z.view(proj.lead + z.shape[-1:])
    del y
    drop = None
    if p is not None:
        drop = _Step()
        z = _dr._DropoutFn.forward(drop, z, p, direct)
    return (fc, act, proj, drop), z


class _GPT2MLPFn(torch.autograd.Function):
    # NOTE [One node for GPT-2's MLP]; x and y are matmul inputs (NOTE [The matmul-input floor]
    # in memory.py: the node's bits count there too, 1/8 B/elt)
    _slimgrad_floor = True

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj, approximate, p, direct=False, later=None):
        # direct: the caller passed the gate (NOTE [One gate per call] in slimgrad/_library.py);
        # later: NOTE [c_proj's product after the saves]
        steps, z = _mlp_forward(
            ctx.needs_input_grad, x, w_fc, b_fc, w_proj, b_proj, approximate, p, direct, later
        )
        _save_steps(ctx, steps)
        return fresh(z)

    @staticmethod
    def backward(ctx, dy):
        if _grad_on():  # create_graph=True (NOTE [Second derivatives] in slimgrad/_autograd.py)
            return refuse_second_order("ops.gpt2_mlp", _backward, ctx, (dy,), _DOUBLE_FIX)
        # first use of dy: NOTE [Gradient-buffer ownership], as the per-op Dropout's backward
        owned = (
            ctx.steps[3] is not None and not compiling() and ownership.grant(dy, ownership.PROBE)
        )
        return _backward(ctx, dy, owned)


_GPT2_MLP_APPLY = direct_apply(_GPT2MLPFn)


def _ln_mlp_backward(ctx, dy, owned: bool = False):
    ln, fc, act, proj, drop = ctx.steps
    _hand_out_saved(ctx)
    dy_ln, dw_fc, db_fc, dw_proj, db_proj = _mlp_backward((fc, act, proj, drop), dy, owned)
    del dy
    dx = dw = db = None
    if dy_ln is not None:
        dx, dw, db = layer_norm_backward(ln, dy_ln)
        del dy_ln
    _release_saved(ctx.steps)
    return (dx, dw, db, None, None, None, dw_fc, db_fc, dw_proj, db_proj, None, None, None, None)


class _GPT2LNMLPFn(torch.autograd.Function):
    # NOTE [A LayerNorm folded into its consumer's node]: GPT-2's ln_2, then NOTE [One node for
    # GPT-2's MLP]
    _slimgrad_floor = True

    @staticmethod
    def forward(
        ctx, x, ln_w, ln_b, arg, eps, y_kept_after, w_fc, b_fc, w_proj, b_proj, approximate, p,
        direct, later=None,
    ):  # fmt: skip
        n = ctx.needs_input_grad
        ln, y = layer_norm_forward(n, x, arg, ln_w, ln_b, eps, y_kept_after, direct)
        need_y = n[0] or n[1] or n[2]
        steps, z = _mlp_forward(
            (need_y, n[6], n[7], n[8], n[9]), y, w_fc, b_fc, w_proj, b_proj, approximate, p,
            direct, later,
        )  # fmt: skip
        del y
        _save_steps(ctx, (ln, *steps))
        return fresh(z)

    @staticmethod
    def backward(ctx, dy):
        if _grad_on():  # create_graph=True (NOTE [Second derivatives] in slimgrad/_autograd.py)
            return refuse_second_order("ops.gpt2_mlp", _ln_mlp_backward, ctx, (dy,), _DOUBLE_FIX)
        # first use of dy: NOTE [Gradient-buffer ownership], as the per-op Dropout's backward
        owned = (
            ctx.steps[4] is not None and not compiling() and ownership.grant(dy, ownership.PROBE)
        )
        return _ln_mlp_backward(ctx, dy, owned)


_GPT2_LN_MLP_APPLY = direct_apply(_GPT2LNMLPFn)


def _ac_backward(ctx, dy, owned: bool = False):
    # NOTE [GPT-2's MLP under autocast]: dropout's, c_proj's, GELU's (eager's gelu_backward on h)
    # and c_fc's backward, each on the per-op path's operands; c_proj's weight gradient first, on
    # y = gelu(h) recomputed and dropped before c_proj's dx is made
    fc, act, proj, drop = ctx.steps
    _hand_out_saved(ctx)
    g = _dropout_backward(drop, dy, owned) if drop is not None else dy
    del dy
    h = act.saved_tensors[0] if act is not None else None
    y, master = proj.saved_tensors
    proj.saved_tensors = ()
    m = proj.needs_input_grad
    if ctx.recompute_y:
        y = _ge._fwd_torch(h, act.approximate)  # forward's y: the same kernel on the same h
    _, dt_proj, db_proj = _linear_bwd(g, y, None, proj.has_bias, True, (False, m[1], m[3]))
    del y
    dh = None
    if m[0]:  # eager's cast of the weight, the same bits (NOTE [Autocast weight casts])
        dh = _linear_bwd(g, None, master.to(proj.cast_dtype), False, True, (True, False, False))[0]
    # g's buffer is this node's (dropout's output, or dy granted) and dead from here: c_fc's dx,
    # of x's shape and dtype, is written into it (the engine holds dy until the node returns)
    buf = g if (owned or drop is not None) and g.is_contiguous() else None
    del g, master
    dx = dt_fc = db_fc = None
    if dh is not None:
        # eager's GeluBackward on h, into dh (made here, seen by nobody else): the same bits
        dh = _gelu_bwd_into(dh, h, approximate=act.approximate, grad_input=dh)
        del h
        x, master = fc.saved_tensors
        fc.saved_tensors = ()
        m = fc.needs_input_grad
        dh2 = dh.view(-1, dh.shape[-1])
        if m[0]:  # _bwd_torch's mm (out=), into buf where it fits
            w = master.to(fc.cast_dtype).t()  # eager's cast, the same bits
            if (
                buf is None
                or buf.shape[:-1] != dh.shape[:-1]
                or buf.dtype != dh.dtype
                or buf.shape[-1] != w.shape[1]
            ):
                buf = dh.new_empty((*dh.shape[:-1], w.shape[1]))
            torch.mm(dh2, w, out=buf.view(-1, w.shape[1]))
            dx = buf
            del w
        del buf, master
        _, dt_fc, db_fc = _linear_bwd(dh2, x, None, fc.has_bias, True, (False, m[1], m[3]))
    _release_saved(ctx.steps)
    return dx, dt_fc, None, db_fc, None, dt_proj, None, db_proj, None, None, None, None, None


def _ac_double(ctx, dy):
    # create_graph=True: the backward with differentiable ops, h recomputed from x's cast, c_fc's
    # weight and bias (forward's bits) so that its gradients carry h's history: eager's second
    # derivatives, the first-order backward's values. Without x's cast kept (c_fc's weight
    # frozen) h has no history here: first derivatives only.
    fc, act, proj, drop = ctx.steps
    if act is not None and not fc.needs_input_grad[1]:
        return refuse_second_order("ops.gpt2_mlp", _ac_backward, ctx, (dy,), _DOUBLE_FIX)
    _hand_out_saved(ctx)
    x, w_fc = fc.saved_tensors
    y, w_proj = proj.saved_tensors
    dt = fc.cast_dtype
    g = _dr._double(drop, dy)[0] if drop is not None else dy
    g2 = g.reshape(-1, g.shape[-1])
    mp = proj.needs_input_grad
    if act is not None:
        b = act.saved_tensors[1]
        x2, w16 = x.view(-1, x.shape[-1]), w_fc.to(dt)
        h = torch.addmm(b.to(dt), x2, w16) if b is not None else x2 @ w16
        y2 = _ge._fwd_torch(h, act.approximate)
    else:
        y2 = y.reshape(-1, y.shape[-1]) if mp[1] else None
    dt_proj = y2.t() @ g2 if mp[1] else None
    db_proj = g2.sum(0) if mp[3] and proj.has_bias else None
    dx = dt_fc = db_fc = None
    if act is not None:
        dh = _gelu_bwd(g2 @ w_proj.to(dt).t(), h, approximate=act.approximate)
        m = fc.needs_input_grad
        if m[0]:
            dx = (dh @ w16.t()).view(x.shape)
        dt_fc = x2.t() @ dh
        if m[3] and fc.has_bias:
            db_fc = dh.sum(0)
    _release_saved(ctx.steps)
    return dx, dt_fc, None, db_fc, None, dt_proj, None, db_proj, None, None, None, None, None


class _GPT2MLPAutocastFn(torch.autograd.Function):
    # NOTE [GPT-2's MLP under autocast]: x is c_fc's input as autocast casts it, t_* the weights'
    # cast tokens and w_* the fp32 leaf weights (NOTE [Autocast weight casts] in ops/linear.py),
    # b_* the biases as autocast hands them over; dt: autocast's dtype
    _slimgrad_floor = True

    @staticmethod
    def forward(
        ctx, x, t_fc, w_fc, b_fc, bm_fc, t_proj, w_proj, b_proj, dt, approximate, p, direct,
        later=None,
    ):  # fmt: skip
        # later: NOTE [c_proj's product after the saves] (None, or a list where there is no
        # dropout step)
        n = ctx.needs_input_grad
        need_h = n[0] or n[1] or n[3]  # anything before the GELU
        fc = _Step()
        fc.needs_input_grad = (n[0], n[1], False, n[3], False, False)
        h = _AutocastLinearFn.forward(fc, x, t_fc, w_fc, b_fc, dt, True)
        proj = _Step()
        proj.needs_input_grad = (need_h, n[5], False, n[7], False, False)
        if later is not None and p is None and need_h:
            # NOTE [c_proj's product after the saves]: h is kept (the GELU's backward), y not
            # made here: the fill makes it from h (eager's GELU on h, its bits) for the product
            autocast_linear_setup(proj, h, w_proj, b_proj, dt, True)
            proj.to_save = (None, None)  # y is recomputed from h in backward (recompute_y)
            later.append((h, approximate, w_proj, dt, b_proj))
            z = h.new_empty((*h.shape[:-1], w_proj.shape[-1]))
        else:
            y = _ge._fwd_torch(h, approximate)  # eager's GELU on h: its bits
            z = _AutocastLinearFn.forward(proj, y, t_proj, w_proj, b_proj, dt, True)
            del y
        act = None
        ctx.recompute_y = need_h and n[5]
        if need_h:  # h for the GELU's backward; y (c_proj's x) recomputed from it
            act = _Step()
            # + c_fc's fp32 bias: a Parameter (no bytes), for the double backward's h
            act.to_save, act.approximate = (h, bm_fc), approximate
            if ctx.recompute_y:
                proj.to_save = (None, proj.to_save[1])
        # the weights (resident Parameters, no bytes) for the double backward
        fc.to_save = (fc.to_save[0], w_fc)
        proj.to_save = (proj.to_save[0], w_proj)
        del h
        drop = None
        if p is not None:
            drop = _Step()
            z = _dr._DropoutFn.forward(drop, z, p, direct)
        _save_steps(ctx, (fc, act, proj, drop))
        return z

    @staticmethod
    def backward(ctx, dy):
        if _grad_on():  # create_graph=True (NOTE [Second derivatives] in slimgrad/_autograd.py)
            return _ac_double(ctx, dy)
        # first use of dy: NOTE [Gradient-buffer ownership]; a dead dy takes dropout's dx, or
        # without dropout c_fc's
        owned = not compiling() and ownership.grant(dy, ownership.PROBE)
        return _ac_backward(ctx, dy, owned)


_GPT2_MLP_AC_APPLY = direct_apply(_GPT2MLPAutocastFn)


def gpt2_mlp(
    input: torch.Tensor,
    c_fc_weight: torch.Tensor,
    c_fc_bias: torch.Tensor | None,
    c_proj_weight: torch.Tensor,
    c_proj_bias: torch.Tensor | None,
    approximate: str = "tanh",
    p: float = 0.0,
    training: bool = True,
) -> torch.Tensor:
    """HF GPT-2's MLP, ``dropout(gelu(input @ W_fc + b_fc) @ W_proj + b_proj, p, training)``,
    as one autograd node (NOTE [One node for GPT-2's MLP]).

    Memory: saves input (if ``c_fc_weight`` needs grad), gelu's output + 1/8 B/elt of bits + the
    GELU's sparse table, and the dropout mask as 1/8 B/elt: what the per-op ops keep, together.

    Args:
        input: ``(*, in)`` float32.
        c_fc_weight: ``(in, hidden)``; c_fc_bias: ``(hidden,)`` or None.
        c_proj_weight: ``(hidden, out)``; c_proj_bias: ``(out,)`` or None.
        approximate: the GELU's form, ``'none'`` (erf) or ``'tanh'`` (HF ``gelu_new``).
        p: dropout probability. training: dropout on (as ``F.dropout``'s ``training``).

    Returns:
        ``(*, out)``: the per-op composition's values, bit for bit.

    Raises:
        ValueError: unknown ``approximate`` or ``p`` outside [0, 1].

    Example:
        >>> w1, w2 = torch.randn(8, 32, requires_grad=True), torch.randn(32, 8)
        >>> y = gpt2_mlp(torch.randn(2, 600, 8), w1, None, w2, None, "tanh", 0.1)
    """
    _ge._check_approximate(approximate)
    _dr._check_p("ops.gpt2_mlp", p)
    drop = p if training and 0.0 < p < 1.0 else None
    if block_ok(input, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias) and (
        training is False or p < 1.0
    ):
        return apply(input, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias, approximate, drop)
    from slimgrad.ops.dropout import dropout
    from slimgrad.ops.gelu import gelu
    from slimgrad.ops.linear import conv1d_addmm

    h = gelu(conv1d_addmm(input, c_fc_weight, c_fc_bias), approximate)
    return dropout(conv1d_addmm(h, c_proj_weight, c_proj_bias), p, training)


_Parameter = torch.nn.Parameter
# slimgrad.memory.estimate's fake tensors take the node as real ones do: the same saved tensors
# (NOTE [Converted Linear outside autocast] in slimgrad/nn/linear.py)
_PLAIN = (torch.Tensor, torch.nn.Parameter, _FakeTensor)
_PLAIN_OR_NONE = (torch.Tensor, torch.nn.Parameter, _FakeTensor, type(None))
_F32 = torch.float32
_C = torch._C
_functorch_on = _C._are_functorch_transforms_active
_is_tracing = _C._is_tracing
_any_autocast = _C._is_any_autocast_enabled


def block_ok(x, w_fc, b_fc, w_proj, b_proj) -> bool:
    """Whether the one-node path applies: eager (not compiling, no ``torch.func`` transform,
    TorchScript trace or autocast), grad mode on with something that needs a gradient, plain
    float32 tensors of matching shapes, and more than 512 elements of h (NOTE [One node for
    GPT-2's MLP]: the second-derivative rule)."""
    if (
        compiling()
        or _functorch_on()
        or _is_tracing()
        or _any_autocast()
        or not _grad_on()
        or type(x) not in _PLAIN
        or type(w_fc) not in _PLAIN
        or type(w_proj) not in _PLAIN
        or type(b_fc) not in _PLAIN_OR_NONE
        or type(b_proj) not in _PLAIN_OR_NONE
    ):
        return False
    if not (
        x.requires_grad
        or w_fc.requires_grad
        or w_proj.requires_grad
        or (b_fc is not None and b_fc.requires_grad)
        or (b_proj is not None and b_proj.requires_grad)
    ):
        return False
    if x.is_meta or x.ndim == 0 or w_fc.ndim != 2 or w_proj.ndim != 2:
        return False
    if x.shape[-1] != w_fc.shape[0] or w_fc.shape[1] != w_proj.shape[0] or 0 in x.shape:
        return False
    if not (x.dtype is _F32 and w_fc.dtype is _F32 and w_proj.dtype is _F32):
        return False
    rows = x.numel() // x.shape[-1]
    return rows * w_fc.shape[1] > DENSE_MAX


def apply(x, w_fc, b_fc, w_proj, b_proj, approximate: str, p: float | None) -> torch.Tensor:
    """The node on arguments :func:`block_ok` accepted; ``p`` None: no dropout."""
    from slimgrad._autograd import unwrap_if_dead

    later = later_list(p)
    out = _GPT2_MLP_APPLY(
        unwrap_if_dead(x), w_fc, b_fc, w_proj, b_proj, approximate, p, straight(), later
    )
    return out if not later else _product_after(out, later)


# NOTE [c_proj's product after the saves]
# The one-node MLP's saved tensors reach saved-tensor hooks when its forward returns, after
# c_proj's product; with no dropout step after it (GPT-2 at dropout 0), a non-reentrant
# checkpoint of a block ending in it ran that product again, which eager's Conv1D (its addmm saves
# its inputs first) never does: 13,631,488 recomputed matmul FLOPs against eager's 9,437,184 on a
# 2-layer, 64-wide GPT-2 at 2 x 32 tokens. As the gated MLP (NOTE [The down product after the
# saves] in ops/gated_mlp.py), under checkpoint's own hooks and only reading dispatch modes, the
# node does c_proj's bookkeeping, returns the output's buffer unfilled and hands the product to
# ``_product_after`` (ops/linear.py: addmm or mm into the buffer's 2-D view, the kernel of
# _LinearFn's forward, the same bits) once ``apply`` returned. Only where waiting holds no bytes
# of its own (a review: a GELU output held through the saves was one activation above the
# parent's peak under a copying pack hook): the float32 node defers where c_proj keeps y (its
# weight needs a gradient); the autocast node, which keeps h and recomputes y in backward, makes
# y from h at the fill instead of in forward (eager's GELU on h, the same bits). With a dropout
# step after c_proj its mask is saved after the product anyway (eager's too), and nothing
# changes.
def later_list(p) -> list | None:
    """A list for :class:`_GPT2MLPFn`'s ``later`` where c_proj's product may wait (NOTE [c_proj's
    product after the saves]), else None."""
    return [] if p is None and _top_hooks(False) is not None and later_ok() else None


_HALF = (torch.bfloat16, torch.float16)
_autocast_on = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype


def autocast_ok(x, w_fc, b_fc, w_proj, b_proj) -> bool:
    """Whether the autocast node applies (NOTE [GPT-2's MLP under autocast]): eager (not
    compiling, no ``torch.func`` transform or TorchScript trace), autocast to bfloat16 or float16
    on ``x``'s device, grad mode on with something that needs a gradient, a contiguous float32
    (or autocast's dtype) ``x``, float32 leaf weights slimgrad casts itself (NOTE [Autocast
    weight casts]) and float32 biases (or None), of matching shapes."""
    if (
        compiling()
        or _functorch_on()
        or _is_tracing()
        or not _any_autocast()
        or not _grad_on()
        or type(x) not in _PLAIN
        or type(w_fc) not in _PLAIN
        or type(w_proj) not in _PLAIN
        or type(b_fc) not in _PLAIN_OR_NONE
        or type(b_proj) not in _PLAIN_OR_NONE
    ):
        return False
    dev = x.device.type
    if not _autocast_on(dev):
        return False
    dt = _autocast_dtype(dev)
    if dt not in _HALF or x.dtype not in (_F32, dt):
        return False
    if not (
        x.requires_grad
        or w_fc.requires_grad
        or w_proj.requires_grad
        or (b_fc is not None and b_fc.requires_grad)
        or (b_proj is not None and b_proj.requires_grad)
    ):
        return False
    if x.is_meta or x.ndim == 0 or w_fc.ndim != 2 or w_proj.ndim != 2 or not x.is_contiguous():
        return False
    if x.shape[-1] != w_fc.shape[0] or w_fc.shape[1] != w_proj.shape[0] or 0 in x.shape:
        return False
    if (b_fc is not None and b_fc.dtype is not _F32) or (
        b_proj is not None and b_proj.dtype is not _F32
    ):
        return False
    return (
        w_fc.dtype is _F32
        and w_proj.dtype is _F32
        and keeps_master(w_fc, dt)
        and keeps_master(w_proj, dt)
    )


def autocast_apply(x, w_fc, b_fc, w_proj, b_proj, approximate: str, p: float | None):
    """The autocast node on arguments :func:`autocast_ok` accepted; ``p`` None: no dropout. The
    casts are the per-op path's: x's ``.to`` (HF's Conv1D casts its 2-D view), each bias as
    autocast's cache hands it over, each weight's cast token (NOTE [Autocast weight casts])."""
    from slimgrad._autograd import unwrap_if_dead

    dev = x.device.type
    dt = _autocast_dtype(dev)
    # in the per-op path's order (each bias's cast before its weight's token): backward then
    # casts each weight's gradient to fp32 before its bias's, as per op
    x16 = unwrap_if_dead(x).to(dt)
    b_fc16 = _autocast_cast(b_fc, dev, dt)
    t_fc = autocast_weight(w_fc, dt)
    b_proj16 = _autocast_cast(b_proj, dev, dt)
    t_proj = autocast_weight(w_proj, dt)
    later = later_list(p)  # NOTE [c_proj's product after the saves]
    with torch.autocast(dev, enabled=False):
        z = _GPT2_MLP_AC_APPLY(
            x16, t_fc, w_fc, b_fc16, b_fc, t_proj, w_proj, b_proj16, dt, approximate, p,
            straight(), later,
        )  # fmt: skip
        if later:  # y made from the kept h, then c_proj's product into z
            h, approx, w, wdt, b = later.pop()
            later.append((_ge._fwd_torch(h, approx), w, wdt, b, True))
            del h
            _product_after(z, later)
        return z


def ln_ok(x, weight, bias) -> bool:
    """Whether a LayerNorm over ``x``'s last dim with ``weight`` and ``bias`` folds into the block
    node after it (NOTE [A LayerNorm folded into its consumer's node]): float32 ``(C,)`` weight
    and bias (plain, or the estimate's fakes) and something before the node needing a gradient;
    the consumer's own gate checks ``x``."""
    return (
        type(weight) in _PLAIN
        and type(bias) in _PLAIN
        and weight.dtype is _F32
        and bias.dtype is _F32
        and weight.ndim == 1
        and bias.shape == weight.shape
        and x.shape[-1:] == weight.shape
        and (x.requires_grad or weight.requires_grad or bias.requires_grad)
    )


# this module is imported after slimgrad's own import (NOTE [Forward-mode AD is refused], NOTE
# [Backward without autocast])
refuse_forward_ad()
backward_without_autocast()
