"""Host overhead (issue 32's CPU proxy): tiny models where compute is negligible, so a step's time
is the host's Python and dispatch, what a GPU would wait for.

# NOTE [Host overhead proxy]
On a GPU, small and mid-size models are launch-bound: the step lasts as long as the host takes to
issue it. A CPU step on tiny tensors measures that host time without a GPU. Each model is measured
eager and converted (``slimgrad.convert_`` of a deep copy, same weights) with:

- ``time_ratio``: converted / eager step time (forward + backward + ``grad = None``), the median of
  interleaved pairs of single steps, each timed by ``time.thread_time`` (CPU time of this thread:
  another process on the machine does not count) under ``torch.set_num_threads(1)``;
- ``python_calls``: Python and C function calls per step counted by ``cProfile`` (deterministic:
  the same code path gives the same count on any machine);
- ``aten_ops``: ATen operators dispatched per step (``slimgrad.testing.OpObserver`` counting every
  call, inside slimgrad's custom ops too; it keeps no tensor, so the counted step is the real one;
  on a GPU each is a launch or a host-side op).

The models (``MODELS``): HF GPT-2 and HF Llama (grouped-query attention), 12 layers x 64 wide, 1x16
tokens, each family's default config otherwise (GPT-2's dropout 0.1; Llama without dropout), the
loss from ``labels``; slimgrad's torchvision-faithful ResNet-50 at 2x3x32x32 with cross-entropy.
``aten_ops_at_scale`` counts the same for HF GPT-2 small at its default config, 4x256 tokens (one
step each side; issue 32's third target).

Run it with ``slimgrad bench host_overhead`` (records: ``benchmarks/results/host_overhead.jsonl``).
``small=True`` (the tests) runs 2-layer models and 3 pairs.
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from slimgrad.bench import harness, models
from slimgrad.testing import OpObserver

MODELS = ("hf_gpt2", "hf_llama", "resnet50")
TARGETS = {"time_ratio": 1.10, "python_calls_ratio": 1.5, "aten_ops_at_scale_ratio": 1.3}


class _CountOps(OpObserver):
    # keeps no tensor (the counted step is the real one) and counts the ops inside slimgrad's
    # custom ops (each is a launch on a GPU)
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def see(self, func, args, kwargs) -> None:
        self.n += 1


def _hf(name: str, layers: int, width: int, seq: int, batch: int = 1, full: bool = False):
    import transformers

    if name == "hf_gpt2":
        cfg = transformers.GPT2Config() if full else transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, vocab_size=1000, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
            max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def _resnet(small: bool):
    net = models.resnet_small(num_classes=10) if small else models.resnet50(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    y = torch.randint(0, 10, (2,))
    return net, lambda m: torch.nn.functional.cross_entropy(m(x), y)


def build_model(name: str, small: bool = False) -> tuple[torch.nn.Module, Callable]:
    """``(model, loss_fn)`` of one of ``MODELS``; ``loss_fn(model)`` is one forward's loss."""
    if name == "resnet50":
        return _resnet(small)
    return _hf(name, layers=2 if small else 12, width=64, seq=16)


def _step(model: torch.nn.Module, loss_fn: Callable) -> None:
    loss_fn(model).backward()
    for p in model.parameters():
        p.grad = None


def _calls(model, loss_fn) -> int:
    prof = cProfile.Profile()
    prof.enable()
    _step(model, loss_fn)
    prof.disable()
    return pstats.Stats(prof).total_calls


def _ops(model, loss_fn) -> int:
    with _CountOps() as c:
        _step(model, loss_fn)
    return c.n


def measure(name: str, *, pairs: int = 40, small: bool = False) -> dict[str, Any]:
    """The NOTE's figures for one model: per side ``step_ms`` (median), ``python_calls``,
    ``aten_ops``; ``time_ratio`` (median of pair ratios) with quartiles, min and max, and the
    calls and ops ratios."""
    import slimgrad

    torch.manual_seed(0)
    eager, loss_fn = build_model(name, small)
    eager.train()
    slim = slimgrad.convert_(copy.deepcopy(eager))
    for _ in range(3):  # lazy set-up (kernel builds, caches) out of the timed steps
        _step(eager, loss_fn)
        _step(slim, loss_fn)
    times: dict[str, list[float]] = {"eager": [], "slimgrad": []}
    ratios = []
    for _ in range(pairs):
        t0 = time.thread_time()
        _step(eager, loss_fn)
        t1 = time.thread_time()
        _step(slim, loss_fn)
        t2 = time.thread_time()
        times["eager"].append((t1 - t0) * 1e3)
        times["slimgrad"].append((t2 - t1) * 1e3)
        ratios.append((t2 - t1) / max(t1 - t0, 1e-9))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    rec: dict[str, Any] = {"model": name, "pairs": pairs}
    for side, m in (("eager", eager), ("slimgrad", slim)):
        rec[side] = {
            "step_ms": statistics.median(times[side]),
            "python_calls": _calls(m, loss_fn),
            "aten_ops": _ops(m, loss_fn),
        }
    rec.update(
        time_ratio=statistics.median(ratios),
        time_ratio_q1=q[0],
        time_ratio_q3=q[2],
        time_ratio_min=min(ratios),
        time_ratio_max=max(ratios),
        python_calls_ratio=rec["slimgrad"]["python_calls"] / rec["eager"]["python_calls"],
        aten_ops_ratio=rec["slimgrad"]["aten_ops"] / rec["eager"]["aten_ops"],
    )
    return rec


