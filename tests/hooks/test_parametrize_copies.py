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


def _ours(module: nn.Module) -> list[str]:
    """What of hookscope a module carries: dispatchers in its hook dicts, copy filters in its ``__dict__``."""
    found = [
        f"{attr}[{key}]"
        for attr in ("_forward_hooks", "_forward_pre_hooks")
        for key, fn in getattr(module, attr).items()
        if type(fn).__module__.startswith("hooks.")
    ]
    return found + [attr for attr in ("__getstate__", "__deepcopy__") if attr in module.__dict__]


def test_a_parametrization_registered_after_the_hooks_leaves_copies_clean():
    """The other order: the module becomes a parametrized class (with a __deepcopy__) while it carries our hooks."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(4, 3)
    with Recorder(model, ["0", "2"]) as rec:
        parametrize.register_parametrization(model[0], "weight", Symmetric())
        assert _ours(model[0])  # the original is hooked
        replica = copy.deepcopy(model)
        assert {name: _ours(module) for name, module in replica.named_modules() if _ours(module)} == {}
        torch.testing.assert_close(replica(x), model(x), rtol=0, atol=0)
        assert rec["0"].samples == 1  # the replica's forward fired nothing of ours
        twice = copy.deepcopy(replica)  # and a copy of the copy is a plain copy
        torch.testing.assert_close(twice(x), model(x), rtol=0, atol=0)
    assert type(replica[0]).__name__ == type(model[0]).__name__  # still parametrized
    assert all(not _ours(module) for module in model.modules())  # and the original is clean again
