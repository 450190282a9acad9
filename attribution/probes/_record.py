"""The activations a probe reads: one row per item (at one position) or per token, for each site, over the data."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from hooks import resolve

from .._run import Element, HookedRun, eager_module, hook_site


def batches(data: Any, batch_size: int) -> Iterator[Any]:
    """A tensor or a mapping of tensors cut into batches along axis 0; anything else iterated as batches."""
    if isinstance(data, torch.Tensor):
        yield from data.split(batch_size)
    elif isinstance(data, Mapping):  # HF keyword inputs: tensors cut, other values (use_cache=False) passed on
        tensors = [v for v in data.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            raise TypeError(f"`data` is a mapping without a tensor to cut into batches: keys {list(data)}")
        for start in range(0, len(tensors[0]), batch_size):
            yield {k: _cut(v, start, batch_size) for k, v in data.items()}
    elif isinstance(data, Iterable):
        yield from data
    else:
        raise TypeError(f"`data` must be a tensor, a mapping of tensors or an iterable of batches; got {type(data)}")


def _cut(value: Any, start: int, size: int) -> Any:
    return value[start : start + size] if isinstance(value, torch.Tensor) and value.dim() > 0 else value


def rows(x: torch.Tensor, position: int | None) -> torch.Tensor:
    """``(batch, d)`` as is; ``(batch, tokens, d)`` at ``position`` (axis 1), or every token with ``None``."""
    if x.dim() == 2:
        return x
    if x.dim() != 3:
        raise ValueError(f"a probe reads (batch, d) or (batch, tokens, d) activations; the site gave {tuple(x.shape)}")
    return x[:, position] if position is not None else x.reshape(-1, x.shape[-1])


def token_keys(batch: Any, position: int | None, count: int) -> torch.Tensor | None:
    """The token ids that the rows of ``batch`` stand for (word types for the control task), if it has any."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return None
    keys = ids[:, position] if position is not None else ids.reshape(-1)
    return keys.cpu().long() if len(keys) == count else None


def record_rows(
    model: nn.Module,
    data: Any,
    sites: Any,
    *,
    position: int | None,
    site: Literal["output", "input"],
    element: Element,
    batch_size: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each site's rows ``(n, d)`` in float64 on the CPU, and each row's type ``(n,)`` (token ids, else its index)."""
    names = [name for name, _ in resolve(eager_module(model), sites, what="`sites`")]
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    keys: list[torch.Tensor] = []

    def keep(x: torch.Tensor, name: str, call: int) -> None:
        if call == 0:
            kept[name].append(rows(x.detach(), position).double().cpu())

    with HookedRun(eager_module(model), "probe") as run:
        hook_site(run.group, names, site, element, keep)
        seen = 0
        for batch in batches(data, batch_size):
            chunks = len(kept[names[0]])
            run.forward(batch)
            count = sum(len(r) for r in kept[names[0]][chunks:])
            found = token_keys(batch, position, count)
            keys.append(found if found is not None else -1 - torch.arange(seen, seen + count))
            seen += count
    if not keys or not kept[names[0]]:
        raise ValueError(f"`data` gave no activations at {names}: give at least one batch")
    return {name: torch.cat(r) for name, r in kept.items()}, torch.cat(keys)
