"""Uses of a chosen parameter outside its module's call, which hooks cannot see: found, so they are never missed.

``nn.MultiheadAttention`` reads ``out_proj.weight`` itself without calling ``out_proj``; a model may compute logits
as ``hidden @ embed.weight.T``. The hooks of a module see only what happens inside its call, so such a use would be
left out of the parameter's per-example gradient without a word. :class:`OutsideUses` watches the torch functions
called during the forward while no chosen module is running and notes every chosen parameter passed to one whose
result requires grad (reading ``weight.dtype`` or ``weight.detach()`` carries no gradient and is not a use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from hooks import tensors


class OutsideUses(TorchFunctionMode):
    """Chosen parameters passed to a torch function while no chosen module's call is running.

    Args:
        params: ``id(parameter) -> name`` of the parameters to watch.
    """

    def __init__(self, params: dict[int, str]) -> None:
        super().__init__()
        self.params = params
        self.depth = 0  # chosen module calls running
        self.found: dict[str, str] = {}  # parameter name -> the function that used it

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward pre-hook: a chosen module's call starts."""
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A forward hook: a chosen module's call ends."""
        self.depth -= 1

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0:
            used = [self.params[id(v)] for v in (*args, *kwargs.values()) if id(v) in self.params]
            if used and any(t.requires_grad for t in tensors(out)):  # a use that can carry a gradient
                for name in used:
                    self.found.setdefault(name, _function_name(func))
        return out

    def error(self) -> ValueError:
        """The error that names the parameters used outside their modules."""
        uses = ", ".join(f"{name!r} (by {func})" for name, func in list(self.found.items())[:5])
        return ValueError(
            f"parameters of the chosen modules are used outside their modules' calls: {uses}. Hooks see only what a "
            "module does inside its call, so that use would be missing from the per-example gradients (e.g. "
            "nn.MultiheadAttention reads out_proj.weight itself). Leave those modules out with `modules=`"
        )


def _function_name(func: Callable[..., Any]) -> str:
    """A readable name: ``linear``, or ``T`` for the getter of ``Tensor.T``."""
    name = str(getattr(func, "__name__", repr(func)))
    return str(getattr(getattr(func, "__self__", None), "__name__", name)) if name == "__get__" else name
