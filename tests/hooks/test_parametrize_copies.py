"""Copies of a model with ``torch.nn.utils.parametrize`` parametrizations carry no hook of ours."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils import parametrize

from hooks import Recorder
from tests.support import hook_state


class Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(0, 1)


def test_a_deepcopy_made_while_a_group_is_active_has_no_hook_and_computes_the_same():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    fresh = hook_state(copy.deepcopy(model))
    x = torch.randn(4, 3)
    with Recorder(model, "**", capture=("output", "grad_input", "grad_output")) as rec:
        model(x).sum().backward()
        replica = copy.deepcopy(model)
        assert hook_state(replica) == fresh
        for module in replica.modules():
            assert "__deepcopy__" not in module.__dict__ and "__getstate__" not in module.__dict__
        before = rec["0"].samples
        torch.testing.assert_close(replica(x), model(x), rtol=0, atol=0)
        assert rec["0"].samples == before + 1  # only the original's forward was recorded
    assert type(replica[0]).__name__ == type(model[0]).__name__  # still parametrized
