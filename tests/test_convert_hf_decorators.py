"""HF forward decorators that do not change the computation (NOTE [Decorators that do not change
the computation] in ``convert_handlers/hf.py``), and the warning for a refused known family.

The fused LM loss decides on what a forward computes: a forward made of HF's own GPT-2 source with
one more known decorator (or a keyword renamed by ``deprecate_kwarg``) still fuses, and behaves as
HF's forward for calls with the deprecated name; an unknown decorator, a look-alike of a known one
or a wrapper added at run time keeps HF's forward, with the real reason in the report.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import linecache
import sys
import textwrap
import warnings

import pytest
import torch

import slimgrad
from slimgrad.convert_handlers import hf as hf_glue
from slimgrad.convert_handlers import hf_loss
from slimgrad.testing import assert_within_rule
from tests._threads import one_thread

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402

V, T, B = 97, 11, 2
_GPT2 = dict(
    vocab_size=V, n_embd=32, n_head=4, n_layer=2, n_positions=64,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


_COUNTER = itertools.count()


def _variant(decorator_lines: list[str], extra_globals: dict, edit=None) -> type:
    """A GPT2LMHeadModel subclass whose forward is HF's GPT-2 forward source (read from the
    installed transformers) with ``decorator_lines`` put above it (outermost first) and optionally
    edited by ``edit(src)``; compiled in a copy of modeling_gpt2's globals plus ``extra_globals``,
    and registered with linecache so that ``inspect.getsource`` reads it as a module file would."""
    raw = inspect.unwrap(modeling_gpt2.GPT2LMHeadModel.forward)
    src = textwrap.dedent(inspect.getsource(raw))
    lines = src.splitlines()
    first_def = next(i for i, s in enumerate(lines) if s.startswith("def "))
    src = "\n".join([*decorator_lines, *lines[first_def:]]) + "\n"
    if edit is not None:
        src = edit(src)
    fname = f"<slimgrad-test-forward-{next(_COUNTER)}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    g = dict(vars(modeling_gpt2))
    g.update(extra_globals)
    real_doc = g["auto_docstring"]
    if real_doc is modeling_gpt2.auto_docstring:
        # HF's auto_docstring reads the docs of a models/<name>/ file and returns the function
        # itself: here it is stood in for while compiling and is HF's object afterwards
        g["auto_docstring"] = lambda fn: fn
    exec(compile(src, fname, "exec"), g)  # noqa: S102 - the test builds a forward from HF's source
    g["auto_docstring"] = real_doc
    return type("GPT2Variant", (modeling_gpt2.GPT2LMHeadModel,), {"forward": g["forward"]})


def _model(cls=None):
    cfg = transformers.GPT2Config(**_GPT2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = (cls or transformers.GPT2LMHeadModel)(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.train()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _fused(model) -> bool:
    rep = slimgrad.report(model)
    return any(a.endswith(".forward") and "loss" in w for _, a, w in rep.converted)


def _skip_reason(model) -> str:
    rep = slimgrad.report(model)
    return next(r for _, a, r in rep.skipped if a.endswith(".forward"))


def _convert(model):
    # refusals of a class slimgrad does not claim are not warned about; a variant is not claimed
    return slimgrad.convert_(model, slimgrad.ConvertConfig(dropout=False))


def _run(model, **kw):
    """(output, loss, grads, [(category, message)] of the warnings) of one training call."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(**kw)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
    return out, out.loss.detach(), grads, [(w.category, str(w.message)) for w in seen]


def _same_call(eager, conv, **kw):
    ref = copy.deepcopy(eager).double()
    out_e, loss_e, g_e, warn_e = _run(eager, **kw)
    _, loss_r, g_r, _ = _run(ref, **kw)
    out_c, loss_c, g_c, warn_c = _run(conv, **kw)
    assert out_e.logits is not None and out_c.logits is None  # the fused loss ran
    atol = 4 * torch.finfo(torch.float32).eps * abs(loss_r.item())
    assert_within_rule(loss_c, loss_r, loss_e, atol=atol, names=["loss"])
    assert_within_rule(g_c, g_r, g_e, names=[n for n, _ in eager.named_parameters()])
    assert warn_c == warn_e  # HF's deprecation warning, word for word, once
    return warn_c


# ------------------------------------------------------------------------------ the table


@pytest.mark.parametrize("name", sorted(hf_glue.KNOWN_DECORATORS))
def test_table_names_transformers_own_object(name):
    modname, kind = hf_glue.KNOWN_DECORATORS[name]
    obj, got_kind, code = hf_glue._known_decorators()[name]
    assert obj is getattr(sys.modules[modname], name)
    assert got_kind == kind
    assert (code is None) == (kind == "doc")  # a doc decorator adds no wrapper layer


