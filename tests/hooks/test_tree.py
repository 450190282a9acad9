"""The one tree walker: hooks.flatten, hooks.map_tensors and hooks.tensors on nested inputs and outputs."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch

from hooks import flatten, map_tensors, tensors

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass(frozen=True)
class Output:
    logits: torch.Tensor
    extra: tuple
    note: str = "n"


def nested():
    return {"a": (torch.ones(2), [3, Output(torch.arange(3.0), (torch.zeros(1), None))]), "b": Pair(torch.ones(1), 4)}


def test_tensors_in_order_inside_dicts_tuples_lists_named_tuples_and_dataclasses():
    found = tensors(nested())
    assert [tuple(t.shape) for t in found] == [(2,), (3,), (1,), (1,)]
    assert found[1].tolist() == [0.0, 1.0, 2.0]


def test_map_tensors_rebuilds_every_container_and_leaves_the_rest():
    value = nested()
    doubled = map_tensors(lambda t: t * 2 + 1, value)
    assert isinstance(doubled["b"], Pair) and doubled["b"].right == 4
    inner = doubled["a"][1][1]
    assert isinstance(inner, Output) and inner.note == "n" and inner.extra[1] is None
    assert inner.logits.tolist() == [1.0, 3.0, 5.0]
    assert value["a"][1][1].logits.tolist() == [0.0, 1.0, 2.0]  # the frozen dataclass was copied, not changed
    flat = Output(torch.ones(1), ())
    assert map_tensors(lambda t: t, flat) is flat  # no field changed: the same object


def test_specs_compare_structure_not_values():
    _, spec = flatten(nested())
    other = map_tensors(lambda t: t + 1, nested())
    assert flatten(other)[1] == spec
    changed = nested()
    changed["b"] = (changed["b"].left, 4)  # a tuple where there was a Pair
    assert flatten(changed)[1] != spec
    assert flatten({"a": Output(torch.ones(1), ())})[1] != flatten({"a": Output(torch.ones(1), (1,))})[1]
    with pytest.raises(TypeError):
        hash(spec)
