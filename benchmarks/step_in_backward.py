"""``slimgrad.step_in_backward`` (issue 17): peak bytes of a whole training step, and step time.

Memory (``--what memory``): for each model, the peak live bytes of one whole step, exact
(``slimgrad.memory.measure``; with ``--estimate`` under ``FakeTensorMode`` through
``slimgrad.memory.estimate``: nothing computed or allocated), for four sides:

- ``eager+plain``: the eager model, ``loss.backward(); opt.step(); opt.zero_grad()`` (the baseline);
- ``converted+plain``: ``slimgrad.convert_`` of the same model, the same loop;
- ``eager+sib`` / ``converted+sib``: ``step_in_backward(model, Opt, ...)`` and
  ``loss.backward(); handle.step(); handle.zero_grad()``;
- ``eager+peer`` / ``converted+peer``: the best peer, PyTorch's documented optimizer-in-backward
  pattern (the tutorial "How to save memory by fusing the optimizer step into the backward pass",
  torchtune's ``optimizer_in_bwd``): one optimizer per parameter, stepped and zeroed from that
  parameter's ``register_post_accumulate_grad_hook``; the loop is ``loss.backward()``.

Identity (``--what identity``): the converted model, 5 real steps of the plain loop, of
step_in_backward and of the peer from the same start and batches; parameters compared bit for bit
with the plain loop's.

The measured region is the whole step (forward, backward, ``step()``, ``zero_grad()``), after one
unmeasured warm-up step per side, so the optimizer state exists before it and counts in neither
side; the optimizer's own temporaries (AdamW's ``sqrt``/``div`` of the largest parameter) count
in both. Models: HF ``LlamaForCausalLM`` 12 x 768 (intermediate 2048, vocab 32000, untied head,
attention dropout 0.1) at 1 x 256 tokens, and HF ``GPT2LMHeadModel(GPT2Config())`` at 4 x 256,
both fp32, labels = ids.

Time (``--what time``): a small model (GPT-2-style ``slimgrad.bench.models.GPT``, 4 x 256 and
vocabulary 8192 by default), plain loop against step_in_backward on copies of it, interleaved
A/B steps, median of the per-pair ratios and their spread; the parameters of both sides are
checked bit for bit.

Usage (from the repository root):
    PYTHONPATH=src .venv/bin/python benchmarks/step_in_backward.py --what memory --estimate
    PYTHONPATH=src .venv/bin/python benchmarks/step_in_backward.py --what time --repeat 21
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

MIB = 2**20


def _llama():
    # bench case hf_llama's model (untied head, sdpa), without its padded batches
    from slimgrad.bench.cases.models import eager_hf_text

    net = eager_hf_text("llama", "cpu", torch.float32)[0].model
    return net, net.config.vocab_size, (1, 256)


def _gpt2():
    # bench case hf_gpt2's model: GPT2LMHeadModel(GPT2Config())
    from slimgrad.bench.cases.models import hf_gpt2

    net = hf_gpt2().model
    return net, net.config.vocab_size, (4, 256)


def _llama_small(attention_dropout: float = 0.1):
    # the step-time model: 4 x 256 (intermediate 688), vocab 8192, untied head
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=8192,
        attention_dropout=attention_dropout,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg), cfg.vocab_size, (4, 64)


_MODELS = {"llama": _llama, "gpt2": _gpt2, "llama-small": _llama_small}


def _optimizer(name: str):
    if name == "sgd":
        return torch.optim.SGD, dict(lr=1e-3, momentum=0.9)
    return torch.optim.AdamW, dict(lr=1e-4)


class _Peer:
    """PyTorch's documented optimizer-in-backward: one optimizer per parameter, driven by
    ``register_post_accumulate_grad_hook`` (step, then zero_grad); step()/zero_grad() do nothing."""

    def __init__(self, params, cls, kw):
        self.opts = {p: cls([p], **kw) for p in params if p.requires_grad}
        for p in self.opts:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.opts[p].step()
        self.opts[p].zero_grad()

    def step(self):
        pass

    def zero_grad(self):
        pass


def _make_opt(model, how: str, opt_name: str):
    import slimgrad

    cls, kw = _optimizer(opt_name)
    if how == "sib":
        return slimgrad.step_in_backward(model, cls, **kw)
    if how == "peer":
        return _Peer(model.parameters(), cls, kw)
    return cls(model.parameters(), **kw)


def _side(model_name: str, convert: bool, how: str, opt_name: str):
    """Build one side (under whatever mode is active) and return (step, module)."""
    import slimgrad
    from slimgrad.bench.cases.models import HFCausalLMLoss

    net, vocab, shape = _MODELS[model_name]()
    model = HFCausalLMLoss(net.train())
    if convert:
        slimgrad.convert_(model)
    opt = _make_opt(model, how, opt_name)
    ids = torch.randint(0, vocab, shape)

    def step():
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step()  # warm-up: optimizer state and lazily built tables exist before the measured step
    return step, model


def memory(args) -> list[dict]:
    from slimgrad.memory import estimate, measure

    records = []
    for model_name in args.models:
        base = None
        for label in args.sides:
            convert, how = label.split("+")
            convert = convert == "converted"
            t0 = time.perf_counter()
            if args.estimate:
                m = estimate(
                    lambda n=model_name, c=convert, s=how: _side(n, c, s, args.optimizer),
                    backward=False,
                    timeline=False,
                )
            else:
                step, module = _side(model_name, convert, how, args.optimizer)
                m = measure(step, backward=False, module=module, timeline=False)
            base = m.peak_bytes if base is None else base
            rec = {
                "case": f"step_in_backward/{model_name}",
                "side": label,
                "optimizer": args.optimizer,
                "estimated": bool(args.estimate),
                "peak_bytes": m.peak_bytes,
                "peak_mib": round(m.peak_bytes / MIB, 1),
                "ratio_to_eager_plain": round(m.peak_bytes / base, 3),
                "peak_op": m.peak_op,
                "peak_phase": m.peak_phase,
                "saved_bytes": m.saved_bytes,
                "seconds": round(time.perf_counter() - t0, 1),
                **_env(),
            }
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


def _env() -> dict:
    import platform
    import subprocess

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "commit": commit,
    }


def identity(args) -> list[dict]:
    import slimgrad
    from slimgrad.bench.cases.models import HFCausalLMLoss

    records = []
    for model_name in args.models:
        torch.manual_seed(0)
        net, vocab, shape = _MODELS[model_name]()
        base = HFCausalLMLoss(net.train())
        slimgrad.convert_(base)
        sides = {h: copy.deepcopy(base) for h in ("plain", "sib", "peer")}
        opts = {h: _make_opt(m, h, args.optimizer) for h, m in sides.items()}
        gen = torch.Generator().manual_seed(1)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ids = torch.randint(0, vocab, shape, generator=gen)
            for h, m in sides.items():
                torch.manual_seed(2)  # the same dropout masks on every side
                m(ids).backward()
                opts[h].step()
                opts[h].zero_grad()
        ref = list(sides["plain"].parameters())
        for h in ("sib", "peer"):
            got = list(sides[h].parameters())
            differ = [
                i for i, (p, q) in enumerate(zip(ref, got, strict=True)) if not torch.equal(p, q)
            ]
            rec = {
                "case": f"step_in_backward/{model_name}/identity",
                "side": f"converted+{h}",
                "optimizer": args.optimizer,
                "steps": args.steps,
                "params_bit_identical": not differ,
                "params_differing": len(differ),
                "params": len(ref),
                "seconds": round(time.perf_counter() - t0, 1),
                **_env(),
            }
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


def _llama_time(args) -> dict:
    # converted HF Llama, untied head (the head goes by vocabulary blocks in step_in_backward):
    # _llama_small without dropout; plain loop vs step_in_backward
    import slimgrad
    from slimgrad.bench.cases.models import HFCausalLMLoss

    net, vocab, _ = _llama_small(attention_dropout=0.0)
    base = slimgrad.convert_(HFCausalLMLoss(net.train()))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cls, kw = _optimizer(args.optimizer)
    opt = cls(a.parameters(), **kw)
    handle = slimgrad.step_in_backward(b, cls, **kw)
    gen = torch.Generator().manual_seed(1)

    def run(model, o):
        def one(ids):
            t0 = time.perf_counter()
            model(ids).backward()
            o.step()
            o.zero_grad()
            return time.perf_counter() - t0

        return one

    plain, sib = run(a, opt), run(b, handle)
    return _interleave(
        args,
        lambda: (torch.randint(0, vocab, (args.batch, args.seq), generator=gen),),
        plain,
        sib,
        a,
        b,
        f"HF Llama 4x256 vocab 8192 untied, converted ({sum(p.numel() for p in a.parameters())}"
        " params)",
    )


def _interleave(args, inputs, plain, sib, a, b, model_name) -> dict:
    for _ in range(args.warmup):
        x = inputs()
        plain(*x)
        sib(*x)
    ratios, ta, tb = [], [], []
    for i in range(args.repeat):
        x = inputs()
        if i % 2:  # alternate which side runs first
            t_b, t_a = sib(*x), plain(*x)
        else:
            t_a, t_b = plain(*x), sib(*x)
        ta.append(t_a)
        tb.append(t_b)
        ratios.append(t_b / t_a)
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    rec = {
        "case": "step_in_backward/time",
        "model": model_name,
        "optimizer": args.optimizer,
        "batch_seq": [args.batch, args.seq],
        "plain_ms": round(1e3 * statistics.median(ta), 2),
        "sib_ms": round(1e3 * statistics.median(tb), 2),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "repeat": args.repeat,
        "params_bit_identical": same,
        "threads": torch.get_num_threads(),
        "load_avg_1min": round(__import__("os").getloadavg()[0], 2),
        **_env(),
    }
    print(json.dumps(rec), flush=True)
    if not same:
        raise SystemExit("parameters differ between the plain loop and step_in_backward")
    return rec


def step_time(args) -> dict:
    import slimgrad
    from slimgrad.bench.models import GPT, GPTConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.size == "llama":
        return _llama_time(args)
    if args.size == "tiny":
        cfg = GPTConfig.tiny(dropout=0.0)
    elif args.size == "mid":  # 4 x 256, vocab 8192: about 5.5M parameters
        cfg = GPTConfig(vocab_size=8192, n_positions=256, n_embd=256, n_layer=4, n_head=4)
        cfg = GPTConfig(**{**cfg.__dict__, "dropout": 0.0})
    else:
        cfg = GPTConfig.small(dropout=0.0)
    base = GPT(cfg)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    cls, kw = _optimizer(args.optimizer)
    opt = cls(a.parameters(), **kw)
    handle = slimgrad.step_in_backward(b, cls, **kw)
    gen = torch.Generator().manual_seed(1)

    def inputs():
        idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)
        return idx, torch.roll(idx, -1, 1)

    def plain(idx, tgt):
        t0 = time.perf_counter()
        a(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    def sib(idx, tgt):
        t0 = time.perf_counter()
        b(idx, tgt).backward()
        handle.step()
        handle.zero_grad()
        return time.perf_counter() - t0

    name = f"GPT {args.size} ({sum(p.numel() for p in a.parameters())} params)"
    return _interleave(args, inputs, plain, sib, a, b, name)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("memory", "time", "identity"), default="memory")
    ap.add_argument(
        "--sides",
        nargs="+",
        default=[
            "eager+plain",
            "converted+plain",
            "eager+sib",
            "converted+sib",
            "eager+peer",
            "converted+peer",
        ],
        help="memory: which sides (the first is the ratio's base)",
    )
    ap.add_argument("--steps", type=int, default=5, help="identity: steps")
    ap.add_argument("--out", default=None, help="append the records to this JSONL file")
    ap.add_argument("--models", nargs="+", choices=tuple(_MODELS), default=list(_MODELS))
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    ap.add_argument("--estimate", action="store_true", help="FakeTensorMode: no compute")
    ap.add_argument("--size", choices=("tiny", "mid", "small", "llama"), default="mid")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (time only)")
    args = ap.parse_args(argv)
    if args.what == "memory":
        recs = memory(args)
    elif args.what == "identity":
        recs = identity(args)
    else:
        recs = [step_time(args)]
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
