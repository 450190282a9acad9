"""The smallest value of a perturbation's argument that changes a prediction: captum's ``MinParamPerturbation``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._inputs import call
from .._run import kept_state

Correct = Callable[[Any, Any], bool]


def min_perturbation(
    model: nn.Module,
    inputs: Any,
    target: Any,
    *,
    attack: Callable[..., Any],
    arg_name: str,
    arg_min: float,
    arg_max: float,
    arg_step: float,
    mode: str = "linear",
    attempts: int = 1,
    correct: Correct | None = None,
    attack_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, float | None]:
    """The smallest ``attack`` argument in ``[arg_min, arg_max)`` that makes the model's prediction incorrect.

    captum's ``MinParamPerturbation(...).evaluate`` (one perturbation per forward): values ``arg_min, arg_min +
    arg_step, ...`` below ``arg_max`` are tried in order (``"linear"``) or bisected on that grid (``"binary"``,
    which assumes that a larger value never restores the prediction), each ``attempts`` times (for a random
    attack), calling ``attack(inputs, **attack_kwargs, arg_name=value)`` and running the model on the result without
    autograd, in eval mode; the model is left exactly as it was.

    Args:
        model: the network; ``model(perturbed)`` (or ``model(*perturbed)`` for a tuple).
        inputs: what ``attack`` perturbs (a tensor, a tuple of them, or anything ``attack`` takes).
        target: passed to ``correct``; by default the class each item must keep (an int or one per item).
        attack: ``attack(inputs, **attack_kwargs, **{arg_name: value}) -> perturbed inputs``, e.g.
            ``lambda x, epsilon: fgsm(model, x, 0, epsilon=epsilon)``.
        arg_name: the name of the argument searched.
        arg_min: the smallest value tried.
        arg_max: the bound, not tried (as ``range``).
        arg_step: the grid step, > 0.
        mode: ``"linear"`` or ``"binary"``.
        attempts: how many times each value is tried.
        correct: ``correct(output, target) -> bool``, True while the prediction is still correct. Default: every
            item's argmax equals ``target`` (captum's ``default_correct_fn``: a batch counts as flipped as soon as
            one item is).
        attack_kwargs: further keyword arguments of ``attack``.

    Returns:
        ``(perturbed inputs, value)`` for the smallest value found, or ``(None, None)`` when none flips it.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2, bias=False)
        >>> _ = torch.nn.init.eye_(model.weight)
        >>> x = torch.tensor([[1.0, 0.0]])
        >>> shift = lambda x, amount: x + torch.tensor([0.0, 1.0]) * amount
        >>> min_perturbation(model, x, 0, attack=shift, arg_name="amount", arg_min=0, arg_max=3, arg_step=0.25)[1]
        1.25
    """
    _check(arg_min, arg_max, arg_step, mode, attempts)
    judge = correct or _default_correct
    kwargs = dict(attack_kwargs or {})

    def flipped(value: float) -> Any:
        for _ in range(attempts):
            perturbed = attack(inputs, **kwargs, **{arg_name: value})
            with torch.no_grad():
                if not judge(call(model, perturbed), target):
                    return perturbed
        return None

    with kept_state(model):
        if mode == "linear":
            return _linear(flipped, arg_min, arg_max, arg_step)
        return _binary(flipped, arg_min, arg_max, arg_step)


def _grid(start: float, stop: float, step: float) -> Iterator[float]:
    """As captum's ``drange``: ``start, start + step, ...`` (summed, not multiplied) while below ``stop``."""
    value = start
    while value < stop:
        yield value
        value += step


def _linear(flipped: Callable[[float], Any], low: float, high: float, step: float) -> tuple[Any, float | None]:
    for value in _grid(low, high, step):
        perturbed = flipped(value)
        if perturbed is not None:
            return perturbed, value
    return None, None


def _binary(flipped: Callable[[float], Any], low: float, high: float, step: float) -> tuple[Any, float | None]:
    """The bisection of captum on the grid: ``high`` moves down to each value that flips, ``low`` up otherwise."""
    best: tuple[Any, float | None] = (None, None)
    while high > low:
        middle_steps = ((high - low) // step) // 2
        if middle_steps == 0 and low + step < high:
            middle_steps = 1
        middle = low + middle_steps * step
        perturbed = flipped(middle)
        if perturbed is not None:
            high = middle
            if best[1] is None or best[1] > middle:
                best = (perturbed, middle)
        if math.isclose(low, middle):
            break
        if perturbed is None:
            low = middle
    return best


def _default_correct(output: Any, target: Any) -> bool:
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        raise ValueError(
            "the default `correct` needs a (batch, classes) model output; got "
            f"{type(output).__name__}{'' if not isinstance(output, torch.Tensor) else tuple(output.shape)}: pass "
            "`correct(output, target) -> bool`"
        )
    wanted = target if isinstance(target, torch.Tensor) else torch.tensor(target)
    return bool((output.argmax(dim=1) == wanted.to(output.device)).all())


def _check(low: Any, high: Any, step: Any, mode: Any, attempts: Any) -> None:
    for name, value in (("arg_min", low), ("arg_max", high), ("arg_step", step)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"`{name}` must be a finite number; got {value!r}")
    if not step > 0:
        raise ValueError(f"`arg_step` must be > 0 (the grid step); got {step!r}")
    if mode not in ("linear", "binary"):
        raise ValueError(f"`mode` must be 'linear' or 'binary'; got {mode!r}")
    if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
        raise ValueError(f"`attempts` must be an int >= 1; got {attempts!r}")
