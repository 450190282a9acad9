"""Which modules a CAM explains: ``layers`` (one or more), ``layer=`` (exactly one); several with ``layer=`` warn."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attribution import GradCAM, ScoreCAM
from hooks import Recorder, hooked_modules


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3),
    ).eval()  # fmt: skip


@pytest.mark.parametrize("cls", [GradCAM, ScoreCAM])
def test_positional_layers_and_keyword_layer_give_the_same_maps(cls):
    model, x = small_cnn(), torch.randn(2, 3, 6, 5)
    options = {"progress": False} if cls is ScoreCAM else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = [cls(model, "2", **options), cls(model, layers="2", **options), cls(model, layer="2", **options)]
        several = cls(model, layers=["0", "2"], **options)
    maps = [cam(x, 1) for cam in one]
    for other in maps[1:]:
        torch.testing.assert_close(other, maps[0], rtol=0, atol=0)
    assert several.layers == ["0", "2"] and one[2].layers == ["2"]


def test_several_modules_as_layer_still_work_with_a_warning_that_names_layers():
    model, x = small_cnn(), torch.randn(2, 3, 6, 5)
    with pytest.warns(DeprecationWarning, match=r"pass `layers=`") as caught:
        old = GradCAM(model, layer=["0", "2"])
    assert caught[0].filename == __file__
    torch.testing.assert_close(old(x, 1), GradCAM(model, ["0", "2"])(x, 1), rtol=0, atol=0)


def test_both_or_neither_spelling_is_refused():
    model = small_cnn()
    with pytest.raises(TypeError, match="got both"):
        GradCAM(model, "2", layer="0")
    with pytest.raises(TypeError, match="got neither"):
        GradCAM(model)


def test_the_recorder_takes_target_and_its_old_name_targets_with_a_warning():
    model = small_cnn()
    with Recorder(model, target="0") as new:
        model(torch.ones(1, 3, 4, 4))
    with pytest.warns(DeprecationWarning, match="pass `target=`") as caught, Recorder(model, targets="0") as old:
        model(torch.ones(1, 3, 4, 4))
    assert caught[0].filename == __file__
    torch.testing.assert_close(old["0"].output, new["0"].output, rtol=0, atol=0)
    with pytest.raises(TypeError, match="give the modules once"):
        Recorder(model, "0", targets="0")
    with pytest.raises(TypeError, match="needs `target`"):
        Recorder(model)
    assert not hooked_modules(model)  # the failed constructions left no hooks
