"""Weights read outside a forward, wherever they live: the one accessor every method uses.

A model loaded with ``device_map`` (accelerate) may keep a module's parameters on the ``meta`` device outside its
forward (CPU or disk offload): accelerate's hook loads them just before the module runs and releases them after.
A method that reads a weight outside the forward (an unembedding for the lens, an output projection for direct logit
attribution, a norm's gain for an LRP rule) reads it through :func:`weight`, which loads it the way accelerate's own
``align_module_device`` does and hands back a tensor that stays valid after the module's parameters are released.
On a plain model it returns the parameter itself (detached, no copy), so results there are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["execution_device", "has_offloaded_weights", "linear", "weight"]


def has_offloaded_weights(module: nn.Module) -> bool:
    """Whether accelerate offloaded ``module``'s own parameters (its hook loads them for each forward)."""
    hook = getattr(module, "_hf_hook", None)
    return bool(getattr(hook, "offload", False)) and callable(getattr(hook, "pre_forward", None))


def execution_device(module: nn.Module) -> torch.device | None:
    """Where ``module`` computes: accelerate's execution device, else the device of its first real tensor.

    ``None`` for a module without parameters or buffers outside accelerate.

    Example:
        >>> execution_device(torch.nn.Linear(2, 2))
        device(type='cpu')
    """
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, torch.device) else device
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def weight(module: nn.Module, name: str = "weight", *, device: torch.device | None = None) -> torch.Tensor | None:
    """The tensor ``module.<name>`` (a parameter or buffer), detached, with real data; ``None`` when it is unset.

    Where accelerate offloaded the module (the tensor is on ``meta`` outside the forward), the weights are loaded
    for the read by the module's own hook, as ``accelerate.utils.align_module_device`` does, and released after;
    the returned tensor keeps the loaded values. ``device``: move the result there (where the computation that uses
    it happens); by default it stays where it is (the module's execution device when it was offloaded).

    Raises:
        ValueError: the tensor is on ``meta`` and no accelerate hook can load it (a model built on ``meta`` and
            never given its weights).

    Example:
        >>> linear = torch.nn.Linear(3, 2)
        >>> weight(linear) is not None and bool(torch.equal(weight(linear), linear.weight))
        True
        >>> weight(torch.nn.Linear(3, 2, bias=False), "bias") is None
        True
    """
    value = getattr(module, name, None)
    if isinstance(value, torch.Tensor) and value.device.type == "meta" and has_offloaded_weights(module):
        hook: Any = module._hf_hook
        hook.pre_forward(module)
        try:
            value = getattr(module, name, None)
            value = value.detach() if isinstance(value, torch.Tensor) else value
        finally:
            hook.post_forward(module, None)
    if not isinstance(value, torch.Tensor):
        return None
    if value.device.type == "meta":
        raise ValueError(
            f"the {name!r} of {type(module).__name__} is on the meta device and no accelerate hook loads it: the "
            "model was built without its weights; load them (from_pretrained, load_checkpoint_and_dispatch) first"
        )
    value = value.detach()
    return value if device is None else value.to(device)


def linear(module: nn.Module, *, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W, b)`` of a linear layer, ``W`` as ``(out, in)``: an ``nn.Linear``, or GPT-2's ``Conv1D`` transposed.

    Read through :func:`weight`, so offloaded layers give their real weights.

    Raises:
        ValueError: a module without a 2-D ``weight``.

    Example:
        >>> W, b = linear(torch.nn.Linear(3, 2))
        >>> tuple(W.shape), tuple(b.shape)
        ((2, 3), (2,))
    """
    w = weight(module, "weight", device=device)
    if w is None or w.dim() != 2:
        raise ValueError(f"{type(module).__name__} is not a linear layer with a 2-D weight")
    return w.t() if type(module).__name__ == "Conv1D" else w, weight(module, "bias", device=device)
