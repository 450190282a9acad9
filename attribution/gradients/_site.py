"""The one backward of every gradient method: the gradient of the target scores at the input or at a layer.

:func:`site_gradient` runs the model once through :class:`attribution._run.HookedRun` (state kept, one hook group,
removed on exit, also on errors and ``KeyboardInterrupt``) and takes ``d sum(scores) / d site`` by
``torch.autograd.grad``, so nothing accumulates into ``.grad``. The site is the model's input (a root forward
pre-hook makes it the graph's leaf) or a layer's output (a forward hook makes it the leaf, or puts a given tensor in
its place: Integrated Gradients at a layer). ``setup`` registers more hooks in the same group (Guided Backprop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks import HookGroup

from .._results import AttributionsWithDelta
from .._run import HookedRun, SiteTypeError, SiteValueError, did_not_run, no_dependence, warn
from ..targets import Target, class_indices, class_logits, target_indices, target_scores


@dataclass
class SiteGradient:
    """The site's tensor (detached) and the gradient of the summed target scores there."""

    value: torch.Tensor
    grad: torch.Tensor


def site_gradient(
    model: nn.Module,
    method: str,
    inputs: torch.Tensor,
    target: Target,
    *,
    layer: str | None = None,
    value: torch.Tensor | None = None,
    setup: Callable[[HookGroup], None] | None = None,
) -> SiteGradient:
    """One forward and backward: the gradient of the ``target`` scores at the input, or at ``layer``'s output.

    With ``value``, the layer's output is replaced by ``value`` (same shape) and the gradient is taken there.
    """
    leaves: list[torch.Tensor] = []
    with HookedRun(model, method, with_grad=True) as run:
        if setup is not None:
            setup(run.group)
        if layer is None:

            def start(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                leaf = run.leaf(args[0])
                leaves.append(leaf)
                return (leaf, *args[1:])

            run.group.forward_pre("", start)
        else:

            def at_layer(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> torch.Tensor:
                tensor = layer_tensor(output, name, call)
                if value is not None and value.shape != tensor.shape:
                    raise SiteValueError(f"the output of {name!r} is {tuple(tensor.shape)}, not {tuple(value.shape)}")
                leaf = run.leaf(tensor if value is None else value)
                leaves.append(leaf)
                return leaf.clone()  # what runs on is a copy: an in-place operation next must not touch the leaf

            run.group.forward(layer, at_layer)
        output = run.forward(inputs)
        if not leaves:
            raise did_not_run("`layer`", layer or "")
        scores = target_scores(output, target, inputs.shape[0])
        what, where = ("`inputs`", "inputs") if layer is None else ("`layer`", layer)
        (grad,) = run.gradients(scores, leaves, what, [where])
        if grad is None:
            raise no_dependence(what, where, scores, checkpointed=run.checkpointed)
        return SiteGradient(leaves[0].detach(), grad)


def layer_tensor(output: Any, name: str, call: int) -> torch.Tensor:
    """A layer's output, checked: one floating-point tensor, from the layer's only call in the forward."""
    if call > 0:
        raise SiteValueError(
            f"`layer` {name!r} ran more than once in one forward; its output is not one site. Choose a module that "
            "runs once (see hooks.trace(model, inputs))"
        )
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        got = f"{output.dtype} tensor" if isinstance(output, torch.Tensor) else type(output).__name__
        raise SiteTypeError(
            f"`layer` {name!r} returned a {got}; gradient methods need a floating-point tensor output: name a "
            "submodule that returns one"
        )
    return output


def layer_outputs(model: nn.Module, method: str, inputs: torch.Tensor, layer: str | None) -> tuple[Any, torch.Tensor]:
    """One forward without autograd: the model's output and ``layer``'s output (the inputs for ``None``)."""
    seen: list[torch.Tensor] = []
    with HookedRun(model, method) as run:
        if layer is not None:

            def keep(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> None:
                seen.append(layer_tensor(output, name, call).detach().clone())

            run.group.forward(layer, keep)
        output = run.forward(inputs)
    if layer is not None and not seen:
        raise did_not_run("`layer`", layer)
    return output, seen[0] if layer is not None else inputs


def resolved_target(target: Target, output: Any, batch: int) -> Target:
    """``target`` with ``None`` replaced by each item's top class in ``output``; callables stay as they are."""
    if callable(target):
        return target
    return class_indices(class_logits(output), target, batch)


def repeat_target(target: Target, times: int, *, interleave: bool = False) -> Target:
    """The target of a batch of ``times`` copies of the items: copy after copy, or item after item (``interleave``).

    Integer classes (one, or one per item, in any form ``target=`` takes) become an index tensor; ``None`` and
    callables stay as they are.
    """
    if target is None or callable(target):
        return target
    index = target_indices(target, "`target`")
    assert index is not None
    if index.dim() == 0:
        return index
    return index.repeat_interleave(times) if interleave else index.repeat(times)


def with_delta(attributions: torch.Tensor, ends: tuple[Any, Any], target: Target, batch: int) -> AttributionsWithDelta:
    """The attributions and their completeness delta ``sum(attributions) - (S(x) - S(b))`` per item.

    ``ends`` are the model's outputs for the inputs and for the baselines, ``target`` the resolved target.
    """
    gain = target_scores(ends[0], target, batch) - target_scores(ends[1], target, batch)
    per_item = attributions.reshape(batch, -1).sum(1)
    return AttributionsWithDelta(attributions, per_item - gain.to(attributions.dtype))


def check_inputs(inputs: Any, method: str, model: nn.Module, *, layer: str | None) -> torch.Tensor:
    """``inputs`` as the method takes them: a tensor with a batch axis, floating point unless a ``layer`` is named."""
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"{method} takes `inputs` as one tensor (batch, ...); got {type(inputs).__name__}")
    if inputs.dim() == 0:
        raise ValueError("`inputs` must have a batch axis (batch, ...); got a 0-d tensor")
    if layer is None and not inputs.is_floating_point():
        embeddings = [name for name, m in model.named_modules() if isinstance(m, nn.Embedding)]
        hint = f"layer={embeddings[0]!r}" if embeddings else "layer='<the embedding module>'"
        raise TypeError(
            f"`inputs` are {inputs.dtype} (token ids?): gradients need floating-point inputs. Attribute at the "
            f"embedding layer's output instead: {method}(model, {hint}, ...)"
        )
    return inputs


def check_result(attributions: torch.Tensor, method: str) -> torch.Tensor:
    """Warn about NaN attributions and items whose attributions are all zero; return ``attributions``."""
    flat = attributions.reshape(len(attributions), -1)  # also 1-D attributions: a batch of scalars
    if torch.isnan(flat).any():
        warn(
            f"{method}: the attributions contain NaN: the model's output or its gradient is not finite for these "
            "inputs (check the inputs' scale, and run the model in float32 or float64)"
        )
    zero = (flat == 0).all(dim=1).nonzero().flatten().tolist()
    if zero:
        items = f"item {zero[0]}" if len(zero) == 1 else f"items {zero[:8]}" + ("..." if len(zero) > 8 else "")
        warn(
            f"{method}: the attributions of {items} are all zero: the target score's gradient vanishes there (a ReLU "
            "that cut everything, a target the output ignores) or the input equals the baseline. Check the target "
            "and, for Integrated Gradients, the `baseline`"
        )
    return attributions
