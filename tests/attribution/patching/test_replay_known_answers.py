"""Which module calls an exact patching sweep replays instead of running: counted, for sites inside a block.

Every module counts how often its own ``forward`` really runs. A sweep of one cell runs the model four times:
the source run (recorded), the traced target run, the check run that replays everything before the last site, and
the cell's run. The calls that finish before the site (and the site's own call, for an output site) run only in the
first two; the others in all four. The values must be those of running every call (``reuse=False``), bitwise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import activation_patching


class Counted(nn.Module):
    """``fn(linear(x))`` with a count of its real runs (``fn(x)`` without a child module for ``linear=False``)."""

    def __init__(self, fn=None, linear: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3) if linear else None
        self.fn = fn or (lambda x: x)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.fn(x if self.linear is None else self.linear(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Counted(torch.tanh), Counted(torch.sin), Counted()
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.c(self.b(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Block(), Counted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def metric(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.tensor([0.3, -1.2, 0.7], dtype=out.dtype)).sum()


def counts(model: nn.Module) -> dict[str, int]:
    return {name: m.runs for name, m in model.named_modules() if hasattr(m, "runs")}


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    return torch.randn(2, 4, 3, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)


@pytest.mark.parametrize(
    ("layer", "site", "replayed"),
    [
        ("block.a", "input", []),  # nothing has finished when the block's first child starts
        ("block.a", "output", ["block.a"]),
        ("block.b", "input", ["block.a"]),
        ("block.b", "output", ["block.a", "block.b"]),
        ("block.c", "output", ["block.a", "block.b", "block.c"]),  # its end is the block's last moment
        ("head", "input", ["block"]),  # the whole block, as one call
        ("head", "output", ["block", "head"]),
    ],
)
def test_the_calls_that_finish_before_the_site_run_only_twice(inputs, layer, site, replayed):
    clean, corrupted = inputs
    torch.manual_seed(1)
    model = Net().double().eval()
    got = activation_patching(model, clean, corrupted, layer, metric, site=site, positions=False, progress=False)
    inside = {"block": ["block.a", "block.b", "block.c"]}
    twice = {name for r in replayed for name in [r, *inside.get(r, [])]}
    runs = 4 if replayed else 3  # no check run when nothing is replayed
    expected = {name: 2 if name in twice else runs for name in counts(model)}
    assert counts(model) == expected
    plain = activation_patching(
        model, clean, corrupted, layer, metric, site=site, positions=False, reuse=False, progress=False
    )
    assert torch.equal(got, plain)


def test_values_per_position_equal_running_every_call(inputs):
    clean, corrupted = inputs
    torch.manual_seed(1)
    model = Net().double().eval()
    layers = ["block.c", "block.a", "head"]
    got = activation_patching(model, clean, corrupted, layers, metric, progress=False)
    plain = activation_patching(model, clean, corrupted, layers, metric, reuse=False, progress=False)
    assert torch.equal(got, plain)


class Shared(nn.Module):
    """``act`` runs inside ``block`` and again after it: the block must not be replayed as one call."""

    def __init__(self) -> None:
        super().__init__()
        self.act = Counted(torch.tanh, linear=False)  # its own child would be shared too
        self.block = nn.Sequential(Counted(), self.act)
        self.mid = Counted(torch.sin)
        self.head = Counted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.mid(self.block(x))))


def test_a_block_holding_a_module_also_called_outside_is_opened_up(inputs):
    clean, corrupted = inputs
    torch.manual_seed(1)
    model = Shared().double().eval()
    got = activation_patching(model, clean, corrupted, "head", metric, positions=False, progress=False)
    # every call ends before the head's output site: its children run in the two unreplayed forwards only
    assert counts(model) == {"act": 4, "block.0": 2, "mid": 2, "head": 2}
    plain = activation_patching(model, clean, corrupted, "head", metric, positions=False, reuse=False, progress=False)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("layers", [["block.a", "head"], ["head", "block.a"]])
def test_the_check_run_replays_up_to_the_last_site(inputs, layers):
    """Check run: all before the head's output; cell of ``block.a``: ``block.a`` only; cell of ``head``: all."""
    clean, corrupted = inputs
    torch.manual_seed(1)
    model = Net().double().eval()
    activation_patching(model, clean, corrupted, layers, metric, positions=False, progress=False)
    assert counts(model) == {"block": 3, "block.a": 2, "block.b": 3, "block.c": 3, "head": 3}
