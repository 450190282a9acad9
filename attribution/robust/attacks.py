"""FGSM and PGD: adversarial inputs that raise the loss of the target (or lower it, towards a targeted class)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._inputs import Tensors, as_given, as_tensors, call, check_inputs, describe
from .._run import kept_state
from ..targets import Target, check_target, class_indices, class_logits, target_indices, target_scores
from ._math import NORMS, project, sign_step
from ._math import random_start as random_point

Loss = Callable[[Any, Any], torch.Tensor]


def fgsm(
    model: nn.Module,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    target: Target = None,
    *,
    epsilon: float,
    targeted: bool = False,
    loss: Loss | None = None,
    lower_bound: float = -math.inf,
    upper_bound: float = math.inf,
    mask: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> Any:
    """Fast Gradient Sign Method (Goodfellow et al., 2015, https://arxiv.org/abs/1412.6572), as captum's ``FGSM``.

    ``x' = clamp(x + epsilon * sign(dL/dx) * mask, lower_bound, upper_bound)`` (``-`` when ``targeted``), where
    ``L`` is the loss of all items summed; entries whose gradient is at most 1e-6 in magnitude stay. One forward and
    one backward, in eval mode; the model is left exactly as it was (no parameter gets a ``.grad``).

    Args:
        model: the network.
        inputs: ``(B, ...)`` floating-point model input, or a tuple of them (``model(*inputs)``).
        target: the class whose loss is raised (untargeted) or lowered (``targeted=True``): ``None`` (each item's
            top class on ``inputs``), an int, one int per item, or a callable ``output -> (B,)`` scores.
        epsilon: the step: how far each input value moves.
        targeted: move towards ``target`` (lower its loss) instead of away from it.
        loss: ``loss(output, target) -> (B,)`` (or a scalar), with ``target`` as a ``(B,)`` class tensor (the
            callable itself for a callable target), e.g. ``torch.nn.CrossEntropyLoss(reduction="none")`` for
            logits. Default: captum's ``-log(score)`` of the target's score, which expects probabilities.
        lower_bound: the smallest value an input may take (e.g. 0 for images in ``[0, 1]``).
        upper_bound: the largest.
        mask: ``1`` where inputs may move, ``0`` where not, broadcastable to ``inputs`` (a tuple for a tuple).

    Returns:
        The perturbed inputs, in the form of ``inputs`` (a tensor or a tuple), detached.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Softmax(dim=1))
        >>> fgsm(model, torch.tensor([[1.0, 2.0, 0.5]]), 1, epsilon=0.1)  # away from class 1
        tensor([[1.1000, 1.9000, 0.6000]])
    """
    parts, single = check_inputs(inputs), isinstance(inputs, torch.Tensor)
    masks = _masks(mask, parts)
    _check_step("epsilon", epsilon)
    check_target(target, parts[0].shape[0])
    with kept_state(model):
        fixed = _fixed_target(model, parts, single, target)
        grads = loss_gradients(model, parts, single, fixed, loss)
        stepped = tuple(
            sign_step(x, g, epsilon, targeted, m).clamp(lower_bound, upper_bound)
            for x, g, m in zip(parts, grads, masks, strict=True)
        )
    return as_given(stepped, single)


def pgd(
    model: nn.Module,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    target: Target = None,
    *,
    epsilon: float,
    step_size: float,
    steps: int,
    norm: str = "Linf",
    random_start: bool = False,
    targeted: bool = False,
    loss: Loss | None = None,
    lower_bound: float = -math.inf,
    upper_bound: float = math.inf,
    mask: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    seed: int = 0,
) -> Any:
    """Projected Gradient Descent (Madry et al., 2018, https://arxiv.org/abs/1706.06083), as captum's ``PGD``.

    ``steps`` FGSM steps of ``step_size`` (sign steps, for both norms, as captum), each followed by the projection
    onto the ball of radius ``epsilon`` around the inputs (``"Linf"``: each value within ``epsilon``; ``"L2"``: each
    item's change rescaled to a 2-norm of at most ``epsilon``) and the clamp to the bounds. With ``random_start``
    the first step starts from a random point of the ball (uniform in it), drawn from a generator seeded with
    ``seed``. ``steps`` forwards and backwards, in eval mode; the model is left exactly as it was.

    Args:
        model: the network.
        inputs: ``(B, ...)`` floating-point model input, or a tuple of them (``model(*inputs)``).
        target: as for :func:`fgsm`; ``None`` is each item's top class on ``inputs``, kept for every step.
        epsilon: the radius of the ball (captum's ``radius``).
        step_size: the step of each FGSM step.
        steps: the number of steps (captum's ``step_num``); 0 returns the start.
        norm: ``"Linf"`` or ``"L2"``.
        random_start: start from a random point of the ball instead of the inputs.
        targeted: move towards ``target`` instead of away from it.
        loss: as for :func:`fgsm`.
        lower_bound: the smallest value an input may take.
        upper_bound: the largest.
        mask: ``1`` where inputs may move, ``0`` where not, broadcastable to ``inputs``.
        seed: seed of the random start (the global random state is not used).

    Returns:
        The perturbed inputs, in the form of ``inputs``, detached.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(dim=1))
        >>> x = torch.randn(2, 4)
        >>> moved = pgd(model, x, 0, epsilon=0.3, step_size=0.1, steps=5, norm="L2")
        >>> bool(((moved - x).norm(dim=1) <= 0.3 + 1e-6).all())
        True
    """
    parts, single = check_inputs(inputs), isinstance(inputs, torch.Tensor)
    masks = _masks(mask, parts)
    _check_pgd(epsilon, step_size, steps, norm)
    check_target(target, parts[0].shape[0])
    generator = torch.Generator(device=parts[0].device).manual_seed(seed)
    with kept_state(model):
        fixed = _fixed_target(model, parts, single, target)
        current = parts
        if random_start:
            current = tuple(
                random_point(x, epsilon, norm, m, generator).clamp(lower_bound, upper_bound)
                for x, m in zip(parts, masks, strict=True)
            )
        for _ in range(steps):
            grads = loss_gradients(model, current, single, fixed, loss)
            current = tuple(
                project(x0, sign_step(x, g, step_size, targeted, m), epsilon, norm).clamp(lower_bound, upper_bound)
                for x0, x, g, m in zip(parts, current, grads, masks, strict=True)
            )
    return as_given(current, single)


def loss_gradients(model: nn.Module, parts: Tensors, single: bool, target: Target, loss: Loss | None) -> Tensors:
    """The gradient of the summed loss with respect to each input tensor (zeros where an input is unused)."""
    leaves = tuple(x.detach().requires_grad_(True) for x in parts)
    with torch.enable_grad():
        output = call(model, as_given(leaves, single))
        losses = _losses(output, target, loss, len(parts[0]))
        grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g.detach() for x, g in zip(parts, grads, strict=True))


def _losses(output: Any, target: Target, loss: Loss | None, batch: int) -> torch.Tensor:
    if loss is None:
        return -torch.log(target_scores(output, target, batch))
    losses = loss(output, target)
    if not isinstance(losses, torch.Tensor) or tuple(losses.shape) not in ((batch,), ()):
        raise ValueError(
            f"`loss` must return the loss of each item ({batch},) or their sum (); got {describe(losses)}: use "
            "reduction='none' for torch.nn losses"
        )
    return losses


def _fixed_target(model: nn.Module, parts: Tensors, single: bool, target: Target) -> Target:
    """Class targets as a ``(B,)`` tensor (``None``: the top classes on the inputs); a callable as it is."""
    if callable(target):
        return target
    batch = parts[0].shape[0]
    if target is None:
        with torch.no_grad():
            return class_indices(class_logits(call(model, as_given(parts, single))), None, batch)
    index = target_indices(target, "`target`")
    assert index is not None
    return index.expand(batch).clone()


def _masks(mask: Any, parts: Tensors) -> tuple[torch.Tensor | float, ...]:
    """One mask per input tensor (``1.0`` everywhere without ``mask``), checked to broadcast to it."""
    if mask is None:
        return (1.0,) * len(parts)
    masks = as_tensors(mask, "`mask`")
    if len(masks) != len(parts):
        raise ValueError(f"`mask` must hold one tensor per input tensor ({len(parts)}); got {describe(mask)}")
    for m, x in zip(masks, parts, strict=True):
        try:
            torch.broadcast_shapes(m.shape, x.shape)
        except RuntimeError:
            raise ValueError(
                f"`mask` of shape {tuple(m.shape)} does not broadcast to the inputs {tuple(x.shape)}: give 1 where "
                "the inputs may move and 0 where not, shaped like them"
            ) from None
    return tuple(m.to(x) for m, x in zip(masks, parts, strict=True))


def _check_step(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"`{name}` must be a number >= 0; got {value!r}")


def _check_pgd(epsilon: Any, step_size: Any, steps: Any, norm: Any) -> None:
    _check_step("epsilon", epsilon)
    _check_step("step_size", step_size)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"`steps` must be an int >= 0; got {steps!r}")
    if norm not in NORMS:
        raise ValueError(f"`norm` must be 'Linf' or 'L2' (captum's spelling); got {norm!r}")
