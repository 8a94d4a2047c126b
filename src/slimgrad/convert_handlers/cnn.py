"""convert_ handlers for CNNs: swap module *instances* (never classes) for slimgrad's lean ones.

Each handler takes a torch module and returns the slimgrad module that replaces it, sharing its
Parameters, buffers and hooks. Conv → slimgrad conv (selective saving); BatchNorm → slimgrad
BatchNorm (registers its output); ReLU/GELU/SiLU/LeakyReLU/ELU/Hardswish → the ``*AfterNorm``
modules, which are plain activations except right after a slimgrad
BatchNorm, where the pair keeps one full-size tensor (NOTE [Derived saved inputs] in
``slimgrad/ops/_derived.py``). Swapping all three is what gives the saving; any subset stays exact.
"""

from __future__ import annotations

from torch import nn

from slimgrad import ownership
from slimgrad.convert_handlers import accelerate_hooks as _accelerate_hooks
from slimgrad.convert_handlers import inplace_guard as _inplace_guard
from slimgrad.convert_handlers.abn import inplace_abn_pattern
from slimgrad.convert_handlers.decision import Decision, Structure
from slimgrad.convert_handlers.timm import LayerNorm2d as _LayerNorm2d
from slimgrad.nn import batch_norm as _bn
from slimgrad.nn import conv as _conv
from slimgrad.nn import hardswish as _hardswish
from slimgrad.nn import squeeze_excite as _se
from slimgrad.nn.inplace_abn import share_hooks

__all__ = ["HANDLERS", "TABLE", "bn_act_pattern", "convert_cnn_", "inplace_abn_pattern"]


def _handler(cls):
    def convert(module: nn.Module) -> nn.Module:
        return cls.from_torch(module)

    convert.__name__ = f"convert_{cls.__name__}"
    convert.__doc__ = f"Replace a torch module by slimgrad's {cls.__name__} sharing its Parameters."
    return convert


convert_conv1d = _handler(_conv.Conv1d)
convert_conv2d = _handler(_conv.Conv2d)
convert_conv3d = _handler(_conv.Conv3d)
convert_conv_transpose1d = _handler(_conv.ConvTranspose1d)
convert_conv_transpose2d = _handler(_conv.ConvTranspose2d)
convert_conv_transpose3d = _handler(_conv.ConvTranspose3d)
convert_batch_norm1d = _handler(_bn.BatchNorm1d)
convert_batch_norm2d = _handler(_bn.BatchNorm2d)
convert_batch_norm3d = _handler(_bn.BatchNorm3d)
convert_relu = _handler(_bn.ReLUAfterNorm)
convert_gelu = _handler(_bn.GELUAfterNorm)
convert_silu = _handler(_bn.SiLUAfterNorm)
convert_leaky_relu = _handler(_bn.LeakyReLUAfterNorm)
convert_elu = _handler(_bn.ELUAfterNorm)
convert_hardswish = _handler(_hardswish.HardswishAfterNorm)

#: {torch type: handler}; exact types only (a subclass may override forward).
HANDLERS = {
    nn.Conv1d: convert_conv1d,
    nn.Conv2d: convert_conv2d,
    nn.Conv3d: convert_conv3d,
    nn.ConvTranspose1d: convert_conv_transpose1d,
    nn.ConvTranspose2d: convert_conv_transpose2d,
    nn.ConvTranspose3d: convert_conv_transpose3d,
    nn.BatchNorm1d: convert_batch_norm1d,
    nn.BatchNorm2d: convert_batch_norm2d,
    nn.BatchNorm3d: convert_batch_norm3d,
    nn.ReLU: convert_relu,
    nn.GELU: convert_gelu,
    nn.SiLU: convert_silu,
    nn.LeakyReLU: convert_leaky_relu,
    nn.ELU: convert_elu,
    nn.Hardswish: convert_hardswish,
}


_ACT_AFTER_NORM = {
    nn.ReLU: convert_relu,
    nn.GELU: convert_gelu,
    nn.SiLU: convert_silu,
    nn.LeakyReLU: convert_leaky_relu,
    nn.ELU: convert_elu,
    nn.Hardswish: convert_hardswish,
}
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_TIMM_BN_ACT = "timm.layers.norm_act.BatchNormAct2d"  # by name: timm is never imported

