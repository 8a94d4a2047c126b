"""Activation checkpointing and slimgrad, alone and together (issue 16): exact peak bytes.

For each model, four (five) settings of the same training step, same seed and inputs:

- ``eager``: the model as built;
- ``eager+ckpt``: each block under ``torch.utils.checkpoint`` (HF:
  ``gradient_checkpointing_enable``, non-reentrant, HF's default; the CNN: each residual block);
- ``slimgrad``: ``slimgrad.convert_`` of a copy;
- ``slimgrad+ckpt``: both (HF: checkpointing enabled after ``convert_``);
- ``slimgrad+ckpt(reentrant)``: both, with ``use_reentrant=True``.

Bytes come from ``slimgrad.memory.measure`` (exact, deterministic, CPU): ``peak_bytes`` of forward +
backward above what was live before the step (parameters and inputs excluded), and the forward's
peak. One warm-up step runs first (caches); ``.grad`` is cleared before each step so every setting
allocates its gradients in the step. Every setting's loss and gradients are checked against
``eager`` with ``torch.testing.assert_close`` (dropout on, same masks); the script fails otherwise.

Models (random init, float32): HF GPT-2 and Llama at two sizes ("tiny": 2 layers, width 64, vocab
512, 2 x 64 tokens; "small": 4 layers, width 128, vocab 2048, 4 x 128 tokens), and a ResNet-ish CNN
from torch only (conv-BN-ReLU stem, 4 BasicBlocks at 16/32 channels, 8 x 3 x 32 x 32 images).

Usage (from the repository root):
    PYTHONPATH=src .venv/bin/python benchmarks/checkpointing.py \
        --out benchmarks/results/checkpointing.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from datetime import datetime, timezone

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

MiB = 2**20


class _Basic(nn.Module):
    def __init__(self, c_in: int, c: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.down = None
        if stride != 1 or c_in != c:
            self.down = nn.Sequential(nn.Conv2d(c_in, c, 1, stride, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetish(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)
        )
        self.blocks = nn.ModuleList(
            [_Basic(16, 16), _Basic(16, 16), _Basic(16, 32, 2), _Basic(32, 32)]
        )
        self.head = nn.Linear(32, classes)
        self.ckpt: dict | None = None

    def forward(self, x, labels):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h) if self.ckpt is None else checkpoint(b, h, **self.ckpt)
        logits = self.head(h.mean((2, 3)))
        return nn.functional.cross_entropy(logits, labels)


def _hf(family: str, size: str):
    import transformers as t

    layers, width, vocab, batch, seq = {
        "tiny": (2, 64, 512, 2, 64),
        "small": (4, 128, 2048, 4, 128),
    }[size]
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = t.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq
        )
        model = t.GPT2LMHeadModel(cfg)
    else:
        cfg = t.LlamaConfig(
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
        )
        model = t.LlamaForCausalLM(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    shapes = f"L={layers} d={width} V={vocab} B={batch} T={seq}"
    return model, (lambda m: m(input_ids=ids, labels=ids).loss), shapes


def _cnn():
    torch.manual_seed(0)
    model = ResNetish()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    return model, (lambda m: m(x, y)), "4 BasicBlocks 16/32 ch, B=8 3x32x32"


def _enable(model, reentrant: bool) -> None:
    if isinstance(model, ResNetish):
        model.ckpt = {"use_reentrant": reentrant}
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )


def _settings(model):
    import slimgrad

    eager = copy.deepcopy(model)
    ck = copy.deepcopy(model)
    _enable(ck, False)
    slim = slimgrad.convert_(copy.deepcopy(model))
    slim_ck = slimgrad.convert_(copy.deepcopy(model))
    _enable(slim_ck, False)
    slim_re = slimgrad.convert_(copy.deepcopy(model))
    _enable(slim_re, True)
    return {
        "eager": eager,
        "eager+ckpt": ck,
        "slimgrad": slim,
        "slimgrad+ckpt": slim_ck,
        "slimgrad+ckpt(reentrant)": slim_re,
    }


def _run(model, loss_of):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def case(name: str, build) -> list[dict]:
    from slimgrad.bench.harness import environment, git_commit
    from slimgrad.memory import measure

    model, loss_of, shapes = build()
    ref_loss, ref_grads = None, None
    rows = []
    for setting, m in _settings(model).items():
        loss, grads = _run(m, loss_of)  # warm-up, and the gradient check
        if ref_loss is None:
            ref_loss, ref_grads = loss, grads
        else:
            torch.testing.assert_close(loss, ref_loss)
            torch.testing.assert_close(grads, ref_grads)
        m.zero_grad(set_to_none=True)

        def fwd(m=m):
            torch.manual_seed(1)
            return loss_of(m)

        mem = measure(fwd, module=None, timeline=False)
        rows.append(
            {
                "case": f"checkpointing_{name}",
                "setting": setting,
                "shapes": shapes,
                "dtype": "float32",
                "peak_bytes": mem.peak_bytes,
                "forward_peak_bytes": mem.forward_peak_bytes,
                "retained_bytes": mem.retained_bytes,
                "grad_check": "asserted (assert_close vs eager, same dropout masks)",
                "device": "cpu",
                "versions": environment(),
                "commit": git_commit(),
                "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
        )
    return rows


CASES = {
    "gpt2_tiny": lambda: _hf("gpt2", "tiny"),
    "llama_tiny": lambda: _hf("llama", "tiny"),
    "gpt2_small": lambda: _hf("gpt2", "small"),
    "llama_small": lambda: _hf("llama", "small"),
    "resnetish": _cnn,
}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=None, help="JSONL file to append the records to")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    allrows = []
    print("| model | setting | peak MiB | fwd peak MiB | retained MiB | peak vs eager |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.cases:
        rows = case(name, CASES[name])
        base = rows[0]["peak_bytes"]
        for r in rows:
            print(
                f"| {name} ({r['shapes']}) | {r['setting']} | {r['peak_bytes'] / MiB:.2f} | "
                f"{r['forward_peak_bytes'] / MiB:.2f} | {r['retained_bytes'] / MiB:.2f} | "
                f"{r['peak_bytes'] / base:.2f}x |",
                flush=True,
            )
        allrows += rows
        if args.out:
            with open(args.out, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    return allrows


if __name__ == "__main__":
    main()
