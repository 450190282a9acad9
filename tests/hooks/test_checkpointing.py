"""Gradient checkpointing: the replayed calls are the calls they replay, recorded once."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hooks import HookManager, Recorder


class Checkpointed(nn.Module):
    """One block run twice, each time in its own checkpointed segment."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        self.reentrant = reentrant

    def forward(self, x):
        for _ in range(2):
            x = self.block(x) if self.reentrant is None else checkpoint(self.block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_calls_are_the_calls_they_replay(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    plain = Checkpointed(None)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, requires_grad=True)

    def run(m):
        log = []
        with Recorder(m, ["block", "block.1"], capture=("output", "grad_output")) as rec, HookManager(m) as mgr:
            mgr.group("g").backward("block", lambda mod, gi, go, *, call: log.append(call))
            m(x).pow(2).sum().backward()
        return rec, log

    rec_ref, log_ref = run(plain)
    rec, log = run(model)
    assert log == log_ref == [1, 0]  # each call's backward hook once, with its own index
    assert sorted(rec) == sorted(rec_ref) == [("block", 0), ("block", 1), ("block.1", 0), ("block.1", 1)]
    for key in rec:
        assert rec[key].samples == 1 and rec[key].grad_samples == 1, key  # not recorded again on recomputation
        torch.testing.assert_close(rec[key].output, rec_ref[key].output, rtol=0, atol=0)
        torch.testing.assert_close(rec[key].grad_output, rec_ref[key].grad_output)


def test_checkpointing_replays_call_dependent_edits_with_the_original_call():
    """A hook that edits call 1 only must edit the recomputed call 1, or the gradients would be wrong."""
    torch.manual_seed(0)
    model = Checkpointed(False)
    plain = Checkpointed(None)
    plain.load_state_dict(model.state_dict())

    def edit(module, args, output, *, call):
        return output * 3 if call == 1 else None

    grads = []
    for m in (plain, model):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with HookManager(m) as mgr:
            mgr.group("edit").forward("block.0", edit)
            m(x).pow(2).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_timm_gradient_checkpointing_records_once():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    x = torch.randn(1, 3, 32, 32)
    results = []
    for on in (False, True):
        vit.set_grad_checkpointing(on)
        vit.train()  # timm checkpoints only in training mode
        vit.zero_grad(set_to_none=True)
        with Recorder(vit, "blocks.*.attn", capture=("output", "grad_output")) as rec:
            vit(x).sum().backward()
        results.append(rec)
    plain, ckpt = results
    assert list(ckpt) == list(plain)
    for key in ckpt:
        assert ckpt[key].samples == 1 and ckpt[key].grad_samples == 1
        torch.testing.assert_close(ckpt[key].grad_output, plain[key].grad_output)
