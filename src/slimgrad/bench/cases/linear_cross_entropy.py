"""GPT-2 ln_f + tied LM head + cross-entropy, V=50257, 4x256 tokens: fused and chunked vs eager.

V = 50257, d = 768, 4 x 256 tokens (``--small``: V = 5003, d = 64, 2 x 64). Eager:
``F.cross_entropy(lm_head(ln_f(x)))``. slimgrad: ``linear_cross_entropy(ln_f(x), lm_head.weight)``
with the same Parameters. Reported: saved/peak bytes (``slimgrad.memory.measure``), the backward
peak with gradient-buffer reuse on and off, interleaved step times, gradient errors against float64.

Run: ``PYTHONPATH=src python -m slimgrad.bench.cases.linear_cross_entropy [--small] [--steps N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from slimgrad import ownership
from slimgrad.ops.linear_cross_entropy import linear_cross_entropy

NAME = "linear_cross_entropy"
FULL = dict(vocab=50257, hidden=768, shape=(4, 256))
SMALL = dict(vocab=5003, hidden=64, shape=(2, 64))


class _EagerHead(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, target):
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class _SlimHead(nn.Module):
    def __init__(self, eager: _EagerHead) -> None:
        super().__init__()
        self.ln_f = eager.ln_f  # shared Parameters
        self.lm_head = eager.lm_head

    def forward(self, x, target):
        return linear_cross_entropy(self.ln_f(x), self.lm_head.weight, target)


def build(device="cpu", dtype=torch.float32, small: bool = False):
    """Returns (eager_model, slim_model, make_inputs); ``make_inputs() -> (x, target)``."""
    cfg = SMALL if small else FULL
    device = torch.device(device)
    torch.manual_seed(0)
    eager = _EagerHead(cfg["vocab"], cfg["hidden"]).to(device=device, dtype=dtype)
    with torch.no_grad():
        eager.lm_head.weight.normal_(0.0, 0.02)  # GPT-2's init
    slim = _SlimHead(eager)

    def make_inputs():
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(*cfg["shape"], cfg["hidden"], generator=g).to(device=device, dtype=dtype)
        target = torch.randint(0, cfg["vocab"], cfg["shape"], generator=g)
        target[:, -1] = -100  # HF's shifted labels: the last position predicts nothing
        return x, target.to(device)

    return eager, slim, make_inputs


def _measure(model, x, target):
    from slimgrad.memory import measure

    model.zero_grad(set_to_none=True)
    m = measure(lambda: model(x, target), module=model, timeline=False)
    model.zero_grad(set_to_none=True)
    return m


def _step_peak(model, x, target) -> int:
    # Live-bytes peak of one step with the tracker's dispatch mode only. measure() also installs a
    # saved_tensors_hooks pair, under which saved *inputs* come back as fresh aliases, so ownership
    # (rightly) cannot prove them dead; this shows the peak as it is in ordinary training.
    from slimgrad.memory import _Tracker

    model.zero_grad(set_to_none=True)
    tr = _Tracker()
    try:
        with tr:
            model(x, target).backward()
    finally:
        tr.close()
    model.zero_grad(set_to_none=True)
    return tr.peak


def _grads(model, x, target):
    model.zero_grad(set_to_none=True)
    loss = model(x, target)
    loss.backward()
    out = [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def grad_errors(eager, slim, x, target) -> dict:
    """max|g - g_ref64| over the loss and every Parameter's gradient, eager and slim."""
    ref = copy.deepcopy(eager).to(torch.float64)
    r = _grads(ref, x.double(), target)
    res = {}
    for name, model in (("eager", eager), ("slim", slim)):
        got = _grads(model, x, target)
        res[name] = max(float((a.double() - b).abs().max()) for a, b in zip(got, r, strict=True))
    with ownership.reuse_disabled():
        off = _grads(slim, x, target)
    on = _grads(slim, x, target)
    res["reuse_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    return res


def time_steps(eager, slim, x, target, steps: int = 3) -> dict:
    """Interleaved A/B step times (forward + backward) in ms; the first round is a warm-up."""
    times: dict[str, list[float]] = {"eager": [], "slim": []}
    for i in range(steps + 1):
        order = [("eager", eager), ("slim", slim)]
        for name, model in order if i % 2 == 0 else order[::-1]:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            model(x, target).backward()
            dt = (time.perf_counter() - t0) * 1e3
            if i > 0:
                times[name].append(dt)
    return times


def gpt2_reuse(small: bool = False, device="cpu") -> dict:
    """HF GPT-2 (random init, dropout 0.1): eager ``model(ids, labels=ids).loss`` against the same
    model's transformer + :func:`causal_lm_loss`; saved/peak bytes, and the step peak with
    gradient-buffer reuse on and off (the fused loss's dh written into the dead hidden states)."""
    import transformers

    from slimgrad.ops.linear_cross_entropy import causal_lm_loss

    if small:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=5003)
        shape = (2, 64)
    else:
        cfg = transformers.GPT2Config()  # GPT-2 small: 12 x 768, V = 50257
        shape = (4, 256)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    class Eager(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, target):
            torch.manual_seed(2)  # same dropout masks on both sides
            return self.m(ids, labels=target).loss

    class Slim(Eager):
        def forward(self, ids, target):
            torch.manual_seed(2)
            hs = self.m.transformer(ids).last_hidden_state
            return causal_lm_loss(hs, self.m.lm_head.weight, target)

    eager, slim = Eager(), Slim()
    me, ms = _measure(eager, ids, ids), _measure(slim, ids, ids)
    ownership.reset_reuse_count()
    peak_on = _step_peak(slim, ids, ids)
    reuses = ownership.reuse_count()
    with ownership.reuse_disabled():
        peak_off = _step_peak(slim, ids, ids)
    on, off, ref = _grads(slim, ids, ids), None, _grads(eager, ids, ids)
    with ownership.reuse_disabled():
        off = _grads(slim, ids, ids)
    return {
        "case": "gpt2_causal_lm_loss",
        "shape": list(shape),
        "layers": cfg.n_layer,
        "eager": {k: getattr(me, k) for k in ("saved_bytes", "peak_bytes")},
        "slim_loss_only": {k: getattr(ms, k) for k in ("saved_bytes", "peak_bytes")},
        "step_peak_bytes": {"slim_reuse_on": peak_on, "slim_reuse_off": peak_off},
        "reuses_per_step": reuses,
        "reuse_bitwise_equal": all(torch.equal(a, b) for a, b in zip(on, off, strict=True)),
        "grad_max_abs_diff_vs_eager": max(
            float((a - b).abs().max()) for a, b in zip(on, ref, strict=True)
        ),
    }


