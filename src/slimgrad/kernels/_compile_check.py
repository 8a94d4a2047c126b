"""Compile every Triton kernel for a CUDA target without a GPU: ``python -m
slimgrad.kernels._compile_check [--arch 90]``.

The interpreter (``TRITON_INTERPRET=1``) runs kernels as numpy and accepts code that the real
compiler rejects (types of loop-carried values, constexpr use, pointer arithmetic). This module
lowers each kernel, for each combination of constexpr flags the wrappers use, through triton's
full pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the ptxas shipped in the triton
wheel) for a given compute capability, so compile errors show up on a CPU-only machine. It does not
run anything. Imported only by its test and by hand.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _variants() -> Iterator[tuple[str, object, dict, dict]]:
    from slimgrad.kernels import _output_act as A
    from slimgrad.kernels import dropout as D
    from slimgrad.kernels import layer_norm as L
    from slimgrad.kernels import linear_cross_entropy as C

    for act, dt in itertools.product(range(6), ("fp32", "bf16")):
        sig = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "n": "i32", "a": "fp32", "b": "fp32"}
        yield f"mono_fwd[{act},{dt}]", A._mono_fwd_kernel, sig, {"ACT": act, "BLOCK": A.BLOCK}
        sig = {"g_ptr": f"*{dt}", "y_ptr": f"*{dt}", "dx_ptr": f"*{dt}", "n": "i32",
               "a": "fp32", "b": "fp32"}  # fmt: skip
        yield f"mono_bwd[{act},{dt}]", A._mono_bwd_kernel, sig, {"ACT": act, "BLOCK": A.BLOCK}
    for act, dt in itertools.product(range(4), ("fp32", "bf16")):
        sig = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "bits_ptr": "*u8", "cnt_ptr": "*i32",
               "n": "i32", "x_star": "fp32", "window": "fp32", "tail": "fp32"}  # fmt: skip
        const = {"ACT": act, "TAIL": act in (1, 2), "BLOCK": A.BLOCK}
        yield f"smooth_fwd[{act},{dt}]", A._smooth_fwd_kernel, sig, const
    for dt, tail in (("fp32", True), ("bf16", False)):
        yield f"smooth_side[{dt},tail={tail}]", A._smooth_side_kernel, {
            "x_ptr": f"*{dt}", "hoff_ptr": "*i64", "idx_ptr": "*i32", "xs_ptr": f"*{dt}",
            "n": "i32", "x_star": "fp32", "window": "fp32", "tail": "fp32",
        }, {"TAIL": tail, "BLOCK": A.BLOCK}  # fmt: skip
    for dt in ("fp32", "bf16"):
        yield f"smooth_bwd[{dt}]", A._smooth_bwd_kernel, {
            "g_ptr": f"*{dt}", "y_ptr": f"*{dt}", "bits_ptr": "*u8", "tab_ptr": "*fp32",
            "dx_ptr": f"*{dt}", "n": "i32", "y_hi": "fp32", "y_lo": "fp32", "s2_max": "fp32",
            "sc_r": "fp32", "sc_l": "fp32",
        }, {"NT": 1 << 14, "BLOCK": A.BLOCK}  # fmt: skip
    for dt in ("fp32", "bf16", "fp16"):
        yield f"dropout_fwd[{dt}]", D._fwd_kernel, {
            "x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "bits_ptr": "*u8", "seed_ptr": "*i64",
            "n": "i32", "keep_prob": "fp32", "scale": "fp32",
        }, {"BLOCK": D.BLOCK}  # fmt: skip
        yield f"dropout_bwd[{dt}]", D._bwd_kernel, {
            "g_ptr": f"*{dt}", "bits_ptr": "*u8", "dx_ptr": f"*{dt}", "n": "i32", "scale": "fp32"
        }, {"BLOCK": D.BLOCK}  # fmt: skip
    for rms, one, affine, dt in itertools.product(
        (False, True), (True, False), (True, False), ("fp32", "bf16")
    ):
        sig = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}",
               "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "d": "i32", "eps": "fp32"}  # fmt: skip
        const = {"HAS_W": affine, "HAS_B": affine and not rms, "RMS": rms, "ONE_TILE": one,
                 "BLOCK_D": 1024}  # fmt: skip
        if not affine:
            sig["w_ptr"] = sig["b_ptr"] = "constexpr"
            const.update(w_ptr=None, b_ptr=None)
        yield f"norm_fwd[rms={rms},one={one},affine={affine},{dt}]", L._fwd_kernel, sig, const
    for rms, side, affine, need in itertools.product(
        (False, True), (False, True), (True, False), ((True, True, True), (False, True, False))
    ):
        sig = {"dy_ptr": "*bf16", "y_ptr": "*bf16", "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
               "w_ptr": "*bf16", "b_ptr": "*bf16", "side_ptr": "*bf16", "col2k_ptr": "*i32",
               "dx_ptr": "*bf16", "dw_ptr": "*fp32", "db_ptr": "*fp32", "n": "i32", "d": "i32",
               "k": "i32", "n_prog": "i32"}  # fmt: skip
        const = {"HAS_W": affine, "HAS_B": affine and not rms, "HAS_SIDE": side and affine,
                 "RMS": rms, "NEED_DX": need[0], "NEED_DW": need[1] and affine,
                 "NEED_DB": need[2] and affine and not rms, "BLOCK_D": 2048}  # fmt: skip
        for flag, ptrs in (("HAS_W", ["w_ptr"]), ("HAS_B", ["b_ptr"]),
                           ("HAS_SIDE", ["side_ptr", "col2k_ptr"]), ("NEED_DX", ["dx_ptr"]),
                           ("NEED_DW", ["dw_ptr"]), ("NEED_DB", ["db_ptr"])):  # fmt: skip
            if not const[flag]:
                for p in ptrs:
                    sig[p] = "constexpr"
                    const[p] = None
        yield (
            f"norm_bwd[rms={rms},side={side},affine={affine},need={need}]",
            L._bwd_kernel,
            sig,
            const,
        )
    for eps, dt, grad in itertools.product((False, True), ("fp32", "bf16"), (False, True)):
        sig = {"z_ptr": f"*{dt}", "t_ptr": "*i64", "loss_ptr": "*fp32", "lse_ptr": "*fp32",
               "scale_ptr": "*fp32", "v": "i32", "stride": "i32", "ignore_index": "i32",
               "eps": "fp32"}  # fmt: skip
        const = {"HAS_EPS": eps, "GRAD": grad, "SCALE": grad and dt == "bf16", "BLOCK_V": 4096}
        if not const["SCALE"]:
            sig["scale_ptr"] = "constexpr"
            const["scale_ptr"] = None
        yield f"ce_fwd[eps={eps},{dt},grad={grad}]", C._ce_fwd_kernel, sig, const
    yield "ce_grad", C._ce_grad_kernel, {
        "z_ptr": "*fp32", "t_ptr": "*i64", "lse_ptr": "*fp32", "scale_ptr": "*fp32", "v": "i32",
        "stride": "i32", "ignore_index": "i32", "eps": "fp32",
    }, {"BLOCK_V": 4096}  # fmt: skip


def compile_all(
    arch: int = 90, only: str = "", one_per_kernel: bool = False
) -> list[tuple[str, str | None]]:
    """[(variant, error or None)] for every kernel variant (cubin for sm_<arch>);
    ``one_per_kernel``: only the first variant of each kernel (a quick check)."""
    target = GPUTarget("cuda", arch, 32)
    out = []
    seen = set()
    for name, fn, sig, const in _variants():
        if only and not name.startswith(only):
            continue
        if one_per_kernel:
            if fn in seen:
                continue
            seen.add(fn)
        sig = {**sig, **{k: "constexpr" for k in const}}
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target)
            err = None if k.asm.get("cubin") else "no cubin"
        except Exception as e:  # noqa: BLE001 - reported per variant
            err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out.append((name, err))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="compile slimgrad's Triton kernels without a GPU")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--only", default="")
    p.add_argument("--quick", action="store_true", help="one variant per kernel")
    a = p.parse_args(argv)
    bad = 0
    for name, err in compile_all(a.arch, a.only, a.quick):
        print(f"{'ok  ' if err is None else 'FAIL'} {name}" + (f": {err}" if err else ""))
        bad += err is not None
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