#: Entries for ``slimgrad.convert._TABLE``: {qualified class name: (ConvertConfig field, handler)}.
#: Activations are not here: they are swapped by :func:`bn_act_pattern` only where a BatchNorm sits
#: next to them, so the activation table keeps every other ReLU/GELU/SiLU/LeakyReLU/ELU.
TABLE = {
    f"{cls.__module__}.{cls.__qualname__}": (
        "batch_norm" if issubclass(cls, _BN_TYPES) else "linear",
        h,
    )
    for cls, h in HANDLERS.items()
    if cls not in _ACT_AFTER_NORM
}


def convert_squeeze_excitation(module: nn.Module) -> nn.Module:
    """torchvision ``SqueezeExcitation`` -> :class:`slimgrad.nn.squeeze_excite.SqueezeExcitation`
    (its forward and ``_scale``, the gating by ``slimgrad.ops.squeeze_excite``)."""
    try:
        return _se.SqueezeExcitation.from_torch(module)
    except TypeError as e:  # another forward: the report names it
        raise NotImplementedError(str(e)) from None


_TV_LAYER_NORM2D_FORWARD = "torchvision.models.convnext.LayerNorm2d.forward"


def convert_tv_layer_norm2d(module: nn.Module) -> nn.Module:
    """torchvision ``convnext.LayerNorm2d`` -> :class:`slimgrad.convert_handlers.timm.LayerNorm2d`
    (shared Parameters). Its forward is timm's LayerNorm2d's: ``permute(0, 2, 3, 1)``,
    ``F.layer_norm(x, normalized_shape, weight, bias, eps)``, ``permute(0, 3, 1, 2)`` (checked
    against torchvision 0.28)."""
    fwd = type(module).forward
    if f"{fwd.__module__}.{fwd.__qualname__}" != _TV_LAYER_NORM2D_FORWARD:
        raise NotImplementedError(
            f"forward is {fwd.__module__}.{fwd.__qualname__}; expected {_TV_LAYER_NORM2D_FORWARD}"
        )
    return _LayerNorm2d.from_torch(module)


def frozen_batch_norm(module: nn.Module) -> nn.Module:
    """torchvision ``FrozenBatchNorm2d`` and timm ``FrozenBatchNormAct2d``: left as they are, with
    the reason in the report (their children, e.g. timm's ``act``, still convert)."""
    # their forward is x * scale + shift with scale, shift built from buffers: autograd keeps the
    # (1, C, 1, 1) scale only (x is kept only to differentiate scale, which needs no gradient)
    raise NotImplementedError(
        "frozen BatchNorm (statistics and affine are buffers): eager keeps no full-size tensor "
        "for it (x * scale + shift keeps the per-channel scale only), so there is nothing to "
        "save; left as is"
    )


# by name: torchvision is never imported
TABLE["torchvision.ops.misc.SqueezeExcitation"] = ("activations", convert_squeeze_excitation)
TABLE["torchvision.models.convnext.LayerNorm2d"] = ("norms", convert_tv_layer_norm2d)
TABLE["torchvision.ops.misc.FrozenBatchNorm2d"] = ("batch_norm", frozen_batch_norm)
TABLE["timm.layers.norm_act.FrozenBatchNormAct2d"] = ("batch_norm", frozen_batch_norm)


# NOTE [An activation before a BatchNorm is the table's]
# An ``*AfterNorm`` activation saves only on a slimgrad BatchNorm's pristine output; on any other
# input it runs eager's op and keeps x. ``Sequential(conv, Hardswish, bn)`` (MobileNetV3's
# conv -> act -> BN order) shares a parent with a BatchNorm but never takes its output: claimed
# here it kept eager's bytes, where the table's module keeps y, which the BatchNorm keeps anyway
# (NOTE [A BatchNorm consumer keeps y] in nn/_output_act.py). In a plain
# ``nn.Sequential`` the child before the activation (past ``nn.Identity``, which returns its
# input, and the Dropouts, which may: in eval or at p = 0; the ``*AfterNorm`` module checks at its
# call that its input is the BatchNorm's untouched output, and runs eager's op on a dropped one)
# states what it is given: the pattern claims it only after a BatchNorm there. In any other
# parent the order is not read, and any child may follow the BatchNorm (torchvision's blocks).
_PASS_THROUGH = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _may_follow_bn(parent: nn.Module, before: list, found: Structure) -> bool:
    if type(parent).forward is not nn.Sequential.forward or not isinstance(parent, nn.Sequential):
        return True
    for _, c in reversed(before):
        if type(c) in _PASS_THROUGH and "forward" not in c.__dict__:
            continue
        return isinstance(found.now(c), _BN_TYPES)
    return False


