import copy

import pytest
import torch
import torch.nn as nn

import slimgrad
from tests._verify_helpers import scale_grad


class _Wrong(nn.Module):
    def forward(self, x):
        return scale_grad(x, 1.001)  # a wrong gradient, 0.1% off


def _model():
    return nn.Sequential(nn.Linear(7, 11), nn.Dropout(0.3), nn.GELU(), nn.Linear(11, 3))


def test_identical_copy_passes_with_dropout():
    torch.manual_seed(0)
    m = _model()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(5, 7))
    assert rep.ok, str(rep)
    assert len(rep.grads) == 4
    assert rep.max_grad_err < 1e-5


def test_wrong_gradient_is_caught():
    torch.manual_seed(0)
    m = _model()
    bad = copy.deepcopy(m)
    bad[2] = nn.Sequential(nn.GELU(), _Wrong())
    # parameter names are unchanged (GELU has none), the first layer's grads are 0.1% off
    rep = slimgrad.verify(m, bad, torch.randn(5, 7))
    assert not rep.ok
    assert {g.name for g in rep.grads if not g.ok} >= {"0.weight"}
    assert "FAILED" in str(rep)


def test_different_parameters_are_refused():
    m = _model()
    other = nn.Sequential(nn.Linear(7, 3))
    with pytest.raises(
        ValueError, match="slimgrad.verify: the models' trainable parameters differ"
    ):
        slimgrad.verify(m, other, torch.randn(5, 7))


def test_loss_fn_and_kwargs_inputs():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, *, x):
            return self.lin(x)

    m = KW()
    rep = slimgrad.verify(m, copy.deepcopy(m), {"x": torch.randn(3, 4)}, loss_fn=lambda o: o.sum())
    assert rep.ok


def test_unusable_output_needs_loss_fn():
    class Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return {"y": self.lin(x)}

    m = Dict()
    with pytest.raises(TypeError, match="slimgrad.verify: cannot make a loss"):
        slimgrad.verify(m, copy.deepcopy(m), torch.randn(3, 4))
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(3, 4), loss_fn=lambda o: o["y"].sum())
    assert rep.ok


# --- verify cannot be fooled -------------------------------------------------------------------


class _Out(dict):
    """A minimal HF-style output: a mapping whose fields are also attributes."""

    def __getattr__(self, name):
        return self.get(name)


class _Head(nn.Module):
    """logits = lin(x); loss = CE(logits, labels) (+ 0.1 * aux). Knobs make one side wrong."""

    def __init__(self, logits_shift=0.0, drop_aux=False, none_logits=False):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.logits_shift, self.drop_aux, self.none_logits = logits_shift, drop_aux, none_logits

    def forward(self, x, labels):
        logits = self.lin(x)
        aux = logits.square().mean()
        loss = nn.functional.cross_entropy(logits, labels) + 0.1 * aux
        out = _Out(loss=loss, logits=logits + self.logits_shift, aux_loss=aux)
        if self.drop_aux:
            out.pop("aux_loss")
        if self.none_logits:
            out["logits"] = None
        return out


def _head_pair(**wrong):
    torch.manual_seed(0)
    m = _Head()
    bad = _Head(**wrong)
    bad.load_state_dict(m.state_dict())
    return m, bad, {"x": torch.randn(5, 6), "labels": torch.tensor([0, 1, 2, 3, 0])}


def test_every_output_is_compared():
    m, same, x = _head_pair()
    rep = slimgrad.verify(m, same, x)
    assert rep.ok, str(rep)
    assert {o.name for o in rep.runs[0].outputs} == {"logits", "aux_loss"}
    assert "outputs: aux_loss, logits" in str(rep)


def test_wrong_logits_with_the_right_loss_fail():
    m, bad, x = _head_pair(logits_shift=1e-3)
    rep = slimgrad.verify(m, bad, x)
    assert rep.loss_ok and all(g.ok for g in rep.grads)  # loss and gradients are right
    assert not rep.ok
    assert [o.name for o in rep.runs[0].outputs if not o.ok] == ["logits"]
    assert "output logits: err" in str(rep)


