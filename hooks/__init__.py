"""Managed PyTorch module hooks: named groups, a fixed order, gradients that line up, no leaked hooks.

Example:
    >>> import torch
    >>> from hooks import HookManager
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> with HookManager(model) as mgr:
    ...     g = mgr.group("probe")
    ...     outputs = {}
    ...     _ = g.forward(["0", "2"], lambda module, args, output, *, name: outputs.__setitem__(name, output))
    ...     _ = model(torch.randn(2, 4))
    >>> sorted(outputs)
    ['0', '2']
"""

from ._errors import HookError, ModuleNotFoundInModelError
from ._handle import HookHandle
from ._registered import global_hooks_registered, hooked_modules
from ._resolve import ModuleTarget, module_names, resolve
from ._runs import in_backward
from ._tree import flatten, map_tensors, tensors
from .manager import HookGroup, HookManager
from .recorder import Record, Recorder, Recording
from .trace import ModuleCall, Trace, trace

__all__ = [
    "HookError",
    "HookGroup",
    "HookHandle",
    "HookManager",
    "ModuleCall",
    "ModuleNotFoundInModelError",
    "ModuleTarget",
    "Record",
    "Recorder",
    "Recording",
    "Trace",
    "flatten",
    "global_hooks_registered",
    "hooked_modules",
    "in_backward",
    "map_tensors",
    "module_names",
    "resolve",
    "tensors",
    "trace",
]