def bn_act_pattern(model: nn.Module, config, allowed, found: Structure) -> list[Decision]:
    """``convert_`` pattern (technique ``batch_norm``): swap ReLU/GELU/SiLU/LeakyReLU/ELU/Hardswish
    modules that share a parent with a BatchNorm (``Sequential(conv, bn, relu)``, torchvision's
    ResNet blocks, which call ``self.bn1`` then ``self.relu``) for the ``*AfterNorm`` modules. They
    act exactly like torch's on any input, and keep nothing extra after a slimgrad BatchNorm (NOTE
    [Derived saved inputs]). timm's ``BatchNormAct2d`` is a BatchNorm whose own ``act`` child
    follows it (``convert_handlers.timm``): that child is swapped too. Every module keeps its own
    function (slices, hooks, surgery as eager).
    An instance shared by several call sites (torchvision's one ``relu`` per block) is one
    replacement at all of them.

    Returns the decisions (``convert_`` applies them): each replacement, built now with the
    original's hooks, or the filter's refusal. ``found`` is the structure as the earlier patterns
    leave it (a BatchNorm an InPlaceABN pass claimed is no BatchNorm here).
    """
    out: list[Decision] = []
    names = found.names()
    for parent in found.modules():
        kids = list(parent._modules.items())
        if f"{type(parent).__module__}.{type(parent).__qualname__}" == _TIMM_BN_ACT:
            kids = [(n, c) for n, c in kids if n == "act"]  # BN itself, then drop, then act
        elif not any(isinstance(found.now(c), _BN_TYPES) for _, c in kids if c is not None):
            continue
        for i, (name, child) in enumerate(kids):
            if child is None or id(child) in found.claimed:
                continue  # decided by an earlier pattern, or here at another place
            h = _ACT_AFTER_NORM.get(type(child))
            if h is None or not _may_follow_bn(parent, kids[:i], found):
                continue
            if _accelerate_hooks.patched(child):
                continue  # a forward set on the instance: the table's rule reports it
            fqn = names.get(id(child), name)
            if not allowed(child, fqn):  # the table pass tells it too, as for any module
                out.append(Decision(fqn, parent, name, child, reason="filter_fn returned False"))
                continue
            if isinstance(child, nn.ReLU) and _inplace_guard.kept_reason(child) is not None:
                # NOTE [A write after a BatchNorm output was claimed] in inplace_guard.py: torch's
                # ReLU stays (the table pass reports why). Another activation the guard keeps for
                # a write over its own output still converts here: its after-norm form keeps b,
                # not its output, so that write reads nothing it kept
                continue
            new = h(child)
            share_hooks(child, new)  # a handle taken before convert_ still removes its hook
            # the copied accelerate wrapper runs the original: bound to the replacement instead
            _accelerate_hooks.carry(child, new)  # NOTE [A replacement carries accelerate's hook]
            out += found.swap(fqn, child, new)
    return out


def convert_cnn_(model: nn.Module) -> nn.Module:
    """Swap, in place, every module of ``model`` whose exact type is in :data:`HANDLERS`.

    A stand-in for ``slimgrad.convert_`` restricted to this table (tests, benchmarks). A module
    instance used at several places (torchvision's shared ``relu``) is converted once.

    Returns:
        ``model`` (converted in place; a top-level module of a handled type is returned converted).
    """
    done: dict[int, nn.Module] = {}

    def swap(m: nn.Module) -> nn.Module:
        h = HANDLERS.get(type(m))
        if h is None:
            return m
        if id(m) not in done:
            done[id(m)] = h(m)
        return done[id(m)]

    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None:
                parent._modules[name] = swap(child)
    model = swap(model)
    ownership.state_inputs_(model)  # NOTE [Forward ownership from stated structure]
    return model