@pytest.mark.parametrize("name", sorted(hf_glue.KNOWN_DECORATORS))
def test_look_alike_of_a_known_decorator_is_refused_naming_it(name):
    def same_name(*a, **k):  # what a look-alike might do: nothing visible
        if a and callable(a[0]) and not k:
            return a[0]
        return lambda f: f

    args = '("labels_old", "99.0", new_name="labels")' if name == "deprecate_kwarg" else ""
    lines = ["@can_return_tuple", "@auto_docstring", f"@{name}{args}"]
    if name != "deprecate_kwarg":
        lines = lines[:2]
    cls = _variant(lines, {name: same_name})
    model = _convert(_model(cls))
    assert not _fused(model)
    why = _skip_reason(model)
    assert f"is not transformers' {name}" in why, why


def test_auto_docstring_and_can_return_tuple_as_hf_has_them_fuse():
    # the forward of HF's own source and decorators (5.23's GPT-2 form), compiled anew: it fuses,
    # and return_dict=False (can_return_tuple) gives HF's tuple
    cls = _variant(["@can_return_tuple", "@auto_docstring"], {})
    eager = _model(cls)
    conv = _convert(copy.deepcopy(eager))
    assert _fused(conv), str(slimgrad.report(conv))
    ids, labels = _inputs()
    _same_call(eager, conv, input_ids=ids, labels=labels)
    conv_kl = slimgrad.convert_(copy.deepcopy(eager), slimgrad.ConvertConfig(keep_logits=True))
    t_e, t_c = (
        eager(ids, labels=labels, return_dict=False),
        conv_kl(ids, labels=labels, return_dict=False),
    )
    assert isinstance(t_c, tuple) and len(t_c) == len(t_e)
    torch.testing.assert_close(t_c[0], t_e[0])


def test_forward_without_can_return_tuple_is_refused():
    model = _convert(_model(_variant(["@auto_docstring"], {})))
    assert not _fused(model)
    assert "@can_return_tuple" in _skip_reason(model)


def test_deprecate_kwarg_renamed_labels_behave_as_hf():
    # deprecate_kwarg renames before the call: the converted forward renames the same way (HF's
    # decorator around the fused call), so labels passed under the old name are fused, and the
    # warnings are HF's own
    deco = '@deprecate_kwarg("labels_old", "99.0", new_name="labels")'
    dep = {"deprecate_kwarg": transformers.utils.deprecation.deprecate_kwarg}
    for lines in (
        ["@can_return_tuple", "@auto_docstring", deco],  # 5.24's order
        [deco, "@can_return_tuple", "@auto_docstring"],  # the other order HF uses
    ):
        eager = _model(_variant(lines, dep))
        conv = _convert(copy.deepcopy(eager))
        assert _fused(conv), str(slimgrad.report(conv))
        ids, labels = _inputs()
        seen = _same_call(eager, conv, input_ids=ids, labels_old=labels)
        assert any("labels_old" in m for _, m in seen), seen
        # both names: HF keeps the new one and always warns
        bad = torch.full_like(labels, 5)
        seen = _same_call(eager, conv, input_ids=ids, labels=labels, labels_old=bad)
        assert any("Both" in m for _, m in seen), seen
        _same_call(eager, conv, input_ids=ids, labels=labels)  # no old name: no warning


def test_deprecate_kwarg_that_raises_raises_as_hf():
    deco = '@deprecate_kwarg("labels_old", "0.1", new_name="labels", raise_if_both_names=True)'
    dep = {"deprecate_kwarg": transformers.utils.deprecation.deprecate_kwarg}
    eager = _model(_variant(["@can_return_tuple", "@auto_docstring", deco], dep))
    conv = _convert(copy.deepcopy(eager))
    assert _fused(conv)
    ids, labels = _inputs()
    errors = []
    for m in (eager, conv):
        with pytest.raises(ValueError) as e:
            m(input_ids=ids, labels=labels, labels_old=labels)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_installed_hf_forward_with_deprecated_kwarg_behaves_as_hf():
    # transformers 5.24 renamed past_key_values to cache with @deprecate_kwarg on the LM forwards;
    # 5.23 has no such decorator there (then the call is an ordinary one)
    eager = _model()
    conv = slimgrad.convert_(copy.deepcopy(eager))
    assert _fused(conv), str(slimgrad.report(conv))
    ids, labels = _inputs()
    _same_call(eager, conv, input_ids=ids, labels=labels, past_key_values=None)


def test_unknown_decorator_is_refused_naming_it():
    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            return fn(*a, **k)

        return wrapper

    cls = _variant(["@can_return_tuple", "@logged", "@auto_docstring"], {"logged": logged})
    model = _convert(_model(cls))
    assert not _fused(model)
    why = _skip_reason(model)
    assert "@logged" in why and "not one known" in why, why


