"""CausalModel on pyvene's hierarchical equality: its counterfactual labels equal the hand-written ones."""

from __future__ import annotations

import pytest
import torch

from attribution.causal import CausalModel
from tests.attribution.causal.equality import V


def equality() -> CausalModel:
    return CausalModel(
        {
            **{x: ([], None) for x in "abcd"},
            "left": (["a", "b"], lambda a, b: a == b),
            "right": (["c", "d"], lambda c, d: c == d),
            "label": (["left", "right"], lambda left, right: (left == right).long()),
        }
    )


def sampler(n: int, g: torch.Generator) -> dict:
    objects = torch.randint(0, V, (n, 4), generator=g)
    return dict(zip("abcd", objects.T, strict=True))


def test_counterfactuals_equal_the_hand_written_ones():
    model = equality()
    base, source, labels = model.sample_triples(200, sampler, ["left"], seed=3)
    expected = ((source["a"] == source["b"]) == (base["c"] == base["d"])).long()
    assert torch.equal(labels, expected)
    _, _, both = model.sample_triples(200, sampler, ["left", "right"], seed=3)
    assert torch.equal(both, model.run(source)["label"])  # both bits from the source: the source's label
    _, _, none = model.sample_triples(200, sampler, [], seed=3)
    assert torch.equal(none, model.run(base)["label"])
    assert 0.2 < labels.float().mean() < 0.8


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="parents \\['b'\\] not defined"):
        CausalModel({"a": ([], None), "s": (["a", "b"], lambda a, b: a)})
    model = equality()
    with pytest.raises(KeyError, match="lacks \\['d'\\]"):
        model.run({"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1)})
    with pytest.raises(KeyError, match="'middle'"):
        model.sample_triples(4, sampler, ["middle"])