def aten_ops_at_scale(small: bool = False) -> dict[str, Any]:
    """ATen ops per step, eager and converted, of HF GPT-2 small (default config) at 4x256 tokens
    (``small``: the tiny 2-layer model at 1x16)."""
    import slimgrad

    torch.manual_seed(0)
    if small:
        eager, loss_fn = _hf("hf_gpt2", layers=2, width=64, seq=16)
    else:
        eager, loss_fn = _hf("hf_gpt2", layers=12, width=768, seq=256, batch=4, full=True)
    eager.train()
    slim = slimgrad.convert_(copy.deepcopy(eager))
    _step(slim, loss_fn)  # set-up out of the count
    e, s = _ops(eager, loss_fn), _ops(slim, loss_fn)
    return {"model": "hf_gpt2 small 4x256" if not small else "hf_gpt2 tiny", "eager": e,
            "slimgrad": s, "ratio": s / e}  # fmt: skip


def _table(records: list[dict], scale: dict) -> str:
    lines = [
        f"{'model':<10} {'time ratio':>10} {'middle half':>15} {'calls':>18} {'calls ratio':>11} "
        f"{'aten ops':>13}",
    ]
    for r in records:
        lines.append(
            f"{r['model']:<10} {r['time_ratio']:>10.3f} "
            f"{r['time_ratio_q1']:>7.3f}..{r['time_ratio_q3']:<6.3f} "
            f"{r['slimgrad']['python_calls']:>8,} / {r['eager']['python_calls']:<8,} "
            f"{r['python_calls_ratio']:>11.2f} "
            f"{r['slimgrad']['aten_ops']:>5,} / {r['eager']['aten_ops']:<5,}"
        )
    lines.append(
        f"aten ops per step, {scale['model']}: {scale['slimgrad']:,} vs eager {scale['eager']:,} "
        f"({scale['ratio']:.2f}x)"
    )
    lines.append(
        "targets (issue 32): time ratio <= {time_ratio}, calls ratio <= {python_calls_ratio}, "
        "aten ops at scale <= {aten_ops_at_scale_ratio}".format(**TARGETS)
    )
    return "\n".join(lines)


def run(
    *, device="cpu", dtype=torch.float32, small=False, repeat=40, warmup=3, grad_check=False,
    out_dir=None, seed=0, progress=None,
) -> dict[str, Any]:  # fmt: skip
    """The case's runner (``harness.Case.run``): every model of ``MODELS``, then the op count at
    scale; one record (appended to ``out_dir/host_overhead.jsonl`` when given)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(
            "slimgrad.bench host_overhead: the host-overhead proxy runs on CPU in float32; "
            f"expected device='cpu', dtype=float32, got device={device!r}, dtype={dtype}. Run it "
            "without --device/--dtype."
        )
    say = progress or (lambda msg: None)
    commit = harness.git_commit()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = []
        for name in MODELS:
            say(name)
            records.append(measure(name, pairs=3 if small else max(repeat, 5), small=small))
        say("aten ops at scale")
        scale = aten_ops_at_scale(small)
    finally:
        torch.set_num_threads(threads)
    rec = {
        "case": "host_overhead",
        "small": small,
        "device": "cpu",
        "device_name": harness.device_name("cpu"),
        "threads": 1,
        "models": records,
        "aten_ops_at_scale": scale,
        "targets": TARGETS,
        "table": _table(records, scale),
        "versions": {k: v for k, v in harness.environment().items() if k != "gpus"},
        "commit": commit,
        "time_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if out_dir is not None:
        kept = {k: v for k, v in rec.items() if k != "table"}
        rec["record_path"] = harness.append_record(out_dir, "host_overhead", kept)
    return rec


def _no_pair(device, dtype, small=False):
    raise ValueError(
        "slimgrad.bench host_overhead: this case has no single eager/slimgrad pair; expected it "
        "run through its runner, got a call to build. Use `slimgrad bench host_overhead`."
    )


CASES = [
    harness.Case(
        name="host_overhead",
        build=_no_pair,
        description="host time per step on tiny models (GPT-2, Llama, ResNet-50): converted / "
        "eager time, Python calls, aten ops",
        requires=("transformers",),
        grad_check=False,
        repeat=40,
        warmup=3,
        run=run,
    )
]
