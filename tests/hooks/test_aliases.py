"""A module reachable under two names is recorded under the name each caller asked for."""

from __future__ import annotations

import torch
from torch import nn

from hooks import HookManager, Recorder


class Tied(nn.Module):
    """``dec`` is ``enc`` (tied weights); the forward calls it as ``dec`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = self.enc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(x).tanh()


def test_a_second_recorder_on_a_shared_manager_files_records_under_the_name_it_asked_for():
    torch.manual_seed(0)
    model = Tied()
    with HookManager(model) as manager:
        by_enc = Recorder(model, "enc", manager=manager, capture=("output", "grad_output"))
        by_dec = Recorder(model, "dec", manager=manager, capture=("output", "grad_output"))
        x = torch.randn(2, 4)
        model(x).sum().backward()
    assert list(by_enc) == [("enc", 0)] and list(by_dec) == [("dec", 0)]
    assert torch.equal(by_dec["dec"].output, model.enc(x).detach())
    assert torch.equal(by_dec["dec"].grad_output, by_enc["enc"].grad_output)


def test_hook_functions_receive_the_name_they_were_registered_under():
    model = Tied()
    seen = []
    with HookManager(model) as manager:
        manager.group("a").forward("enc", lambda m, a, o, *, name: seen.append(("a", name)))
        manager.group("b").forward("dec", lambda m, a, o, *, name: seen.append(("b", name)))
        manager.group("c").backward("dec", lambda m, gi, go, *, name: seen.append(("c", name)))
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == [("a", "enc"), ("b", "dec"), ("c", "dec")]
