"""PyTorch's OpInfo samples run through slimgrad's ops (issue 15).

For every slimgrad op with a torch counterpart in
``torch.testing._internal.common_methods_invocations.op_db``, every sample of that OpInfo
(``reference_inputs``, which starts with ``sample_inputs``; ``error_inputs``) is run through the
slimgrad op and through eager PyTorch, in float64/float32/bfloat16/float16 where the OpInfo
supports the dtype on CPU. A check is one of:

- ``forward``: output values (float64: ``assert_close`` with eager; lower precision: the error
  rule against eager at float64), dtype, shape, strides (eager's layout), and every tensor
  argument after the call (batch_norm's running statistics);
- ``grad``: every gradient under a random cotangent, for all differentiable inputs at once and for
  each one alone (``needs_input_grad`` gating), by the same rule;
- ``gradcheck`` (float64, samples up to ``GRADCHECK_NUMEL`` elements);
- ``double`` (float64): second derivatives through ``create_graph=True`` w.r.t. the inputs and the
  cotangent against eager's (a None where eager has a tensor is a failure), plus
  ``gradgradcheck`` on samples up to ``GRADGRAD_NUMEL`` elements;
- ``inplace``: the in-place variant where the OpInfo has one (values, identity of the result,
  gradients through a non-leaf with the sample's strides), float32 and bfloat16;
- ``error``: an error input must raise eager's error type with eager's message or a slimgrad
  message naming the op;
- ``noncontig`` / ``channels_last`` (norms, conv, linear; float32): ``forward`` and ``grad`` on the
  sample with every tensor non-contiguous, and with a 4-D/5-D input in channels_last (their
  OpInfo samples are all contiguous; the elementwise ops' reference inputs already include
  strided, transposed and overlapping layouts).

Random ops (dropout) are compared bit for bit with ``F.dropout`` from the same seed. Gradients of
elementwise ops at NaN inputs are not compared (see ``_nan_inputs``).

A slimgrad error (``slimgrad.<api>: ...``) where eager returns is a refusal: it passes only when
``_tables.REFUSED`` lists it. Everything else that fails is a finding; ``_tables.KNOWN`` lists the
ones still open as strict xfails.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from collections.abc import Callable

import torch
from torch.autograd.gradcheck import GradcheckError

import slimgrad.ops as sg
from slimgrad.testing import DEFAULT_ATOL, max_abs_err, rule_ok

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
SHORT = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
GRADCHECK_NUMEL = 1200  # total elements of the differentiable inputs
GRADCHECK_SLOW_NUMEL = 24  # up to this, the full (slow-mode) Jacobian; above, fast mode
GRADGRAD_NUMEL = 150
# OpInfo's reference inputs for elementwise ops include ~1M-element tensors (a contiguous one
# for the vectorized paths, strided and transposed copies); they take most of the time, so only
# the contiguous one runs, in float32 and bfloat16 (the precision edge) for forward+grad and
# float32 for the in-place variant, never in the float64 second-order checks. Strided and
# transposed layouts are covered by the smaller reference inputs (9 to 128x128 elements).
BIG_NUMEL = 100_000
# In-place variants run in float32 and bfloat16: what they add over the out-of-place check is
# aliasing (views, strides, overlap, version counters), which does not depend on the dtype;
# bfloat16 keeps the low-precision edge.
INPLACE_DTYPES = (torch.float32, torch.bfloat16)
BIG_DTYPES = {
    "sample": (torch.float32, torch.bfloat16),
    "inplace": (torch.float32,),
    "f64": (),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    key: str  # test id stem
    opinfo: str  # op_db name
    group: str  # test file
    fn: Callable
    inplace: Callable | None = None  # slimgrad's in-place variant (used where the OpInfo has one)
    random: bool = False  # draws from the global generator (dropout): both sides get one seed
    elementwise: bool = True  # gradients at NaN inputs are not compared (see _nan_inputs)
    # eager callables replacing the OpInfo's (dropout's OpInfo op reseeds with 42 inside), or
    # an in-place variant where the OpInfo has none
    eager: Callable | None = None
    eager_inplace: Callable | None = None


SPECS = [
    # relu, hardtanh, relu6: OpInfo has no in-place variant; F.<op>(inplace=True) is theirs
    Spec(
        "relu",
        "nn.functional.relu",
        "act",
        sg.relu,
        sg.relu_,
        eager_inplace=functools.partial(torch.nn.functional.relu, inplace=True),
    ),
    Spec("sigmoid", "sigmoid", "act", sg.sigmoid, sg.sigmoid_),
    Spec("tanh", "tanh", "act", sg.tanh, sg.tanh_),
    Spec(
        "hardtanh",
        "nn.functional.hardtanh",
        "act",
        sg.hardtanh,
        sg.hardtanh_,
        eager_inplace=functools.partial(torch.nn.functional.hardtanh, inplace=True),
    ),
    Spec(
        "relu6",
        "nn.functional.relu6",
        "act",
        sg.relu6,
        sg.relu6_,
        eager_inplace=functools.partial(torch.nn.functional.relu6, inplace=True),
    ),
    Spec("leaky_relu", "nn.functional.leaky_relu", "act", sg.leaky_relu, sg.leaky_relu_),
    Spec("elu", "nn.functional.elu", "act", sg.elu, sg.elu_),
    Spec("gelu", "nn.functional.gelu", "act", sg.gelu, sg.gelu_),
    Spec("silu", "nn.functional.silu", "act", sg.silu, sg.silu_),
    Spec("mish", "nn.functional.mish", "act", sg.mish, sg.mish_),
    Spec(
        "dropout",
        "nn.functional.dropout",
        "dropout",
        sg.dropout,
        sg.dropout_,
        random=True,
        eager=torch.nn.functional.dropout,
        eager_inplace=functools.partial(torch.nn.functional.dropout, inplace=True),
    ),
    Spec("layer_norm", "nn.functional.layer_norm", "norm", sg.layer_norm, elementwise=False),
    Spec("rms_norm", "nn.functional.rms_norm", "norm", sg.rms_norm, elementwise=False),
    Spec("group_norm", "nn.functional.group_norm", "norm", sg.group_norm, elementwise=False),
    Spec("batch_norm", "nn.functional.batch_norm", "norm", sg.batch_norm, elementwise=False),
    Spec("conv1d", "nn.functional.conv1d", "conv", sg.conv1d, elementwise=False),
    Spec("conv2d", "nn.functional.conv2d", "conv", sg.conv2d, elementwise=False),
    Spec("conv3d", "nn.functional.conv3d", "conv", sg.conv3d, elementwise=False),
    Spec(
        "conv_transpose1d",
        "nn.functional.conv_transpose1d",
        "conv",
        sg.conv_transpose1d,
        elementwise=False,
    ),
    Spec(
        "conv_transpose2d",
        "nn.functional.conv_transpose2d",
        "conv",
        sg.conv_transpose2d,
        elementwise=False,
    ),
    Spec(
        "conv_transpose3d",
        "nn.functional.conv_transpose3d",
        "conv",
        sg.conv_transpose3d,
        elementwise=False,
    ),
    Spec("linear", "nn.functional.linear", "linear", sg.linear, elementwise=False),
    Spec("matmul", "matmul", "linear", sg.matmul, elementwise=False),
]
SPEC = {s.key: s for s in SPECS}


# --------------------------------------------------------------------------------- op_db access


@dataclasses.dataclass(frozen=True)
class _Eager:
    op: Callable
    inplace_variant: Callable | None
    info: object

    def __getattr__(self, name):
        return getattr(self.info, name)


@functools.cache
def opinfo(key: str):
    from torch.testing._internal.common_methods_invocations import op_db

    spec = SPEC[key]
    (op,) = [o for o in op_db if o.name == spec.opinfo and o.variant_test_name == ""]
    if spec.eager is None and spec.eager_inplace is None:
        return op
    return _Eager(spec.eager or op.op, spec.eager_inplace or op.inplace_variant, op)


def dtypes(key: str) -> list[torch.dtype]:
    supported = opinfo(key).supported_dtypes("cpu")
    return [d for d in DTYPES if d in supported]


def backward_dtypes(key: str) -> set[torch.dtype]:
    op = opinfo(key)
    return set(op.supported_backward_dtypes("cpu")) if op.supports_autograd else set()


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _info(key: str):
    op = opinfo(key)
    return op.info if isinstance(op, _Eager) else op


def _generate(key: str, dtype: torch.dtype, plain: bool = False) -> list:
    # The generator functions directly: OpInfo.reference_inputs wraps them in a tracker that
    # walks the Python stack (inspect.stack) per call, seconds per op under pytest.
    op = _info(key)
    torch.manual_seed(_seed(key, dtype))
    rg = dtype in backward_dtypes(key)
    fn = (None if plain else op.reference_inputs_func) or op.sample_inputs_func
    return list(fn(op, "cpu", dtype, rg))


@functools.cache
def _load(key: str, dtype: torch.dtype) -> tuple[tuple, tuple]:
    # Generated once per process (collection reads the metadata, the tests the samples); the
    # big samples no check runs are dropped (None) so every (op, dtype) can stay cached.
    gen = _generate(key, dtype)
    info = tuple(
        (s.input.numel(), s.input.dim(), bool(diff_paths(s)), s.input.is_contiguous()) for s in gen
    )
    keep_big = {dt for dts in BIG_DTYPES.values() for dt in dts}
    kept = tuple(
        None if (n > BIG_NUMEL and (not contig or dtype not in keep_big)) else s
        for s, (n, _, _, contig) in zip(gen, info)
    )
    return kept, info


def samples(key: str, dtype: torch.dtype) -> tuple:
    return _load(key, dtype)[0]


def meta(key: str, dtype: torch.dtype) -> tuple[tuple[int, int, bool, bool], ...]:
    """(input elements, dims, has differentiable tensors, contiguous) per sample (collection)."""
    return _load(key, dtype)[1]


# Layout variants of every sample, for the ops whose OpInfo samples are all contiguous (norms,
# conv, linear): the sample with every tensor non-contiguous (OpInfo's own ``noncontiguous()``),
# and a 4-D/5-D input in channels_last. float32 only.
VARIANTS = ("noncontig", "channels_last")
VARIANT_GROUPS = ("norm", "conv", "linear")


def variant(sample, name: str | None):
    if name is None:
        return sample
    if name == "noncontig":
        return sample.noncontiguous()
    from torch.testing._internal.opinfo.core import SampleInput

    x = sample.input
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    xc = x.detach().contiguous(memory_format=fmt).requires_grad_(x.requires_grad)
    return SampleInput(
        xc,
        args=sample.args,
        kwargs=sample.kwargs,
        output_process_fn_grad=sample.output_process_fn_grad,
    )


@functools.cache
def n_plain_samples(key: str, dtype: torch.dtype) -> int:
    """reference_inputs starts with sample_inputs; the rest add extremal values (inf, nan, 0 at
    kinks) where finite differences mean nothing, so gradcheck runs on the first ones only (as
    PyTorch's own test_fn_grad does)."""
    return len(_generate(key, dtype, plain=True))


@functools.cache
def error_inputs(key: str) -> tuple:
    op = _info(key)
    if op.error_inputs_func is None:
        return ()
    torch.manual_seed(_seed(key, "errors"))
    return tuple(op.error_inputs_func(op, "cpu"))


def cases(kind: str, groups: tuple[str, ...]) -> list[tuple[str, torch.dtype | None, int]]:
    """(key, dtype, index) for every check of ``kind`` in the given test groups."""
    out = []
    for spec in SPECS:
        if spec.group not in groups:
            continue
        if kind == "error":
            out += [(spec.key, None, i) for i in range(len(error_inputs(spec.key)))]
            continue
        if kind == "inplace" and opinfo(spec.key).inplace_variant is None:
            continue
        if kind in VARIANTS:
            if spec.group not in VARIANT_GROUPS:
                continue
            out += [
                (spec.key, torch.float32, i)
                for i, (_, d, _, _) in enumerate(meta(spec.key, torch.float32))
                if kind == "noncontig" or d in (4, 5)
            ]
            continue
        for dt in dtypes(spec.key):
            if kind == "f64" and (dt != torch.float64 or dt not in backward_dtypes(spec.key)):
                continue
            if kind == "inplace" and dt not in INPLACE_DTYPES:
                continue
            for i, (n, _, has_diff, contig) in enumerate(meta(spec.key, dt)):
                if n > BIG_NUMEL and (dt not in BIG_DTYPES[kind] or not contig):
                    continue
                if kind == "f64" and not has_diff:
                    continue  # nothing to differentiate
                out.append((spec.key, dt, i))
    return out


def case_id(kind: str, key: str, dtype: torch.dtype | None, i: int) -> str:
    return f"{kind}:{key}-{SHORT[dtype] if dtype is not None else 'err'}-{i}"


# ------------------------------------------------------------------------- sample plumbing

# A sample's tensors are addressed by paths: ("input",), ("args", i), ("kwargs", name).


def _paths(sample) -> list[tuple]:
    out = [("input",)]
    out += [("args", i) for i in range(len(sample.args))]
    out += [("kwargs", k) for k in sample.kwargs]
    return out


def _get(sample, path):
    if path[0] == "input":
        return sample.input
    if path[0] == "args":
        return sample.args[path[1]]
    return sample.kwargs[path[1]]


def tensor_paths(sample) -> list[tuple]:
    return [p for p in _paths(sample) if isinstance(_get(sample, p), torch.Tensor)]


def diff_paths(sample) -> list[tuple]:
    """The tensors OpInfo marks as differentiable (generated with requires_grad)."""
    return [p for p in tensor_paths(sample) if _get(sample, p).requires_grad]


def replicate(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fresh copy with t's exact strides and offset (gaps, overlaps, stride 0 included)."""
    t = t.detach()
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    flat.set_(t.untyped_storage(), 0, (n,), (1,))
    dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    flat = flat.to(dt, copy=True)
    return flat.as_strided(t.size(), t.stride(), t.storage_offset())


def materialize(sample, dtype=None, grad=()):
    """(input, args, kwargs) of fresh copies; the tensors at ``grad`` paths require grad."""
    vals = {}
    for p in _paths(sample):
        v = _get(sample, p)
        if isinstance(v, torch.Tensor):
            v = replicate(v, dtype)
            if p in grad:
                v.requires_grad_(True)
        vals[p] = v
    inp = vals[("input",)]
    args = [vals[("args", i)] for i in range(len(sample.args))]
    kwargs = {k: vals[("kwargs", k)] for k in sample.kwargs}
    return inp, args, kwargs, vals


def describe(sample) -> str:
    def one(v):
        if isinstance(v, torch.Tensor):
            s = f"T{list(v.shape)}"
            if v.numel() > 1 and not v.is_contiguous():
                s += f"/s{list(v.stride())}"
            return s
        return repr(v)

    parts = [one(sample.input)] + [one(a) for a in sample.args]
    parts += [f"{k}={one(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)


def numel_of(sample, paths) -> int:
    return sum(_get(sample, p).numel() for p in paths)


# ------------------------------------------------------------------------------ outcomes


class Finding(AssertionError):
    cls = "finding"


class Crash(Finding):
    cls = "internal crash"


class Mismatch(Finding):
    cls = "mismatch beyond the rule"


class Layout(Finding):
    cls = "layout differs from eager"


class SilentNone(Finding):
    cls = "silent None in double backward"


class ErrorMismatch(Finding):
    cls = "wrong error type/message"


class UnlistedRefusal(Finding):
    cls = "refusal not listed in REFUSED"


class StaleRefusal(Finding):
    cls = "REFUSED entry does not refuse"


def _is_slimgrad_error(e: BaseException) -> bool:
    return str(e).startswith("slimgrad.")


def _refusal(key: str, where: str):
    from tests.opinfo._tables import REFUSED

    for desc_re, err_re in REFUSED.get(key, ()):
        if re.search(desc_re, where):
            return err_re
    return None


def run_side(fn, *a, **k):
    try:
        return fn(*a, **k), None
    except Exception as e:  # noqa: BLE001 - compared with the other side
        return None, e


def call(spec: Spec, fn, sample_seed: int, inp, args, kwargs):
    if spec.random:
        torch.manual_seed(sample_seed)
    return fn(inp, *args, **kwargs)


def guarded(key: str, where: str, sg_thunk):
    """Run slimgrad's side; classify an exception (refusal listed, refusal unlisted, crash)."""
    expected = _refusal(key, where)
    try:
        out = sg_thunk()
    except Exception as e:  # noqa: BLE001
        if _is_slimgrad_error(e):
            if expected is not None and re.search(expected, str(e)):
                return None, True
            raise UnlistedRefusal(f"{where}: {type(e).__name__}: {e}") from e
        raise Crash(f"{where}: {type(e).__name__}: {e}") from e
    if expected is not None:
        raise StaleRefusal(f"{where}: REFUSED lists /{expected}/ but slimgrad returned")
    return out, False


def _strides_match(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() <= 1:
        return True
    return all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def compare(
    name: str,
    out,
    ref64,
    eager,
    dtype,
    where: str,
    layout: bool = True,
    exact: bool = False,
    ignore: torch.Tensor | None = None,
) -> None:
    """One tensor vs eager. ``exact``: bit for bit (random ops: ref64 would draw another mask);
    ``ignore``: positions not compared (gradients at NaN inputs, see _nan_inputs)."""
    if ignore is not None and out is not None and eager is not None and ignore.any():
        keep = ~ignore.expand(out.shape)
        out, eager = out[keep], eager[keep]
        if ref64 is not None:
            r = ref64

            def ref64():
                return (r() if callable(r) else r)[keep]

        layout = False
    if out is None or eager is None:
        if (out is None) != (eager is None):
            raise Mismatch(
                f"{where}: {name}: slimgrad {'None' if out is None else 'tensor'}, "
                f"eager {'None' if eager is None else 'tensor'}"
            )
        return
    if out.shape != eager.shape or out.dtype != eager.dtype:
        raise Mismatch(
            f"{where}: {name}: slimgrad {out.dtype}{list(out.shape)}, "
            f"eager {eager.dtype}{list(eager.shape)}"
        )
    if torch.equal(out, eager):
        pass  # bit for bit: within any rule
    elif exact:
        raise Mismatch(
            f"{where}: {name}: differs from eager's (expected bit for bit); "
            f"max abs diff {max_abs_err(out, eager):.3e}"
        )
    elif dtype == torch.float64 or not out.is_floating_point():
        try:
            torch.testing.assert_close(out, eager, equal_nan=True)
        except AssertionError as e:
            raise Mismatch(f"{where}: {name}: {e}") from None
    else:
        if callable(ref64):
            ref64 = ref64()
        ok, err, bound = rule_ok(out, ref64, eager, DEFAULT_ATOL[dtype])
        if not ok:
            raise Mismatch(
                f"{where}: {name}: max|out-ref64|={err:.3e} > 2*max|eager-ref64|+atol={bound:.3e}"
            )
    if layout and not _strides_match(out, eager):
        raise Layout(
            f"{where}: {name}: strides {out.stride()} vs eager {eager.stride()} "
            f"(shape {list(out.shape)})"
        )


def _out(sample, y):
    return sample.output_process_fn_grad(y)


# ---------------------------------------------------------------------------------- checks


def _nan_inputs(spec: Spec, sample, dtype) -> torch.Tensor | None:
    """Where an elementwise op's input is NaN. Eager's own gradient there depends on the code
    path (F.elu on nine contiguous NaNs: nan, nan, 1 from the vectorized body and the scalar
    tail), so no implementation can match it; those positions are not compared."""
    if not spec.elementwise:
        return None
    x = sample.input.detach().to(dtype)
    return torch.isnan(x) if x.is_floating_point() else None


@functools.lru_cache(maxsize=4)
def _cot64(shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.float64)


def _cot(y: torch.Tensor, seed: int) -> torch.Tensor:
    return _cot64(tuple(y.shape), seed).to(y.dtype, copy=True)


def check_sample(key: str, dtype: torch.dtype, i: int, var: str | None = None) -> str:
    """forward + grad. Returns 'refused' or 'ok'; raises a Finding."""
    spec, op = SPEC[key], opinfo(key)
    sample = variant(samples(key, dtype)[i], var)
    where = f"{key} {SHORT[dtype]} #{i}{' ' + var if var else ''} ({describe(sample)})"
    seed = _seed(key, dtype, i)

    # forward
    e_in, e_args, e_kw, e_vals = materialize(sample, dtype)
    eager, e_exc = run_side(call, spec, op.op, seed, e_in, e_args, e_kw)
    s_in, s_args, s_kw, s_vals = materialize(sample, dtype)
    if e_exc is not None:
        _same_error(where, e_exc, lambda: call(spec, spec.fn, seed, s_in, s_args, s_kw), key)
        return "ok"
    out, refused = guarded(
        key, "forward " + where, lambda: call(spec, spec.fn, seed, s_in, s_args, s_kw)
    )
    if refused:
        return "refused"

    @functools.cache
    def ref():
        r_in, r_args, r_kw, ref_vals = materialize(sample, torch.float64)
        return _out(sample, call(spec, op.op, seed, r_in, r_args, r_kw)), ref_vals

    compare(
        "output",
        _out(sample, out),
        lambda: ref()[0],
        _out(sample, eager),
        dtype,
        "forward " + where,
        exact=spec.random,
    )
    for p in tensor_paths(sample):
        if p == ("input",) and e_vals[p] is eager:
            continue
        compare(
            f"arg {p} after the call",
            s_vals[p],
            lambda p=p: ref()[1][p],
            e_vals[p],
            dtype,
            "forward " + where,
            layout=False,
            exact=spec.random,
        )

    # gradients
    if dtype not in backward_dtypes(key):
        return "ok"
    paths = diff_paths(sample)
    if not paths:
        return "ok"
    nan = _nan_inputs(spec, sample, dtype)
    subsets = [tuple(paths)]
    if len(paths) > 1 and numel_of(sample, paths) <= BIG_NUMEL:
        subsets += [(p,) for p in paths]
    from tests.opinfo._tables import EAGER_SEGFAULTS_WITHOUT_INPUT_GRAD as segv

    if (key, var) in segv:
        subsets = [sub for sub in subsets if ("input",) in sub]
    for sub in subsets:
        w = f"grad wrt {[p[-1] for p in sub]} {where}"

        def grads(fn_, dt, sub=sub):
            inp, args, kw, vals = materialize(sample, dt, grad=sub)
            leaves = [vals[p] for p in sub]
            y = _out(sample, call(spec, fn_, seed, inp, args, kw))
            if not y.requires_grad:
                return [None] * len(leaves)
            return list(torch.autograd.grad(y, leaves, _cot(y, seed), allow_unused=True))

        eager_g = grads(op.op, dtype)
        sg_g, refused = guarded(key, w, lambda: grads(spec.fn, dtype))
        if refused:
            return "refused"
        ref_g = functools.cache(functools.partial(grads, op.op, torch.float64))
        for j, (p, a, c) in enumerate(zip(sub, sg_g, eager_g)):
            compare(
                f"grad {p[-1]}",
                a,
                lambda j=j, r=ref_g: r()[j],
                c,
                dtype,
                w,
                layout=False,
                exact=spec.random,
                ignore=nan if p == ("input",) else None,
            )
    return "ok"


def _same_error(where, e_exc, thunk, key):
    try:
        thunk()
    except Exception as e:  # noqa: BLE001
        _match_error(where, key, type(e_exc), None, e, eager_msg=str(e_exc))
        return
    raise ErrorMismatch(f"{where}: eager raises {type(e_exc).__name__}: {e_exc}; slimgrad returns")


def _match_error(where, key, etype, eregex, e, eager_msg=None):
    ok_type = isinstance(e, etype)
    if eregex is not None:
        ok_msg = bool(re.search(eregex, str(e)))
    else:
        ok_msg = str(e) == eager_msg
    named = _is_slimgrad_error(e)
    if ok_type and (ok_msg or named):
        return
    want = f"{etype.__name__} /{eregex if eregex is not None else eager_msg}/"
    raise ErrorMismatch(
        f"{where}: expected {want} (or a slimgrad message naming the op); "
        f"got {type(e).__name__}: {str(e)[:300]}"
    )


def check_error(key: str, i: int) -> str:
    spec, op = SPEC[key], opinfo(key)
    ei = error_inputs(key)[i]
    s = ei.sample_input
    where = f"error {key} #{i} ({describe(s)})"
    inp, args, kw, _ = materialize(s)
    try:
        op.op(inp, *args, **kw)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, ei.error_type), f"{where}: eager raised {e!r}"
    else:
        raise AssertionError(f"{where}: eager did not raise (OpInfo expects {ei.error_type})")
    inp, args, kw, _ = materialize(s)
    try:
        spec.fn(inp, *args, **kw)
    except Exception as e:  # noqa: BLE001
        _match_error(where, key, ei.error_type, ei.error_regex, e)
        return "ok"
    raise ErrorMismatch(
        f"{where}: eager raises {ei.error_type.__name__} /{ei.error_regex}/; slimgrad returns"
    )


def check_f64(key: str, i: int) -> str:
    """gradcheck, second derivatives vs eager (None included), gradgradcheck (float64)."""
    spec, op = SPEC[key], opinfo(key)
    dtype = torch.float64
    sample = samples(key, dtype)[i]
    where = f"{key} f64 #{i} ({describe(sample)})"
    seed = _seed(key, dtype, i)
    paths = diff_paths(sample)
    n = numel_of(sample, paths)
    status = "ok"

    def fn_of(fn, vals_template):
        def f(*leaves):
            vals = dict(vals_template)
            vals.update(zip(paths, leaves))
            inp = vals[("input",)]
            args = [vals[("args", j)] for j in range(len(sample.args))]
            kw = {k: vals[("kwargs", k)] for k in sample.kwargs}
            if spec.random:
                torch.manual_seed(seed)
            return _out(sample, fn(inp, *args, **kw))

        return f

    # forward check for validity: skip samples eager itself rejects
    e_in, e_args, e_kw, _ = materialize(sample, dtype)
    _, e_exc = run_side(call, spec, op.op, seed, e_in, e_args, e_kw)
    if e_exc is not None:
        raise AssertionError(f"{where}: eager rejects this OpInfo sample: {e_exc!r}")

    plain = i < n_plain_samples(key, dtype)
    if plain and 0 < n <= GRADCHECK_NUMEL:
        _, _, _, vals = materialize(sample, dtype)
        leaves = [vals[p].requires_grad_(True) for p in paths]
        w = "gradcheck " + where

        def gc():
            # buffers (running stats) are refreshed per call so gradcheck's repeated calls agree
            def g(*lv):
                v2 = dict(materialize(sample, dtype)[3])
                v2.update(zip(paths, lv))
                return fn_of(spec.fn, v2)(*lv)

            return torch.autograd.gradcheck(
                g,
                leaves,
                fast_mode=n > GRADCHECK_SLOW_NUMEL or spec.random,
                check_undefined_grad=True,
                check_batched_grad=False,
                raise_exception=True,
            )

        try:
            _, refused = guarded(key, w, gc)
        except GradcheckError as e:
            raise Mismatch(f"{w}: {str(e)[:600]}") from None
        if refused:
            status = "refused"

    # second derivatives vs eager
    w = "double " + where
    res = []
    for fn in (op.op, spec.fn):
        _, _, _, vals = materialize(sample, dtype, grad=paths)
        leaves = [vals[p] for p in paths]

        def dd(fn=fn, vals=vals, leaves=leaves):
            y = fn_of(fn, vals)(*leaves)
            cot = _cot(y, seed).requires_grad_(True)
            g1 = torch.autograd.grad(y, leaves, cot, create_graph=True, allow_unused=True)
            gen = torch.Generator().manual_seed(seed + 1)
            vs = [
                torch.randn(g.shape, generator=gen, dtype=g.dtype) if g is not None else None
                for g in g1
            ]
            terms = [(g * v).sum() for g, v in zip(g1, vs) if g is not None and g.requires_grad]
            if not terms:
                return list(g1), [None] * (len(leaves) + 1)
            g2 = torch.autograd.grad(sum(terms), [*leaves, cot], allow_unused=True)
            return list(g1), list(g2)

        if fn is spec.fn:
            r, refused = guarded(key, w, dd)
            if refused:
                return "refused"
        else:
            r = dd()
        res.append(r)
    (e1, e2), (s1, s2) = res
    names = [p[-1] for p in paths] + ["cotangent"]
    nan = _nan_inputs(spec, sample, dtype)
    for nm, a, b in zip(names, s1, e1):
        compare(
            f"first grad {nm}",
            a,
            None,
            b,
            dtype,
            w,
            layout=False,
            ignore=nan if nm == "input" else None,
        )
    for nm, a, b in zip(names, s2, e2):
        if a is None and b is not None and bool((b != 0).any()):
            raise SilentNone(f"{w}: d/d{nm} of <grads, v> is None; eager's is nonzero")
        if b is None and a is not None:
            b = torch.zeros_like(a)
        if a is None and b is not None:
            a = torch.zeros_like(b)
        compare(
            f"second grad {nm}",
            a,
            None,
            b,
            dtype,
            w,
            layout=False,
            ignore=nan if nm in ("input", "cotangent") else None,
        )

    if plain and 0 < n <= GRADGRAD_NUMEL:
        _, _, _, vals = materialize(sample, dtype)
        leaves = [vals[p].requires_grad_(True) for p in paths]
        w = "gradgradcheck " + where

        def ggc():
            def g(*lv):
                v2 = dict(materialize(sample, dtype)[3])
                v2.update(zip(paths, lv))
                return fn_of(spec.fn, v2)(*lv)

            return torch.autograd.gradgradcheck(
                g,
                leaves,
                fast_mode=True,
                check_undefined_grad=True,
                check_batched_grad=False,
                raise_exception=True,
            )

        try:
            _, refused = guarded(key, w, ggc)
        except GradcheckError as e:
            raise Mismatch(f"{w}: {str(e)[:600]}") from None
        if refused:
            status = "refused"
    return status


def check_inplace(key: str, dtype: torch.dtype, i: int) -> str:
    spec, op = SPEC[key], opinfo(key)
    sample = samples(key, dtype)[i]
    where = f"inplace {key} {SHORT[dtype]} #{i} ({describe(sample)})"
    seed = _seed(key, dtype, i)

    def fwd(fn, dt):
        inp, args, kw, _ = materialize(sample, dt)
        y = call(spec, fn, seed, inp, args, kw)
        return inp, y

    (e_inp, eager), e_exc = (None, None), None
    try:
        e_inp, eager = fwd(op.inplace_variant, dtype)
    except Exception as e:  # noqa: BLE001
        e_exc = e
    if e_exc is not None:
        _same_error(where, e_exc, lambda: fwd(spec.inplace, dtype), key)
        return "ok"
    r, refused = guarded(key, where, lambda: fwd(spec.inplace, dtype))
    if refused:
        return "refused"
    s_inp, out = r
    if out is not s_inp and out.data_ptr() != s_inp.data_ptr():
        raise Mismatch(f"{where}: the in-place variant did not return its input")
    ref64 = fwd(op.op, torch.float64)[1] if dtype != torch.float64 else None
    compare("output", out, ref64, eager, dtype, where, exact=spec.random)

    if dtype not in backward_dtypes(key) or not diff_paths(sample):
        return "ok"
    res = []
    for fn, dt in ((op.inplace_variant, dtype), (spec.inplace, dtype), (op.op, torch.float64)):
        if dt == dtype == torch.float64 and fn is op.op:
            res.append(res[0])
            break
        inp, args, kw, _ = materialize(sample, dt)
        leaf = replicate(sample.input, dt).requires_grad_(True)
        if torch._debug_has_internal_overlap(inp) != 0:
            # self-overlapping memory (stride 0, or strides like (1, 1, 7)): eager refuses some,
            # and where it does not, the values written depend on the order of the writes, so
            # gradients through them are undefined (the forward was compared above)
            return "ok"
        x = inp.copy_(leaf)  # a non-leaf with the sample's strides
        if fn is op.op:
            y = call(spec, fn, seed, leaf, args, kw)
        else:
            y = call(spec, fn, seed, x, args, kw)
        res.append(torch.autograd.grad(y, leaf, _cot(y, seed))[0] if y.requires_grad else None)
    compare(
        "grad input",
        res[1],
        res[2],
        res[0],
        dtype,
        "grad " + where,
        layout=False,
        exact=spec.random,
        ignore=_nan_inputs(spec, sample, dtype),
    )
    return "ok"


# ------------------------------------------------------------------------ pytest plumbing

CHECKS = {"sample": check_sample, "inplace": check_inplace}


def params(kind: str, groups: tuple[str, ...]):
    """pytest.param per case, id naming the op, dtype and sample index; KNOWN ones xfail."""
    import pytest

    from tests.opinfo._tables import KNOWN

    out = []
    for key, dt, i in cases(kind, groups):
        cid = case_id(kind, key, dt, i)
        marks = []
        if cid in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, raises=Finding, reason=KNOWN[cid]))
        out.append(pytest.param(key, dt, i, id=cid.split(":", 1)[1], marks=marks))
    return out


def run(kind: str, key: str, dtype, i: int) -> str:
    if kind == "error":
        return check_error(key, i)
    if kind == "f64":
        return check_f64(key, i)
    if kind in VARIANTS:
        return check_sample(key, dtype, i, kind)
    return CHECKS[kind](key, dtype, i)


_TEST_DOCS = {
    "sample": "Forward (values, dtype, strides, mutated arguments) and every gradient vs eager.",
    "f64": "float64: gradcheck, second derivatives vs eager (no silent None), gradgradcheck.",
    "inplace": "The OpInfo in-place variant against slimgrad's: values, identity, gradients.",
    "error": "OpInfo error_inputs: eager's error type, and eager's message or a slimgrad one.",
    "noncontig": "The sample with every tensor non-contiguous (OpInfo's noncontiguous()), float32.",
    "channels_last": "The sample with a 4-D/5-D input in channels_last, float32.",
}


def case_test(kind: str, groups: tuple[str, ...]):
    """The test of a test_<group>.py module that runs every ``kind`` check of ``groups``, one
    case per parameter (``params``); bind it to a ``test_*`` name there."""
    import pytest

    @pytest.mark.parametrize("key,dtype,i", params(kind, groups))
    def test(key, dtype, i):
        run(kind, key, dtype, i)

    test.__doc__ = _TEST_DOCS[kind]
    return test
