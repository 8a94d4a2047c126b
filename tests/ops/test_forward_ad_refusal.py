"""Issue 30: forward-mode AD through a converted op is refused in slimgrad's form.

Dual tensors (``torch.autograd.forward_ad``) reaching a slimgrad autograd Function got torch's
generic "You must implement the jvp function for custom autograd.Function ..." naming neither the
op nor a fix. Every slimgrad Function now has a ``jvp`` that raises ``slimgrad.<op>: forward-mode
AD ...`` with the ConvertConfig switch (NOTE [Forward-mode AD is refused] in
slimgrad/_autograd.py). ``torch.func.jvp`` runs eager's ops (NOTE [torch.func transforms]): its
tangents are eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.autograd import forward_ad as fwAD

import slimgrad
import slimgrad.ops.gpt2_attention  # noqa: F401  (imported on demand by convert_: its Functions too)
from slimgrad.ops.gated_mlp import gated_mlp
from slimgrad.ops.gelu import gelu
from slimgrad.ops.layer_norm import layer_norm
from slimgrad.ops.linear import linear

_FORM = (
    r"^slimgrad\.{api}: forward-mode AD .* not supported by the lean op.*; expected .*, got .*\. "
)


def _functions() -> list[type]:
    out, stack = [], [torch.autograd.Function]
    while stack:
        c = stack.pop()
        stack.extend(c.__subclasses__())
        # Functions made inside a function at run time (ownership's calibration probes, applied
        # to its own tensors only) come after slimgrad's walk: not the ops a user's tensors meet
        if (
            c.__module__.startswith("slimgrad.")
            and not c.__module__.startswith("slimgrad.bench")
            and "<locals>" not in c.__qualname__
        ):
            out.append(c)
    return out


def test_every_slimgrad_function_refuses_forward_ad():
    fns = _functions()
    assert len(fns) > 40  # the walk found slimgrad's Functions
    bad = []
    for cls in fns:
        try:
            cls.jvp(None, None)
        except NotImplementedError as e:
            msg = str(e)
            if not (
                msg.startswith("slimgrad.") and "forward-mode AD" in msg and "filter_fn" in msg
            ):
                bad.append((cls.__qualname__, msg[:80]))
        else:
            bad.append((cls.__qualname__, "no error"))
    assert not bad, bad


def _dual(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(), torch.randn(*shape, generator=g)


@pytest.mark.parametrize(
    "api, field, call",
    [
        ("ops.gelu", "activations", lambda x: gelu(x)),
        ("ops.layer_norm", "norms", lambda x: layer_norm(x, (8,))),
        ("ops.linear", "selective_saving", lambda x: linear(x, torch.ones(4, 8))),
        (
            "ops.gated_mlp",
            "activations",
            lambda x: gated_mlp(
                x, torch.ones(6, 8, requires_grad=True), torch.ones(6, 8), torch.ones(8, 6)
            ),
        ),
    ],
)
def test_dual_tensor_through_op_is_refused(api, field, call):
    x, t = _dual((3, 5, 8), 0)
    with fwAD.dual_level(), pytest.raises(NotImplementedError) as info:
        call(fwAD.make_dual(x, t))
    msg = str(info.value)
    assert info.match(_FORM.format(api=api.replace(".", r"\.")))
    assert f"ConvertConfig({field}=False)" in msg and "filter_fn" in msg


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1,
        vocab_size=50, head_dim=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def test_converted_model_under_forward_ad_is_refused_unchanged():
    m = _llama()
    slimgrad.convert_(m)
    before = copy.deepcopy(m.state_dict())
    x, t = _dual((2, 32, 64), 1)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match=r"^slimgrad\.ops\.rms_norm"):
        m(inputs_embeds=fwAD.make_dual(x, t))
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_func_jvp_through_converted_gated_mlp_is_eager():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=1, num_hidden_layers=1,
        head_dim=2,
    )  # fmt: skip
    eager = torch.nn.Sequential(LlamaMLP(cfg))
    conv = copy.deepcopy(eager)
    slimgrad.convert_(conv)
    assert type(conv[0]).__module__ == "slimgrad.nn.gated_mlp"
    x, t = _dual((2, 32, 64), 2)
    ours = torch.func.jvp(conv, (x.detach(),), (t,))
    ref = torch.func.jvp(eager, (x.detach(),), (t,))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
