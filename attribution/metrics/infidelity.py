"""Infidelity (Yeh et al., 2019): how well attributions predict the model's change under random perturbations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._inputs import Tensors, as_given, as_tensors, call, check_inputs, describe
from .._maps import at_least_float32
from ..targets import Target, check_target, class_indices, class_logits, target_scores
from ._expand import expand_target, repeat
from ._explanation import attribution_dots, chunk_sizes, infidelity_sums, infidelity_value
from ._scoring import observing

Perturb = Callable[[Any, torch.Generator], tuple[Any, Any]]


def infidelity(
    model: nn.Module,
    attributions: torch.Tensor | tuple[torch.Tensor, ...],
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    perturb: Perturb,
    target: Target = None,
    *,
    n: int = 10,
    normalize: bool = False,
    seed: int = 0,
    batch_size: int = 32,
) -> torch.Tensor:
    r"""Infidelity (Yeh et al., 2019, https://arxiv.org/abs/1901.09392), as captum's ``metrics.infidelity``.

    For each item ``x`` with attributions ``phi`` and ``n`` perturbations ``I`` drawn by ``perturb``:
    ``mean over I of (I^T phi - (f(x) - f(x_I)))^2``, where ``f`` is the target's score and ``x_I`` the perturbed
    input ``perturb`` returns with ``I`` (``x - I`` for the paper's local perturbations; the baseline where ``I``
    is 1 for attributions multiplied by inputs). Lower is better; 0 means the attributions predict every change.

    With ``normalize=True`` the attributions are first scaled by the ``beta`` that minimises that error,
    ``beta = sum_I (I^T phi)(f(x) - f(x_I)) / sum_I (I^T phi)^2``, so the value does not change when the
    attributions are multiplied by a constant (captum's ``normalize``).

    The ``n`` copies of every item run ``batch_size`` rows at a time (whole sets of one copy of each item, at least
    one set): ``ceil(n / max(batch_size // B, 1))`` forwards, plus one of the unperturbed inputs, in eval mode
    without autograd; the model is left exactly as it was.

    Args:
        model: the network.
        attributions: ``(B, ...)`` shaped like ``inputs`` (a tuple of such tensors for a tuple of inputs).
        inputs: ``(B, ...)`` floating-point model input, or a tuple of them (``model(*inputs)``).
        perturb: ``perturb(inputs, generator) -> (perturbation, perturbed_inputs)``, captum's ``perturb_func``
            with a ``torch.Generator`` to draw from. It is called once per forward on ``inputs`` with each item
            repeated ``k`` times, item-major (``torch.repeat_interleave``, as captum), and returns tensors of that
            shape (tuples of them for a tuple of inputs).
        target: whose score: ``None`` (each item's top class on the unperturbed input, kept for its perturbed
            copies; a model with one output per item ``(B,)`` is read as it is), an int, one int per item, or a
            callable ``output -> (B,)`` such as :class:`attribution.targets.ClassLogit` (given ``B`` copies at a
            time, one of each item in batch order).
        n: perturbations per item.
        normalize: scale the attributions by the best ``beta`` first.
        seed: seed of the generator handed to ``perturb`` (the global random state is not used).
        batch_size: perturbed rows per forward (captum's ``max_examples_per_batch``).

    Returns:
        ``(B,)`` infidelity per item, in the attributions' dtype (at least float32).

    Example:
        >>> import torch
        >>> from attribution import Saliency
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
        >>> x = torch.randn(2, 4)
        >>> def perturb(inputs, generator):
        ...     noise = 0.1 * torch.randn(inputs.shape, generator=generator)
        ...     return noise, inputs - noise
        >>> scores = infidelity(model, Saliency(model, abs=False)(x, 0), x, perturb, 0)  # the exact gradient
        >>> scores.shape, bool(scores.max() < 1e-10)
        (torch.Size([2]), True)
    """
    parts, single = check_inputs(inputs), isinstance(inputs, torch.Tensor)
    phi = _check_attributions(attributions, parts)
    _check_options(model, perturb, n, normalize, batch_size)
    batch = parts[0].shape[0]
    check_target(target, batch)
    generator = torch.Generator(device=parts[0].device).manual_seed(seed)
    sums: tuple[torch.Tensor, ...] = ()
    with observing(model):
        output = call(model, as_given(parts, single))
        fixed = _fixed(output, target, batch)
        clean = _scores(output, fixed, batch)
        for k in chunk_sizes(n, batch, batch_size):
            perturbations, perturbed = _perturbed(perturb, repeat(parts, k), single, generator)
            scores = _scores(call(model, as_given(perturbed, single)), expand_target(fixed, batch, k), batch * k)
            differences = clean[:, None] - scores.view(batch, k)
            part = infidelity_sums(attribution_dots(phi, perturbations), differences, normalize)
            sums = tuple(a + b for a, b in zip(sums, part, strict=True)) if sums else part
    return infidelity_value(sums, n, normalize)


def _check_attributions(attributions: Any, parts: Tensors) -> Tensors:
    """The attributions as float tensors (at least float32) shaped like the inputs, finite."""
    phi = as_tensors(attributions, "`attributions`")
    shapes = [tuple(p.shape) for p in parts]
    if [tuple(a.shape) for a in phi] != shapes:
        raise ValueError(
            f"`attributions` must be shaped like `inputs` {shapes if len(shapes) > 1 else shapes[0]}, one value per "
            f"input value; got {describe(attributions)}. Attributions at a layer or summed over channels cannot be "
            "dotted with input perturbations"
        )
    if not all(bool(torch.isfinite(a).all()) for a in phi):
        raise ValueError("`attributions` contain NaN or infinite values; infidelity would be NaN for those items")
    return tuple(at_least_float32(a.detach()).to(p.device) for a, p in zip(phi, parts, strict=True))


def _check_options(model: Any, perturb: Any, n: Any, normalize: Any, batch_size: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(perturb):
        raise TypeError(
            "`perturb` must be a function (inputs, generator) -> (perturbation, perturbed_inputs); got "
            f"{type(perturb).__name__}"
        )
    for name, value in (("n", n), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive int; got {value!r}")
    if not isinstance(normalize, bool):
        raise TypeError(f"`normalize` must be True or False; got {normalize!r}")


def _perturbed(
    perturb: Perturb, expanded: Tensors, single: bool, generator: torch.Generator
) -> tuple[Tensors, Tensors]:
    """The perturbations and perturbed inputs ``perturb`` returns for the repeated inputs, checked."""
    made = perturb(as_given(expanded, single), generator)
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise TypeError(
            "`perturb` must return a pair (perturbation, perturbed_inputs), as captum's perturb_func; got "
            f"{describe(made)}"
        )
    perturbations = as_tensors(made[0], "the perturbation `perturb` returns")
    perturbed = as_tensors(made[1], "the perturbed inputs `perturb` returns")
    shapes = [tuple(x.shape) for x in expanded]
    for what, got in (("perturbation", perturbations), ("perturbed inputs", perturbed)):
        if [tuple(x.shape) for x in got] != shapes:
            raise ValueError(
                f"the {what} `perturb` returns must be shaped like the repeated inputs it was given, "
                f"{shapes if len(shapes) > 1 else shapes[0]}; got {describe(made[0 if what == 'perturbation' else 1])}"
            )
    return perturbations, perturbed


def _fixed(output: Any, target: Target, batch: int) -> Target:
    """``None`` resolved to each item's top class (kept for a ``(B,)`` output, read as it is); others unchanged."""
    if target is not None or _one_score(output, batch):
        return target
    return class_indices(class_logits(output), None, batch)


def _one_score(output: Any, rows: int) -> bool:
    return isinstance(output, torch.Tensor) and tuple(output.shape) == (rows,)


def _scores(output: Any, target: Target, rows: int) -> torch.Tensor:
    """The target's ``(rows,)`` scores of a model output, at least float32."""
    if target is None and _one_score(output, rows):
        return at_least_float32(output)
    return at_least_float32(target_scores(output, target, rows))