def test_wrapper_added_at_run_time_is_refused():
    base = _variant(["@can_return_tuple", "@auto_docstring"], {})

    def doubled(fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            out = fn(*a, **k)
            out.loss = out.loss * 2
            return out

        return wrapper

    cls = type("Patched", (base,), {"forward": doubled(base.forward)})
    eager = _model(cls)
    conv = _convert(copy.deepcopy(eager))
    assert not _fused(conv)
    assert "wrapper layers at run time" in _skip_reason(conv)
    ids, labels = _inputs()
    torch.testing.assert_close(conv(ids, labels=labels).loss, eager(ids, labels=labels).loss)


def test_changed_computation_is_refused():
    def edit(src):  # one more loss term: the computation changed
        return src.replace("    return CausalLM", "    loss = loss * 2\n    return CausalLM", 1)

    cls = _variant(["@can_return_tuple", "@auto_docstring"], {}, edit)
    assert "loss = loss * 2" in inspect.getsource(inspect.unwrap(cls.forward))
    model = _convert(_model(cls))
    assert not _fused(model)
    assert "not a known LM template" in _skip_reason(model)


# ------------------------------------------------------------------ a refused known family


def _slimgrad_warnings(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [w for w in seen if str(w.message).startswith("slimgrad.convert_")]


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        return fn(*a, **k)

    return wrapper


def _claim(monkeypatch, cls, *techniques):
    key = f"{cls.__module__}.{cls.__qualname__}"
    monkeypatch.setitem(hf_glue.CLAIMED, key, frozenset(techniques))


def test_refused_known_family_warns_once_with_class_technique_and_reason(monkeypatch):
    cls = _variant(["@can_return_tuple", "@logged", "@auto_docstring"], {"logged": _logged})
    model = _model(cls)
    assert _slimgrad_warnings(lambda: _convert(copy.deepcopy(model))) == []  # not claimed
    _claim(monkeypatch, cls, "fused_loss")
    seen = _slimgrad_warnings(lambda: _convert(model))
    assert len(seen) == 1 and seen[0].category is UserWarning
    msg = str(seen[0].message)
    assert "GPT2Variant" in msg and "fused LM-head loss" in msg, msg
    assert "@logged" in msg and "slimgrad env" in msg and "file an issue" in msg, msg
    assert seen[0].filename == __file__  # points at the caller of convert_
    assert slimgrad.report(model).refused_known == [
        ("GPT2Variant", "fused_loss", _skip_reason(model).removeprefix("fused loss: "))
    ]


def test_both_techniques_refused_give_one_warning(monkeypatch):
    # HF's GPT-2 as a release slimgrad does not follow might look: a decorator slimgrad does not
    # know (auto_docstring taken out of the table) and attention source it cannot read
    from slimgrad.convert_handlers import hf_attention

    table = {k: v for k, v in hf_glue.KNOWN_DECORATORS.items() if k != "auto_docstring"}
    monkeypatch.setattr(hf_glue, "KNOWN_DECORATORS", table)
    hf_glue._known_decorators.cache_clear()
    monkeypatch.setattr(hf_loss, "_CACHE", {})
    monkeypatch.setattr(hf_attention, "_file_tree", lambda modname: None)
    try:
        model = _model()
        model.config._attn_implementation = "sdpa"
        seen = _slimgrad_warnings(lambda: slimgrad.convert_(model))
    finally:
        hf_glue._known_decorators.cache_clear()
    assert len(seen) == 1
    msg = str(seen[0].message)
    # without the source no class is seen dispatching through the AttentionInterface
    assert "slimgrad attention for 'sdpa'" in msg and "no module dispatches" in msg, msg
    assert "fused LM-head loss" in msg and "@auto_docstring" in msg, msg
    assert "GPT2LMHeadModel" in msg, msg


def test_instance_settings_refusals_of_a_known_family_stay_quiet():
    # a claimed class refused for the instance's own settings: the report says why, no warning
    model = _model()
    model.lm_head.register_forward_hook(lambda *a: None)
    model.config._attn_implementation = "eager"
    model.config.output_attentions = True
    assert _slimgrad_warnings(lambda: slimgrad.convert_(model)) == []
    rep = slimgrad.report(model)
    assert rep.refused_known == []
    assert "has hooks" in _skip_reason(model)
    assert any("output_attentions" in r for _, _, r in rep.skipped), str(rep)


def test_known_families_convert_quietly():
    for cls in (transformers.GPT2LMHeadModel, transformers.LlamaForCausalLM):
        key = f"{cls.__module__}.{cls.__qualname__}"
        assert {"fused_loss", "attention"} <= hf_glue.CLAIMED[key]
    for impl in ("sdpa", "eager"):  # GPT-2 with "eager": attention refused, not claimed
        model = _model()
        model.config._attn_implementation = impl
        assert _slimgrad_warnings(lambda m=model: slimgrad.convert_(m)) == []
        assert _fused(model)
