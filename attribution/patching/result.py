"""The result of a patching sweep: a tensor that knows its axes (layers, positions, heads, examples) and their labels.

:class:`PatchingResult` is a ``torch.Tensor`` subclass, so everything that worked on the plain tensor results of
:func:`attribution.activation_patching`, :func:`attribution.attribution_patching` and
:func:`attribution.path_patching` still works (``torch.as_tensor``, indexing, arithmetic, ``.numpy()``,
``torch.save``). It adds two attributes, ``axes`` and ``labels``, that the plots read, so that a heatmap is labelled
with the module names and positions without carrying them by hand.

Why a subclass, and why only the result itself carries labels: a wrapper object would break the code that uses the
results as tensors; a subclass whose operations kept the labels would have to know, for every torch function, how
it moves axes (``result.T``, ``result[:, 0]``, ``result.sum(0)``). So every torch operation on a result returns a
plain ``torch.Tensor`` (its ``__torch_function__`` unwraps the outputs), the labels never end up on a tensor whose
axes they do not describe, and :meth:`PatchingResult.isel` is the one label-keeping way to drop an axis. Pickling,
``copy.deepcopy`` and ``torch.save``/``torch.load`` (also with ``weights_only=True``: the class is registered with
``torch.serialization.add_safe_globals``, its state being strings and ints) keep the labels.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

AXES = ("layer", "sender", "position", "head", "example")
"""The axis names a patching result can have (``sender`` is the first axis of :func:`attribution.path_patching`)."""


def _plain(value: Any) -> Any:
    """``value`` (an operation's output) with a :class:`PatchingResult` in it, or in a list/tuple, as a plain tensor.

    Only plain lists and tuples are walked: a ``torch.Size`` or a ``torch.return_types`` tuple stays what it is
    (operations run with subclass dispatch off return plain tensors anyway, but for ``self`` from in-place ones).
    """
    if isinstance(value, PatchingResult):
        return value.as_subclass(torch.Tensor)
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


class PatchingResult(torch.Tensor):
    """A patching sweep's values with the names and labels of their axes; every torch operation gives a plain tensor.

    Attributes:
        axes: the axis names in order, from ``layer`` (or ``sender``), ``position``, ``head``, ``example``.
        labels: for each axis name, one label per index: module names for ``layer``/``sender``, the positions of
            the activation's axis 1 (as given: ``[-1]`` stays ``-1``), head and example indices.

    Example:
        >>> result = PatchingResult(torch.zeros(2, 3), {"layer": ["0", "1"], "position": [0, 1, 2]})
        >>> result.axes, result.labels["layer"], type(result + 1).__name__, result[0].shape
        (('layer', 'position'), ['0', '1'], 'Tensor', torch.Size([3]))
    """

    axes: tuple[str, ...]
    labels: dict[str, list[Any]]

    @staticmethod
    def __new__(cls, values: torch.Tensor, labels: Mapping[str, Sequence[Any]]) -> PatchingResult:  # noqa: D102
        values = torch.as_tensor(values)
        axes = tuple(labels)
        if len(axes) != values.dim():
            raise ValueError(f"`labels` name {len(axes)} axes {axes} for a result of shape {tuple(values.shape)}")
        for axis, size in zip(axes, values.shape, strict=True):
            if len(labels[axis]) != size:
                raise ValueError(f"{len(labels[axis])} labels for axis {axis!r} of size {size}")
        self = _plain(values).as_subclass(cls)
        self.axes = axes
        self.labels = {axis: list(labels[axis]) for axis in axes}
        return self

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Run ``func`` as on plain tensors and return plain tensors: labels never describe a changed tensor."""
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.__reduce_ex__, torch.Tensor.__setstate__):
            return out
        return _plain(out)

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        """The plain tensor's repr (so that printed results read as before); the labels are in ``.labels``."""
        return repr(self.as_subclass(torch.Tensor))

    def __deepcopy__(self, memo: dict[int, Any]) -> PatchingResult:
        """A copy of the values and the labels."""
        return PatchingResult(self.as_subclass(torch.Tensor).clone(), copy.deepcopy(self.labels, memo))

    def isel(self, **indices: int) -> PatchingResult:
        """The result at one index of each named axis, those axes dropped, the other labels kept (as xarray's).

        Args:
            **indices: axis name to index, ``example=0``, ``head=3``.

        Returns:
            A :class:`PatchingResult` with one axis fewer per name.

        Raises:
            KeyError: a name that is not one of this result's axes.

        Example:
            >>> result = PatchingResult(torch.arange(4.0).reshape(2, 2), {"layer": ["a", "b"], "example": [0, 1]})
            >>> result.isel(example=1).tolist(), result.isel(example=1).labels
            ([1.0, 3.0], {'layer': ['a', 'b']})
        """
        unknown = [axis for axis in indices if axis not in self.axes]
        if unknown:
            raise KeyError(f"{unknown[0]!r} is not an axis of this result; its axes are {self.axes}")
        index = tuple(indices.get(axis, slice(None)) for axis in self.axes)
        values = self.as_subclass(torch.Tensor)[index]
        return PatchingResult(values, {a: self.labels[a] for a in self.axes if a not in indices})


torch.serialization.add_safe_globals([PatchingResult])  # torch.load(..., weights_only=True) may rebuild a result


def labelled(
    values: torch.Tensor,
    first: tuple[str, list[str]],
    positions: bool | Sequence[int],
    heads: int | None,
    per_example: bool,
) -> PatchingResult:
    """``values``, ``(layers, [positions], [heads], [batch])``, labelled; ``first``: the first axis' name, labels."""
    labels: dict[str, list[Any]] = {first[0]: list(first[1])}
    axis = 1
    if positions is not False:
        n = values.shape[axis]
        labels["position"] = list(range(n)) if positions is True else [int(p) for p in positions]
        axis += 1
    if heads:
        labels["head"] = list(range(heads))
        axis += 1
    if per_example:
        labels["example"] = list(range(values.shape[axis]))
    return PatchingResult(values, labels)
