"""Max-sensitivity (Yeh et al., 2019): how much attributions change when the input moves a little."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .._inputs import as_given, as_tensors, check_inputs, describe
from .._maps import at_least_float32
from .._run import warn
from ..targets import Target, check_target
from ._expand import expand_target
from ._explanation import Norm, check_norm, chunk_sizes, relative_changes, uniform_noise

Method = Callable[..., Any]


def sensitivity_max(
    method: Method,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    target: Target = None,
    *,
    radius: float = 0.02,
    n: int = 10,
    norm: Norm = "fro",
    seed: int = 0,
    batch_size: int = 32,
) -> torch.Tensor:
    """Max-sensitivity (Yeh et al., 2019, https://arxiv.org/abs/1901.09392), as captum's ``metrics.sensitivity_max``.

    For each item ``x``: ``max over n draws of e of ||phi(x + e) - phi(x)|| / ||phi(x)||``, with ``e`` uniform in
    the L-inf ball of ``radius`` (each input value moved by at most ``radius``), ``phi`` the attributions of
    ``method`` and the norm taken over all of an item's attributions flattened (all input tensors together; an
    item whose attributions are all zero is divided by 1, as in captum). Lower is better: 0 means the attributions do
    not move.

    ``method`` runs on the ``n`` perturbed copies of every item ``batch_size`` rows at a time (whole sets of one
    copy of each item, at least one set): ``ceil(n / max(batch_size // B, 1))`` calls, plus one on the inputs.

    Args:
        method: any attribution callable ``(inputs, target) -> attributions``, such as ``Saliency(model)``, or a
            function ``inputs -> attributions`` (called with the inputs alone when ``target`` is ``None``). It gets
            ``(B * k, ...)`` inputs, each item repeated ``k`` times item-major, and must return attributions with
            that first axis, shaped as it returned them for the inputs (a tuple of tensors is fine).
        inputs: ``(B, ...)`` floating-point inputs, or a tuple of them, passed to ``method`` as given.
        target: what ``method`` explains, expanded for the copies: ``None`` (passed as ``None``: for the methods of
            :mod:`attribution`, each copy's own top class), an int, one int per item (repeated for its copies) or a
            callable ``output -> (B,)`` (given ``B`` copies at a time, one of each item in batch order).
        radius: the largest change of any input value.
        n: perturbed copies per item.
        norm: ``"fro"`` (the 2-norm of the flattened attributions, captum's default) or a vector norm order
            (``1``, ``2``, ``math.inf``).
        seed: seed of the noise ``x + (2 u - 1) * radius``: for copy ``m = 0..n-1`` in turn, each input tensor draws
            ``u = torch.rand(x.shape, generator=...)`` from one generator seeded with ``seed``, so the result does
            not depend on ``batch_size`` and the global random state is not used.
        batch_size: perturbed rows per call of ``method`` (captum's ``max_examples_per_batch``).

    Returns:
        ``(B,)`` max-sensitivity per item (at least float32).

    Example:
        >>> import torch
        >>> from attribution import Saliency
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
        >>> sensitivity_max(Saliency(model), torch.randn(2, 4), target=0)  # a linear model's gradient is constant
        tensor([0., 0.])
    """
    parts, single = check_inputs(inputs), isinstance(inputs, torch.Tensor)
    norm = check_norm(norm)
    _check_options(method, radius, n, batch_size)
    batch = parts[0].shape[0]
    check_target(target, batch)
    original, shapes = _flat_attributions(method, as_given(parts, single), target, batch, None)
    generator = torch.Generator(device=parts[0].device).manual_seed(seed)
    worst: torch.Tensor | None = None
    for k in chunk_sizes(n, batch, batch_size):
        noisy = uniform_noise(parts, k, float(radius), generator)
        moved, _ = _flat_attributions(method, as_given(noisy, single), expand_target(target, batch, k), batch, shapes)
        changes = relative_changes(original, moved.view(batch, k, -1).to(original.device), norm).amax(dim=1)
        worst = changes if worst is None else torch.maximum(worst, changes)
    assert worst is not None, "n >= 1"
    bad = (~torch.isfinite(worst)).nonzero().flatten().tolist()
    if bad:
        warn(
            f"the attributions of item(s) {bad} hold NaN or inf (of the inputs or of a perturbed copy): their "
            "sensitivity is NaN or inf, not a verdict. Check the inputs and the method's output for those items"
        )
    return worst


def _check_options(method: Any, radius: Any, n: Any, batch_size: Any) -> None:
    if not callable(method):
        raise TypeError(
            "`method` must be an attribution callable (inputs, target) -> attributions, such as Saliency(model); "
            f"got {type(method).__name__}"
        )
    if not isinstance(radius, (int, float)) or isinstance(radius, bool) or not radius >= 0:
        raise ValueError(f"`radius` must be a number >= 0 (the largest change of an input value); got {radius!r}")
    for name, value in (("n", n), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{name}` must be a positive int; got {value!r}")


def call_method(method: Method, inputs: Any, target: Target) -> Any:
    """``method(inputs, target)``, or ``method(inputs)`` for a function of the inputs alone when there is no target."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or an object without a signature: the documented call
        return method(inputs, target)
    try:
        signature.bind(inputs, target)
    except TypeError:
        if target is None:
            return method(inputs)
        raise TypeError(
            f"`method` must take (inputs, target) to explain `target`; it takes {signature}. Pass target=None, or "
            "a function of both, e.g. lambda x, t: method(x, t)"
        ) from None
    return method(inputs, target)


def _flat_attributions(
    method: Method, inputs: Any, target: Target, batch: int, shapes: list[tuple[int, ...]] | None
) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """The attributions of ``inputs`` ``(rows, F)``, flattened per row, and each tensor's shape per item."""
    got = call_method(method, inputs, target)
    parts = as_tensors(got, "the attributions `method` returns")
    rows = parts[0].shape[0] if parts[0].dim() else 0
    per_item = [tuple(p.shape[1:]) for p in parts]
    expected_rows = len(as_tensors(inputs, "`inputs`")[0])
    if any(p.dim() == 0 or p.shape[0] != expected_rows for p in parts) or (shapes is not None and per_item != shapes):
        items = f"{shapes}" if shapes is not None else "(the inputs' first axis, ...)"
        raise ValueError(
            f"`method` must return attributions with one row per input row ({expected_rows}) and the same shape per "
            f"item on the inputs and on their perturbed copies, {items}; got {describe(got)} for inputs "
            f"{describe(inputs)}"
        )
    assert rows % batch == 0, "whole sets of copies"
    return torch.cat([at_least_float32(p.detach()).reshape(rows, -1) for p in parts], dim=1), per_item