def test_a_dropped_aux_loss_fails():
    m, bad, x = _head_pair(drop_aux=True)
    rep = slimgrad.verify(m, bad, x)
    assert not rep.ok
    assert "slimgrad.verify: output 'aux_loss' is missing from the converted model's output" in (
        str(rep)
    )
    # and the other way round: an output eager does not return
    rep = slimgrad.verify(bad, m, x)
    assert not rep.ok
    assert "returns output 'aux_loss' that eager does not" in str(rep)


def test_logits_none_is_a_note_in_training_and_a_failure_in_eval():
    m, fused, x = _head_pair(none_logits=True)
    rep = slimgrad.verify(m, fused, x, modes=("train",))
    assert rep.ok, str(rep)
    assert any("logits=None" in n for n in rep.runs[0].notes)
    assert "note: the converted model returns logits=None" in str(rep)
    rep = slimgrad.verify(m, fused, x, modes=("eval",))
    assert not rep.ok
    assert "output 'logits' is missing" in str(rep)
    rep = slimgrad.verify(m, fused, x)  # both modes by default: the eval run fails
    assert [r.name for r in rep.runs] == ["inputs (train)", "inputs (eval)"]
    assert rep.runs[0].ok and not rep.runs[1].ok and not rep.ok


def test_every_floating_tensor_of_a_tuple_output_is_compared():
    class Two(nn.Module):
        def __init__(self, shift):
            super().__init__()
            self.lin, self.shift = nn.Linear(4, 3), shift

        def forward(self, x):
            y = self.lin(x)
            return y, (y.detach() * 2 + self.shift, torch.arange(3))

    torch.manual_seed(0)
    m, bad = Two(0.0), Two(1e-3)
    bad.load_state_dict(m.state_dict())
    x = torch.randn(2, 4)
    assert slimgrad.verify(m, copy.deepcopy(m), x).ok
    rep = slimgrad.verify(m, bad, x)  # the loss comes from y; the second output is wrong
    assert not rep.ok
    assert [o.name for o in rep.runs[0].outputs if not o.ok] == ["[1][0]"]


class _NaNIn64(nn.Module):
    """Finite in float32, NaN in float64: a reference that proves nothing."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        y = self.lin(x)
        return y * float("nan") if y.dtype == torch.float64 else y


def test_a_nan_reference_fails():
    torch.manual_seed(0)
    m = _NaNIn64()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(3, 4))
    assert not rep.ok
    assert "slimgrad.verify: the float64 reference has non-finite values" in str(rep)


def test_nan_everywhere_fails():
    class AllNaN(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x) * float("nan")

    m = AllNaN()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(3, 4))
    assert not rep.ok  # NaN == NaN on every side is no evidence
    for label in ("float64 reference", "eager (original) model", "converted model"):
        assert f"the {label} has non-finite values" in str(rep)


class _Overwrites(nn.Module):
    """Right output, right gradients, but zeroes its input after reading it."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        y = self.lin(x.clone())
        x.data.zero_()
        return y


def test_a_converted_model_that_overwrites_its_input_fails():
    torch.manual_seed(0)
    m = _Plain(nn.Linear(4, 2))
    bad = _Overwrites(copy.deepcopy(m.lin))
    x = torch.randn(3, 4)
    keep = x.clone()
    rep = slimgrad.verify(m, bad, x)
    assert torch.equal(x, keep)  # the caller's tensor is never handed to a side
    assert rep.loss_ok and all(g.ok for g in rep.grads) and all(o.ok for o in rep.runs[0].outputs)
    assert not rep.ok
    assert "slimgrad.verify: the converted model changed input 'input'; expected it unchanged" in (
        str(rep)
    )
    rep = slimgrad.verify(m, bad, (x,))
    assert "changed input '[0]'" in str(rep)
    # eager writing the same thing is eager's behaviour, not the conversion's
    assert slimgrad.verify(bad, copy.deepcopy(bad), x).ok
    # a converted model that leaves alone an input eager writes over fails too
    rep = slimgrad.verify(bad, copy.deepcopy(m), x)
    assert not rep.ok and "differs from eager's" in str(rep)