def time_reuse(slim, x, target, steps: int = 3) -> dict:
    """Interleaved slimgrad step times (ms), reuse on and off; the first round is a warm-up."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(steps + 1):
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            slim.zero_grad(set_to_none=True)
            with ownership.reuse_disabled() if mode == "off" else contextlib.nullcontext():
                t0 = time.perf_counter()
                slim(x, target).backward()
                dt = (time.perf_counter() - t0) * 1e3
            if i > 0:
                times[mode].append(dt)
    slim.zero_grad(set_to_none=True)
    ratios = [a / b for a, b in zip(times["on"], times["off"], strict=True)]
    return {
        "step_ms": {k: statistics.median(v) for k, v in times.items()},
        "ratio_on_over_off_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-grad-check", action="store_true")
    ap.add_argument("--gpt2", action="store_true", help="also run HF GPT-2 with reuse on/off")
    args = ap.parse_args(argv)
    eager, slim, make_inputs = build(args.device, torch.float32, small=args.small)
    x, target = make_inputs()
    me, ms = _measure(eager, x, target), _measure(slim, x, target)
    ownership.reset_reuse_count()
    peak_on = _step_peak(slim, x, target)
    reuses = ownership.reuse_count()
    with ownership.reuse_disabled():
        peak_off = _step_peak(slim, x, target)
    peak_eager = _step_peak(eager, x, target)
    rec = {
        "case": NAME,
        "shape": list(x.shape),
        "vocab": eager.lm_head.weight.shape[0],
        "device": str(x.device),
        "dtype": str(x.dtype),
        "torch": torch.__version__,
        "eager": {k: getattr(me, k) for k in ("saved_bytes", "peak_bytes", "forward_peak_bytes")},
        "slim": {k: getattr(ms, k) for k in ("saved_bytes", "peak_bytes", "forward_peak_bytes")},
        "saved_ratio": ms.saved_bytes / me.saved_bytes,
        "peak_ratio": ms.peak_bytes / me.peak_bytes,
        "step_peak_bytes": {
            "eager": peak_eager,
            "slim_reuse_on": peak_on,
            "slim_reuse_off": peak_off,
        },
        "reuses_per_step": reuses,
    }
    if not args.no_grad_check:
        rec["grad_max_err"] = grad_errors(eager, slim, x, target)
    if args.steps > 0:
        t = time_steps(eager, slim, x, target, args.steps)
        ratios = [s / e for s, e in zip(t["slim"], t["eager"], strict=True)]
        rec["step_ms"] = {k: statistics.median(v) for k, v in t.items()}
        rec["step_ratio_median"] = statistics.median(ratios)
        rec["step_ratio_range"] = [min(ratios), max(ratios)]
        rec["reuse_timing"] = time_reuse(slim, x, target, args.steps)
    if args.gpt2:
        rec["gpt2"] = gpt2_reuse(small=args.small, device=args.device)
    print(json.dumps(rec, indent=1))
    return rec


if __name__ == "__main__":
    main()
