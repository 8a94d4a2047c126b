"""What ``convert_`` decides for one place or one model, before anything is changed (``Decision``),
and the model's structure as the neighbour patterns read it (``Structure``).

The table pass and the neighbour patterns (``slimgrad.convert._PATTERNS``) both decide into
``Decision``s; ``slimgrad.convert.apply`` then makes every change and ``slimgrad.convert.record``
writes the report's rows (the stages in ``slimgrad/convert.py``'s docstring).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["Decision", "Structure"]


@dataclass(eq=False)
class Decision:
    """One decision: a module replaced at ``parent.<attr>``, a module changed where it stands
    (``patch``), or why a module stays (``reason``).

    Attributes:
        name: the module's qualified name (the report's first column).
        parent: the module that holds it; None for a decision about the module where it stands.
        attr: its attribute in ``parent``.
        module: the module decided about.
        new: its replacement (the module is converted), else None.
        reason: why it stays, else None.
        repeat: another place of a module decided earlier: it takes the same replacement and
            adds no report row.
        kind: the report's second column when it is not ``type(module).__name__`` (e.g.
            ``"GPT2LMHeadModel.forward"``, ``"BatchNorm2d+ReLU"``).
        to: the report's third column when it is not ``type(new).__name__``.
        patch: what ``apply`` calls to change ``module`` where it stands (an instance's forward,
            its configs); it returns the report rows it adds (name, from, to) after this one.
        carry_hooks: ``apply`` hands the original's hooks to ``new`` (the table's replacements);
            False where the pattern's replacement took them over when it was built.
        refusal: ``(technique, reason)`` for ``slimgrad.convert_handlers.hf.note_refusal`` (a
            refused family slimgrad claims warns once).
    """

    name: str
    parent: nn.Module | None
    attr: str | None
    module: nn.Module
    new: nn.Module | None = None
    reason: str | None = None
    repeat: bool = False
    kind: str | None = None
    to: str | None = None
    patch: Callable[[], list[tuple[str, str, str]]] | None = None
    carry_hooks: bool = True
    refusal: tuple[str, object] | None = None
    # rows ``patch`` added when ``apply`` ran it (``record`` writes them after this one's)
    added: list[tuple[str, str, str]] = field(default_factory=list, repr=False)


class Structure:
    """The module tree as the neighbour patterns read it, each reading done once: names, the
    places that hold each module, and the replacements earlier patterns decided (``claimed``),
    so a later pattern sees the model as the earlier ones leave it without anything swapped.

    Attributes:
        model: the model.
        targets: the (device type, dtype or None) pairs the device rule decides for.
        claimed: ``{id(original): replacement}`` decided by the patterns so far.
    """

    def __init__(self, model: nn.Module, targets: tuple = (("cpu", None),)) -> None:
        self.model = model
        self.targets = targets
        self.claimed: dict[int, nn.Module] = {}
        self._traces = None
        self._names: dict[int, str] | None = None
        self._places: dict[int, list[tuple[nn.Module, str]]] | None = None
        self._modules: list[nn.Module] | None = None

    def modules(self) -> list[nn.Module]:
        """``model.modules()`` (each module once), read once."""
        if self._modules is None:
            self._modules = list(self.model.modules())
        return self._modules

    def names(self) -> dict[int, str]:
        """``{id(module): its first qualified name}`` (``named_modules()``'s)."""
        if self._names is None:
            self._names = {id(m): n for n, m in self.model.named_modules()}
        return self._names

    def places(self) -> dict[int, list[tuple[nn.Module, str]]]:
        """``{id(module): [(parent, attr), ...]}``: every place that holds a module."""
        if self._places is None:
            places: dict[int, list[tuple[nn.Module, str]]] = {}
            for parent in self.modules():
                for attr, child in parent._modules.items():
                    if child is not None:
                        places.setdefault(id(child), []).append((parent, attr))
            self._places = places
        return self._places

    @property
    def traces(self):
        """The fx traces of the model's forwards, each module traced once for the whole
        ``convert_`` call (``slimgrad.convert_handlers.inplace_guard.Traces``; NOTE [One reading
        of the structure per convert_])."""
        if self._traces is None:
            from slimgrad.convert_handlers.inplace_guard import Traces  # (it imports the HF table)

            self._traces = Traces()
        return self._traces

    def now(self, m: nn.Module) -> nn.Module:
        """``m`` as the patterns decided so far leave it (its replacement, or itself)."""
        return self.claimed.get(id(m), m)

    def swap(self, name: str, module: nn.Module, new: nn.Module, **row) -> list[Decision]:
        """Decisions replacing ``module`` by ``new`` at every place that holds it: the first
        writes the report row (``row``: ``kind``/``to``), the others repeat it. The replacement
        took over the hooks when it was built. ``module`` is then claimed."""
        self.claimed[id(module)] = new
        out = []
        for i, (parent, attr) in enumerate(self.places().get(id(module), [])):
            out.append(
                Decision(name, parent, attr, module, new=new, repeat=i > 0, carry_hooks=False)
            )
            if i == 0:
                out[0].kind, out[0].to = row.get("kind"), row.get("to")
        return out


class InstanceForward:
    """Base of the ``forward`` objects a patch puts on one module instance (GPT-2's attention and
    block forwards): kept on the instance as a plain picklable object holding the module, with the
    signature of the class's own ``forward``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def __signature__(self):
        return inspect.signature(type(self.module).forward.__get__(self.module))

    @property
    def __code__(self):
        # what non-strict torch.export reads of the exported module's forward (NOTE [The fused
        # loss under torch.export] in hf_loss.py)
        return type(self.module).forward.__code__