class _Plain(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)


def test_each_side_gets_its_own_copy_of_the_inputs():
    # the reference used to run on inputs the converted model had already overwritten: a model
    # that doubles its input in place and reads it back would then agree with a wrong reference
    class Doubles(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            x.detach().mul_(2)
            return self.lin(x)

    torch.manual_seed(0)
    m = _Plain(nn.Linear(4, 2))
    bad = Doubles()
    bad.lin = m.lin
    m = _Plain(copy.deepcopy(m.lin))
    rep = slimgrad.verify(m, bad, torch.randn(3, 4))
    assert not rep.ok
    assert not rep.loss_ok  # judged against a reference that saw the caller's x


# --- padded batches for text models ---------------------------------------------------------------


class _TinyText(nn.Module):
    """Embeds ids, mixes in the masked mean over positions, predicts the next id (HF-style call)."""

    def __init__(self, ignore_mask=False):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)
        self.ignore_mask = ignore_mask

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if self.ignore_mask:
            m = torch.ones_like(m)
        m = m.unsqueeze(-1).to(h.dtype)
        ctx = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
        logits = self.head(h + ctx)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return _Out(loss=loss, logits=logits)


def _text():
    torch.manual_seed(0)
    m = _TinyText()
    bad = _TinyText(ignore_mask=True)
    bad.load_state_dict(m.state_dict())
    ids = torch.randint(1, 20, (3, 8))
    return m, bad, {"input_ids": ids, "labels": ids}


def test_a_model_that_ignores_the_attention_mask_passes_unpadded_fails_padded():
    m, bad, x = _text()
    rep = slimgrad.verify(m, bad, x, padded=False, modes=("train",))
    assert rep.ok, str(rep)
    assert [r.name for r in rep.runs] == ["inputs (train)"]
    assert "padded batch: not run (padded=False)" in str(rep)
    rep = slimgrad.verify(m, bad, x, modes=("train",))
    assert [r.name for r in rep.runs] == [
        "inputs (train)",
        "left-padded (train)",
        "right-padded (train)",
    ]
    assert rep.runs[0].ok and not rep.runs[1].ok and not rep.runs[2].ok
    assert not rep.ok
    assert "left-padded (train): FAILED" in str(rep) and "right-padded (train): FAILED" in str(rep)


def test_padded_runs_pass_for_a_faithful_copy_and_mask_labels():
    m, _, x = _text()
    rep = slimgrad.verify(m, copy.deepcopy(m), x)
    assert rep.ok, str(rep)
    assert "padded batch: left and right, [0, 2, 4] pad positions per row" in str(rep)
    # the padded runs saw pad ids, mask zeros and -100 labels (row 0 untouched), so their
    # losses differ from the unpadded one's
    assert len({r.loss_eager for r in rep.runs}) == 3


def test_padded_runs_are_skipped_with_a_reason():
    torch.manual_seed(0)
    m = _model()
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.randn(5, 7))
    assert [r.name for r in rep.runs] == ["inputs (train)", "inputs (eval)"]
    assert "padded batch: not run (inputs are not a dict with 2-D integer input_ids)" in str(rep)

    class NoMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 4)

        def forward(self, input_ids):
            return self.emb(input_ids).sum()

    nm = NoMask()
    ids = {"input_ids": torch.randint(0, 20, (2, 5))}
    rep = slimgrad.verify(nm, copy.deepcopy(nm), ids, modes=("train",))
    assert rep.ok and len(rep.runs) == 1
    assert "not run (the model's forward takes no attention_mask)" in str(rep)


