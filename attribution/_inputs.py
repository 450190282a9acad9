"""Model inputs of any form: a tensor, a tuple of positional inputs, or a dict of keyword inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def call(model: nn.Module, inputs: Any) -> Any:
    """``model(x)`` for a tensor, ``model(*x)`` for a tuple or list, ``model(**x)`` for a mapping."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def batch_size(inputs: Any) -> int:
    """The size of the first axis of the first tensor in ``inputs``."""
    tensors = [
        x
        for x in pytree.tree_leaves(dict(inputs) if isinstance(inputs, Mapping) else inputs)
        if isinstance(x, torch.Tensor) and x.dim() > 0
    ]
    if not tensors:
        raise ValueError("the inputs must hold a tensor with a batch axis")
    return int(tensors[0].shape[0])
