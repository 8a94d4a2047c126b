"""What the distributed tests share: a training function run on 2 gloo ranks (forked processes)
with what each returns collected; a few SGD steps under DistributedDataParallel; the tiny HF
models; the variants (float64 reference, eager, converted, converted with reuse off); the error
rule over training steps."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import slimgrad
from slimgrad import ownership
from slimgrad.testing import assert_within_rule

WORLD = 2


def _worker(rank: int, port: int, out_dir: str, train: Callable[[int], dict]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(train(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The modules a rank needs, imported once by the fork server (see run_on_two_ranks).
_PRELOAD = ["torch", "torch.distributed", "transformers", "slimgrad", "tests.distributed._gloo"]


def run_on_two_ranks(train: Callable[[int], dict], out_dir) -> tuple[dict, dict]:
    """``train(rank)`` on each of 2 gloo ranks; returns the two ranks' results.

    ``train`` must be picklable (a module-level function or a ``functools.partial`` of one).
    torch.multiprocessing's spawn API with the forkserver start method: the ranks fork from a
    clean server process that imported torch, transformers and slimgrad once (per test process),
    not from the test process itself. A plain fork copied whatever state earlier tests left in
    the test process (threads, compiled-code caches) and a rank could crash on it (a SIGSEGV in
    CI, not reproducible alone); spawn would re-import torch for every rank.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    mp.start_processes(
        _worker,
        args=(_free_port(), str(out_dir), train),
        nprocs=WORLD,
        join=True,
        start_method="forkserver",
    )
    return tuple(torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD))


# ----------------------------------------------------- what the training functions share


def train_ddp(
    net: torch.nn.Module,
    batch: Callable[[int], torch.Tensor],
    loss: Callable[[torch.Tensor], torch.Tensor],
    *,
    steps: int = 2,
    lr: float = 0.1,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` SGD steps of ``net`` under DistributedDataParallel, the input of step ``k``
    from ``batch(k)`` (called before ``zero_grad``: it may seed), the loss ``loss(output)``;
    returns copies of the parameters and of their last gradients."""
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x = batch(step)
        opt.zero_grad()
        loss(model(x)).backward()
        opt.step()
    params = list(model.parameters())
    return [p.detach().clone() for p in params], [p.grad.clone() for p in params]


VOCAB = 97  # the tiny HF models' vocabulary


def tiny_llama(**overrides):
    """A 2-layer Llama (hidden 32, 4 heads, 2 KV heads, eager attention), seeded."""
    import transformers

    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(cfg | overrides)))


def tiny_gpt2(**overrides):
    """A 2-layer GPT-2 (n_embd 32, 4 heads, no dropout, eager attention, tied embedding), seeded."""
    import transformers

    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**(cfg | overrides)))


def prepare(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    """``ref64``: the model in float64 (the rule's reference); ``eager``: as it is; any other
    variant (``slimgrad``, ``no_reuse``): converted in place."""
    if variant == "ref64":
        return model.double()
    if variant != "eager":
        slimgrad.convert_(model)
    return model


@contextlib.contextmanager
def reuse_for(variant: str):
    """Counts gradient-buffer reuse from zero (``ownership.reuse_count``); ``no_reuse``: off."""
    ownership.reset_reuse_count()
    with ownership.reuse_disabled() if variant == "no_reuse" else contextlib.nullcontext():
        yield


def assert_steps_within_rule(
    ours: list, ref: list, eager: list, what: str, *, steps: int, label: str = "step", atol=None
) -> None:
    """The error rule at every step: one tensor per step (named ``<label><k> <what>``) or a list
    of them (``<label><k> <what><i>``), against the float64 run."""
    counts = (len(ours), len(ref), len(eager))
    assert counts == (steps,) * 3, f"{label}: {counts} results, expected {steps} each"
    for k, (o, r, e) in enumerate(zip(ours, ref, eager, strict=True)):
        if isinstance(o, torch.Tensor):
            names = [f"{label}{k} {what}"]
        else:
            names = [f"{label}{k} {what}{i}" for i in range(len(o))]
        assert_within_rule(o, r, e, atol=atol, names=names)
