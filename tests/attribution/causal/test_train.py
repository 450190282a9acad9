"""IIA and train_intervention on hierarchical equality: known answers, the model left as found, resume, bad input."""

from __future__ import annotations

import re

import pytest
import torch

from attribution.causal import RotatedSubspace, Site
from attribution.causal.interventions import BoundlessSubspace
from attribution.causal.train import interchange_intervention_accuracy, train_intervention
from tests.attribution.causal.equality import hand_built, triples


def fixed(rotation: torch.Tensor, k: int = 1) -> RotatedSubspace:
    iv = RotatedSubspace(4, k).double()
    iv.rotation = rotation
    return iv


def test_iia_is_one_on_the_coordinate_that_holds_the_variable_and_about_half_elsewhere():
    model = hand_built()
    base, source, labels = triples(400, 0, "left")
    right = interchange_intervention_accuracy(
        model, base, source, labels, fixed(torch.eye(4, dtype=torch.float64)), Site("2")
    )
    wrong_subspace = torch.eye(4, dtype=torch.float64)[[2, 0, 1, 3]]  # first rotated coordinate: an unused one
    wrong = interchange_intervention_accuracy(model, base, source, labels, fixed(wrong_subspace), Site("2"))
    other_variable = torch.eye(4, dtype=torch.float64)[[1, 0, 2, 3]]  # c == d instead of a == b
    other = interchange_intervention_accuracy(model, base, source, labels, fixed(other_variable), Site("2"))
    assert right == 1.0
    assert 0.4 < wrong < 0.6
    assert 0.4 < other < 0.6
    rotated = torch.linalg.qr(torch.randn(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))[0]
    mixed = torch.block_diag(rotated, torch.eye(2, dtype=torch.float64))  # k=2 on the span of both bits
    _, _, both = triples(400, 0, "left")
    assert interchange_intervention_accuracy(model, base, source, both, fixed(mixed, 2), Site("2")) < 1.0


def test_das_finds_the_subspace_of_the_hand_built_mlp_and_leaves_the_model_as_found(tmp_path):
    model = hand_built()
    for p in list(model.parameters())[:2]:
        p.requires_grad_(False)
    before = {n: (p.clone(), p.requires_grad) for n, p in model.named_parameters()}
    base, source, labels = triples(512, 1, "left")
    torch.manual_seed(0)
    iv = train_intervention(model, base, source, labels, RotatedSubspace(4, 1).double(), Site("2"), epochs=8, lr=0.05)
    held_out = triples(400, 2, "left")
    assert interchange_intervention_accuracy(model, *held_out, iv, Site("2")) >= 0.95
    r = iv.rotation.detach()
    torch.testing.assert_close(r @ r.T, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-6)
    assert all(torch.equal(p, before[n][0]) and p.requires_grad == before[n][1] for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training


def test_a_checkpointed_run_resumes_to_the_same_intervention(tmp_path):
    model = hand_built()
    base, source, labels = triples(128, 3, "right")
    torch.manual_seed(0)
    straight = train_intervention(
        model, base, source, labels, RotatedSubspace(4, 1).double(), Site("2"), epochs=2, lr=0.05, batch_size=32
    )
    torch.manual_seed(0)
    ckpt = tmp_path / "das.pt"

    def train(epochs: int) -> RotatedSubspace:
        intervention = RotatedSubspace(4, 1).double()
        return train_intervention(
            model, base, source, labels, intervention, Site("2"), epochs=epochs, lr=0.05, batch_size=32, checkpoint=ckpt
        )

    first = train(1)
    assert ckpt.exists()
    torch.manual_seed(5)  # another initialisation: the checkpoint's state must win
    resumed = train(2)
    torch.testing.assert_close(resumed.rotation, straight.rotation, rtol=0, atol=1e-12)
    assert first is not resumed


def test_boundless_temperature_is_annealed_to_a_tenth():
    model = hand_built()
    base, source, labels = triples(64, 4, "left")
    iv = train_intervention(
        model, base, source, labels, BoundlessSubspace(4).double(), Site("2"), epochs=2, lr=0.01, batch_size=16
    )
    assert float(iv.temperature) == pytest.approx(0.1)


def test_nan_loss_and_bad_labels_are_named():
    model = hand_built()
    base, source, labels = triples(64, 4, "left")
    nan = lambda out, y: out.sum() * float("nan")  # noqa: E731
    with pytest.raises(FloatingPointError, match=r"epoch 0, step 0 \(batch rows \[\d+, "):
        train_intervention(model, base, source, labels, RotatedSubspace(4, 1).double(), Site("2"), loss=nan)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        interchange_intervention_accuracy(model, base, source, labels[:10], RotatedSubspace(4, 1).double(), Site("2"))
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        train_intervention(model, base, source, labels[:63], RotatedSubspace(4, 1).double(), Site("2"))
    for bad in (source[:32], source[:, :8]):
        with pytest.raises(
            ValueError, match=rf"source for Site\(module='2'.*got \(64, 12\) and {re.escape(str(tuple(bad.shape)))}"
        ):
            train_intervention(model, base, bad, labels, RotatedSubspace(4, 1).double(), Site("2"))
        with pytest.raises(ValueError, match=r"same shapes"):
            interchange_intervention_accuracy(model, base, bad, labels, RotatedSubspace(4, 1).double(), Site("2"))
