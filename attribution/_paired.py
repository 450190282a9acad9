"""Pairs of model inputs (clean and corrupted) and the stacked batches run over them: shared by patching and circuits.

Inputs are compared by structure and shape, stacked along the batch axis for several cells in one run, and the rows
of one cell taken back out of the stacked output; a metric of the output is checked to be a scalar (or one value
per example).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hooks import flatten, map_tensors

from ._inputs import batched

__all__ = ["check_same_shapes", "checked_metric", "plain", "repeat_batch", "take_rows"]


def plain(inputs: Any, model: nn.Module) -> Any:
    """Inputs as plain containers (a ``BatchFeature`` as a dict), a single image with a batch axis."""
    inputs = batched(inputs, model, images=False).inputs
    return dict(inputs) if isinstance(inputs, Mapping) else inputs


def check_same_shapes(first: Any, second: Any, what: tuple[str, str] = ("`clean`", "`corrupted`")) -> None:
    """Raise unless the two inputs have the same structure and tensor shapes; ``what`` names them."""
    a, spec_a = flatten(first)
    b, spec_b = flatten(second)
    one, two = what
    if spec_a != spec_b:
        raise ValueError(f"{one} and {two} must have the same structure; got {spec_a} and {spec_b}")
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) and (not isinstance(y, torch.Tensor) or x.shape != y.shape):
            raise ValueError(
                f"{one} and {two} must have the same shapes; got {tuple(x.shape)} and "
                f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}"
            )
    if not any(isinstance(x, torch.Tensor) for x in a):
        raise TypeError(f"{one} must be a tensor, or a tuple/dict of model inputs holding tensors")


def repeat_batch(inputs: Any, times: int, batch: int) -> Any:
    """The inputs stacked ``times`` along the batch axis; tensors whose first axis is not the batch stay as they are."""
    if times == 1:
        return inputs

    def stack(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
            return x.repeat(times, *[1] * (x.dim() - 1))
        return x

    return map_tensors(stack, inputs)


def take_rows(output: Any, rows: slice, stacked: int) -> Any:
    """The rows of one cell in a stacked output (leaves whose first axis is the stacked batch)."""

    def take(x: Any) -> Any:
        return x[rows] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == stacked else x

    return map_tensors(take, output)


def checked_metric(metric: Callable[[Any], torch.Tensor], output: Any, per_example: bool, batch: int) -> torch.Tensor:
    """``metric(output)``, refused unless it is a scalar (or one value per example with ``per_example``)."""
    value = metric(output)
    expected = (batch,) if per_example else ()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        want = f"a ({batch},) tensor, one value per example" if per_example else "a scalar tensor"
        raise ValueError(
            f"`metric` must return {want}; got {got}" + (" (pass per_example=True?)" if got == (batch,) else "")
        )
    return value
