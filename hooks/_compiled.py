"""Compiled models: ``torch.compile`` wrappers are hooked through the module they wrap; TorchScript is refused.

A ``torch.compile`` wrapper (``OptimizedModule``) names its modules ``_orig_mod.*``; a manager of the wrapper resolves
names, globs and types against the wrapped module, so ``"layer1"`` and ``"**"`` mean what they mean on the eager
model. Its compiled code runs Python hooks only if they were registered before it was compiled (PyTorch does not
guard on module hooks by default): hooks added later never fire. A forward of the wrapper in which none of the
manager's module hooks ran raises :class:`~hooks.HookError` saying so, rather than recording nothing.

TorchScript modules (``torch.jit.script``, ``torch.jit.trace``) run TorchScript code, which cannot call Python hooks.
"""

from __future__ import annotations

import torch
from torch import nn

from ._errors import HookError


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (the model itself when it is not one)."""
    inner = model
    while type(inner).__name__ == "OptimizedModule":
        wrapped = inner.__dict__.get("_orig_mod", inner._modules.get("_orig_mod"))
        if not isinstance(wrapped, nn.Module):
            break
        inner = wrapped
    return inner


def is_compiled_wrapper(model: nn.Module | None) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper."""
    return model is not None and unwrap_compiled(model) is not model


def check_not_scripted(module: nn.Module, what: str) -> None:
    """Raise a clear error for a TorchScript module, which cannot take Python hooks."""
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"{what} is a TorchScript module ({type(module).__name__}, from torch.jit.script or torch.jit.trace): "
            "scripted and traced modules run TorchScript code, which cannot call Python hooks. Hook the eager "
            "Python module (before scripting or tracing it) and run that, or compile it with torch.compile instead."
        )


def hooks_did_not_run() -> HookError:
    """The error for a forward of a compiled wrapper in which none of the manager's module hooks ran."""
    return HookError(
        "the model is a torch.compile module that was compiled before these hooks were registered: its compiled code "
        "does not run Python hooks added later (PyTorch does not guard on module hooks), so nothing would be "
        "recorded. Register the hooks before the first call of the compiled model (hooked modules then run eagerly, "
        "between graph breaks), call torch.compiler.reset() after registering them (everything is compiled again), "
        "or hook and call the original module `model._orig_mod`."
    )