def test_an_original_that_is_itself_converted_fails():
    torch.manual_seed(0)
    m = _model()
    conv = slimgrad.convert_(copy.deepcopy(m))
    assert slimgrad.verify(m, conv, torch.randn(5, 7)).ok
    rep = slimgrad.verify(conv, copy.deepcopy(conv), torch.randn(5, 7))
    assert not rep.ok  # slimgrad against slimgrad proves nothing
    assert "slimgrad.verify: the original model is itself converted; expected plain modules" in (
        str(rep)
    )


def test_non_leaf_inputs_are_copied():
    torch.manual_seed(0)
    m = _model()
    w = torch.randn(5, 7, requires_grad=True)
    x = w * 2  # a non-leaf input: deepcopy refuses it
    rep = slimgrad.verify(m, copy.deepcopy(m), (x,))
    assert rep.ok, str(rep)


def test_namedtuple_inputs():
    from collections import namedtuple

    Batch = namedtuple("Batch", "x")
    torch.manual_seed(0)

    class Unpack(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _model()

        def forward(self, batch):
            return self.inner(batch.x)

    u = Unpack()
    rep = slimgrad.verify(u, copy.deepcopy(u), (Batch(torch.randn(5, 7)),))
    assert rep.ok, str(rep)


class _NoPadding(_TinyText):
    """Refuses any attention_mask with zeros (as some models refuse padding)."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padding is not supported")
        return super().forward(input_ids, attention_mask, labels)


def test_a_converted_model_that_raises_on_padding_fails():
    m, _, x = _text()
    bad = _NoPadding()
    bad.load_state_dict(m.state_dict())
    rep = slimgrad.verify(m, bad, x)
    assert not rep.ok and rep.runs[0].ok
    assert "the converted model raised on the left-padded (train) batch" in str(rep)


def test_an_original_that_refuses_padding_runs_unpadded_only():
    m, _, x = _text()
    strict = _NoPadding()
    strict.load_state_dict(m.state_dict())
    rep = slimgrad.verify(strict, copy.deepcopy(strict), x)
    assert rep.ok and [r.name for r in rep.runs] == ["inputs (train)", "inputs (eval)"]
    for mode in ("train", "eval"):
        why = f"left-padded ({mode}) not run (the original raised ValueError: padding is not"
        assert why in str(rep)


class _EvalOnlyShift(nn.Module):
    """Right in train mode, off by 1e-3 in eval mode (an eval-only code path gone wrong)."""

    def __init__(self, shift: float):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.shift = shift

    def forward(self, x):
        y = self.lin(x)
        return y if self.training else y + self.shift


def test_every_batch_runs_in_train_and_eval_and_modes_are_restored():
    torch.manual_seed(0)
    m = nn.Sequential(_EvalOnlyShift(0.0))
    bad = copy.deepcopy(m)
    bad[0].shift = 1e-3
    x = torch.randn(4, 6)
    assert slimgrad.verify(m, bad, x, modes=("train",)).ok  # one mode cannot see it
    m.train(), bad.train()
    rep = slimgrad.verify(m, bad, x)
    assert not rep.ok and [r.ok for r in rep.runs] == [True, False], str(rep)
    assert m.training and bad.training and bad[0].training  # the caller's modes are restored
    m.eval(), bad.eval()
    slimgrad.verify(m, bad, x)
    assert not m.training and not bad[0].training
    with pytest.raises(ValueError, match="slimgrad.verify: modes must name 'train' and/or"):
        slimgrad.verify(m, bad, x, modes=("training",))


def test_buffers_are_compared_after_the_step():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    wrong = copy.deepcopy(m)
    wrong[1].momentum = 0.9  # same outputs and gradients in training, other running statistics
    x = torch.randn(8, 6)
    rep = slimgrad.verify(m, wrong, x, modes=("train",))
    assert not rep.ok
    assert "slimgrad.verify: buffer '1.running_mean' after the step differs" in str(rep)
    assert slimgrad.verify(m, copy.deepcopy(m), x).ok
    counter = copy.deepcopy(m)
    counter[1].num_batches_tracked.add_(1)  # integer buffers: exactly
    rep = slimgrad.verify(m, counter, x, modes=("train",))
    assert "buffer '1.num_batches_tracked' after the step differs" in str(rep)


# --- reentrant activation checkpointing (NOTE [Gradients under reentrant checkpointing]) ---------


class _Ckpt(nn.Module):
    """stem, then ``body`` under torch.utils.checkpoint (reentrant or not)."""

    def __init__(self, body: nn.Module, reentrant: bool):
        super().__init__()
        self.stem, self.body, self.reentrant = nn.Linear(7, 7), body, reentrant

    def forward(self, x):
        h = self.stem(x)
        return torch.utils.checkpoint.checkpoint(self.body, h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_models_verify_and_keep_their_grads(reentrant):
    # reentrant checkpointing cannot run under autograd.grad: verify used to raise here
    torch.manual_seed(0)
    m = _Ckpt(_model(), reentrant)
    keep = {n: torch.full_like(p, 7.0) for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        p.grad = keep[n].clone()  # gradients the caller accumulated before verify
    slim = slimgrad.convert_(copy.deepcopy(m))
    rep = slimgrad.verify(m, slim, torch.randn(5, 7))
    assert rep.ok, str(rep)
    assert len(rep.grads) == 6 and rep.max_grad_err < 1e-5
    assert ("reentrant torch.utils.checkpoint" in str(rep)) == reentrant
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, keep[n])  # put back as they were
    assert all(p.grad is None for p in slim.parameters())


def test_a_wrong_gradient_inside_a_reentrant_region_is_caught():
    torch.manual_seed(0)
    m = _Ckpt(_model(), True)
    bad = copy.deepcopy(m)
    bad.body[2] = nn.Sequential(nn.GELU(), _Wrong())
    rep = slimgrad.verify(m, bad, torch.randn(5, 7), modes=("train",))
    assert not rep.ok
    assert {g.name for g in rep.grads if not g.ok} >= {"stem.weight", "body.0.weight"}


class _Complex(nn.Module):
    def __init__(self, imag_sign=1.0):
        super().__init__()
        self.lin, self.imag_sign = nn.Linear(4, 3), imag_sign

    def forward(self, x):
        y = self.lin(x)
        return torch.complex(y, self.imag_sign * y)


def test_a_wrong_imaginary_part_of_a_complex_output_is_caught():
    # the loss and the gradients see only the real part: the output comparison must see the rest
    torch.manual_seed(0)
    m, bad = _Complex(), _Complex(imag_sign=-1.0)
    bad.load_state_dict(m.state_dict())
    x = torch.randn(5, 4)
    rep = slimgrad.verify(m, copy.deepcopy(m), x, loss_fn=lambda out: out.real.square().mean())
    assert rep.ok, str(rep)
    rep = slimgrad.verify(m, bad, x, loss_fn=lambda out: out.real.square().mean())
    assert not rep.ok and all(g.ok for g in rep.grads)
    assert [o.name for o in rep.runs[0].outputs if not o.ok] == ["output"]


def test_a_run_that_compares_no_gradient_says_so():
    # a model whose parameters are all frozen, on integer inputs: loss and outputs only; its "OK"
    # said nothing of that (accelerate's cpu_offload gives the same 0 gradients)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 3)).requires_grad_(False)
    rep = slimgrad.verify(m, copy.deepcopy(m), torch.tensor([[1, 2, 3]]), loss_fn=lambda o: o.sum())
    assert rep.ok, str(rep)
    assert str(rep).startswith("verify: OK (no gradient compared);")
    assert all("note: no gradient compared" in "\n".join(r.lines()) for r in rep.runs)
    rep = slimgrad.verify(m.requires_grad_(True), copy.deepcopy(m), torch.tensor([[1, 2, 3]]))
    assert "no gradient compared" not in str(rep)
