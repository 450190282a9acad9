"""What every gradient method shares: the model (its eager module) and an optional layer, resolved once."""

from __future__ import annotations

from torch import nn

from hooks import resolve

from .._run import eager_module


class GradientMethod:
    """A gradient attribution method built with a model and, for the layer variants, one layer.

    Args:
        model: the network.
        layer: ``None`` for attributions at the input, or a module (its name, or the module) whose output the
            attributions are given at.
    """

    def __init__(self, model: nn.Module, *, layer: str | nn.Module | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        self.model = eager_module(model)  # torch.compile(model): its module, run eagerly (hooks need that)
        self.layer: str | None = None
        if layer is not None:
            found = resolve(self.model, layer, what="`layer`")
            if len(found) != 1:
                names = [name for name, _ in found]
                raise ValueError(f"`layer` must name one module; {layer!r} matched {len(found)}: {names[:6]}")
            self.layer = found[0][0]

    def __repr__(self) -> str:
        where = "" if self.layer is None else f", layer={self.layer!r}"
        return f"{type(self).__name__}({type(self.model).__name__}{where})"
