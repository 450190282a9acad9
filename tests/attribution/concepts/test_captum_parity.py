"""Parity with captum 0.9's TCAV when both use the same CAVs: the same sign counts, captum's "magnitude" the mean
derivative (what its code computes, not the ratio its docstring states)."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch

from attribution.concepts import TCAV

from .models import randn, small_cnn

pytestmark = pytest.mark.peers


def captum_scores(model, layers, vectors, runs, inputs, target):
    """captum's TCAV on experimental sets ``[concept (id 0), random (id 11 + i)]`` with a classifier that returns
    ``vectors[(i, layer)]`` instead of fitting one; float32, as captum computes its scores."""
    captum_concept = pytest.importorskip("captum.concept")
    from torch.utils.data import DataLoader

    class Given(captum_concept.Classifier):
        def __init__(self):
            self.key = None

        def train_and_eval(self, dataloader, **kwargs):
            x, labels = zip(*dataloader, strict=True)
            run = int(torch.cat(labels).max()) - 11
            self.key = (run, next(layer for layer in layers if vectors[(run, layer)].numel() == x[0].shape[1]))
            return {"accs": torch.tensor(1.0)}

        def weights(self):
            v = vectors[self.key].float()
            return torch.stack([v, -v])  # in the order of classes(): the concept's row, then the random set's

        def classes(self):
            return [0, 11 + self.key[0]]

    def concept(i):
        return captum_concept.Concept(i, f"set{i}", DataLoader(torch.zeros(2, 3, 7, 6)))

    own, randoms = concept(0), [concept(11 + i) for i in range(runs)]
    with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tcav = captum_concept.TCAV(copy.deepcopy(model).float(), layers, classifier=Given(), save_path=path + "/")
        return tcav.interpret(inputs.float(), [[own, r] for r in randoms], target=target)


def test_sign_counts_equal_captums_and_captums_magnitude_is_the_mean_directional_derivative():
    model, inputs = small_cnn(), randn(9, 3, 7, 6, seed=1)
    concepts = {"bright": randn(8, 3, 7, 6, seed=2) + 1.0}
    randoms = [randn(8, 3, 7, 6, seed=3 + i) for i in range(4)]
    tcav = TCAV(model, ["1", "3"], concepts, randoms, runs=3, kind="logistic")
    ours = tcav(inputs, target=2)
    vectors = {(i, layer): tcav.cavs["bright"][layer][i].vector for i in range(3) for layer in ("1", "3")}
    captum = captum_scores(model, ["1", "3"], vectors, 3, inputs, 2)
    for i in range(3):
        for layer in ("1", "3"):
            theirs = captum[f"0-{11 + i}"][layer]
            score = ours.scores["bright"][layer]
            assert theirs["sign_count"][0].item() == pytest.approx(score.sign_counts[i].item(), abs=1e-7)
            # float32 in captum against float64 here
            assert theirs["magnitude"][0].item() == pytest.approx(score.derivatives[i].mean().item(), rel=1e-5)
            assert theirs["sign_count"][1].item() == pytest.approx(1 - score.sign_counts[i].item(), abs=1e-7)
