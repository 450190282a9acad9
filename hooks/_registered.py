"""Which hooks a model carries now, read from PyTorch's hook dicts (attribution asks here, never there)."""

from __future__ import annotations

from torch import nn

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def hooked_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that carry forward, forward-pre or backward hooks now.

    Hooks of every origin count: a :class:`HookManager`'s, TackleBox's, and ``register_*_hook`` calls.

    Example:
        >>> import torch
        >>> from hooks import hooked_modules
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> handle = model[1].register_forward_hook(lambda module, args, output: None)
        >>> hooked_modules(model) == [model[1]]
        True
        >>> handle.remove()
        >>> hooked_modules(model)
        []
    """
    return [m for m in model.modules() if any(getattr(m, attr, None) for attr in _HOOK_DICTS)]


def global_hooks_registered() -> bool:
    """Whether hooks that fire for every module exist (``nn.modules.module.register_module_forward_hook`` and kin).

    Example:
        >>> from hooks import global_hooks_registered
        >>> global_hooks_registered()
        False
    """
    module = nn.modules.module
    return any(getattr(module, attr, None) for attr in _GLOBAL_HOOKS)
