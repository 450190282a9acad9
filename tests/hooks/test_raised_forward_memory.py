"""A forward that raises between a module's two hook phases leaves nothing holding its inputs' graphs."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from hooks import Recorder


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.fail:
            raise RuntimeError("boom")
        return h


def test_the_inputs_of_a_call_whose_forward_raised_are_released_when_the_forward_of_the_model_ends():
    model = nn.Sequential(nn.Linear(3, 3), Fails())
    with Recorder(model, "**", capture=("grad_input",)):
        x = torch.randn(2, 3, requires_grad=True)
        h = model[0](x) * 1.0  # an input whose graph only the failed call could keep alive
        alive = weakref.ref(h)
        with pytest.raises(RuntimeError, match="boom"):
            model(h)
        del h
        gc.collect()
        assert alive() is None
