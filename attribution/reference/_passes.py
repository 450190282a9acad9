"""The runs of the reference methods, each one :class:`attribution._run.HookedRun`: gradients and score gains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks import map_tensors

from .._run import HookedRun, SiteTypeError, SiteValueError, did_not_run, no_dependence, warn
from ..targets import Target, class_indices, class_logits, target_indices, target_scores
from ._wiring import Wiring, plan


@dataclass
class Pass:
    """The (rule-modified) gradient of the target scores at the inputs, and ``S(x) - S(r)`` per item (detached)."""

    grad: torch.Tensor
    gain: torch.Tensor


def deeplift_pass(
    model: nn.Module,
    method: str,
    x: torch.Tensor,
    ref: torch.Tensor,
    target: Target,
    eps: float,
    *,
    layer: str | None = None,
) -> Pass:
    """One forward of ``[x; ref]`` with DeepLIFT's rules and one backward from the inputs' target scores.

    With ``layer``, ``target`` scores that module's output (a callable ``layer_output -> (batch,)``) instead of the
    model's output.
    """
    batch = x.shape[0]
    planned = plan(model, eps)
    with HookedRun(model, method, with_grad=True) as run:
        Wiring(run.group, planned, batch)
        seen: list[torch.Tensor] = []
        if layer is not None:  # registered after the rules: a layer with a rule is read with its rule applied

            def keep(module: nn.Module, args: Any, out: Any, *, name: str, call: int) -> None:
                seen.append(layer_output(out, name, call))

            run.group.forward(layer, keep)
        leaf = run.leaf(x)
        output = run.forward(torch.cat([leaf, ref]))
        if layer is not None:
            if not seen:
                raise did_not_run("`layer`", layer)
            output = seen[0]
        out_x, out_r = halves(output, batch)
        target = resolved(target, out_x, batch)
        scores = target_scores(out_x, target, batch)
        (grad,) = run.gradients(scores, [leaf], "`inputs`", ["inputs"])
        if grad is None:
            raise no_dependence("`inputs`", "inputs", scores, checkpointed=run.checkpointed)
        gain = scores.detach() - target_scores(out_r, target, batch).detach()
    return Pass(grad, gain)


def layer_output(output: Any, name: str, call: int) -> torch.Tensor:
    """A layer's output, checked: one floating-point tensor, from the layer's only call in the forward."""
    if call > 0:
        raise SiteValueError(f"`layer` {name!r} ran more than once in one forward; choose a module that runs once")
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        got = f"{output.dtype} tensor" if isinstance(output, torch.Tensor) else type(output).__name__
        raise SiteTypeError(f"`layer` {name!r} returned a {got}; name a submodule that returns a float tensor")
    return output


def gradient_pass(model: nn.Module, method: str, x: torch.Tensor, target: Target) -> torch.Tensor:
    """The ordinary gradient of the target scores at ``x``: one forward and one backward."""
    with HookedRun(model, method, with_grad=True) as run:
        leaf = run.leaf(x)
        output = run.forward(leaf)
        scores = target_scores(output, target, x.shape[0])
        (grad,) = run.gradients(scores, [leaf], "`inputs`", ["inputs"])
    if grad is None:
        raise no_dependence("`inputs`", "inputs", scores)
    return grad


def outputs(model: nn.Module, method: str, x: torch.Tensor) -> Any:
    """The model's output for ``x``, without autograd."""
    with HookedRun(model, method) as run:
        return run.forward(x)


def halves(output: Any, batch: int) -> tuple[Any, Any]:
    """The outputs of the first ``batch`` items and of the rest: every tensor of ``output`` split on its first axis."""

    def first(t: torch.Tensor) -> torch.Tensor:
        return t[:batch] if t.dim() > 0 and t.shape[0] == 2 * batch else t

    def second(t: torch.Tensor) -> torch.Tensor:
        return t[batch:] if t.dim() > 0 and t.shape[0] == 2 * batch else t

    return map_tensors(first, output), map_tensors(second, output)


def resolved(target: Target, output: Any, batch: int) -> Target:
    """``target`` with ``None`` replaced by each item's top class in ``output``; callables stay as they are."""
    if callable(target):
        return target
    return class_indices(class_logits(output), target, batch)


def repeated(target: Target, times: int) -> Target:
    """The target of a batch where each item is repeated ``times`` times in a row (item-major)."""
    if target is None or callable(target):
        return target
    index = target_indices(target, "`target`")
    assert index is not None
    return index if index.dim() == 0 else index.repeat_interleave(times)


def checked(attributions: torch.Tensor, method: str) -> torch.Tensor:
    """Warn, naming the items, when attributions hold NaN or inf (kept as they are, never averaged away)."""
    bad = (~torch.isfinite(attributions)).flatten(1).any(1).nonzero().flatten().tolist()
    if bad:
        shown = f"item {bad[0]}" if len(bad) == 1 else f"items {bad[:8]}" + ("..." if len(bad) > 8 else "")
        warn(
            f"{method}: the attributions of {shown} hold NaN or inf: the inputs, the model's output or its gradient "
            "are not finite there (check torch.isfinite(inputs).all(), and run the model in float32 or float64)"
        )
    return attributions
