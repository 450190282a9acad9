"""NaN and inf never become silent results: the item is named in a warning, recorded, and its map stored as NaN."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import TensorDataset

from attribution import GradCAM, attribute_dataset, open_results


def images() -> torch.Tensor:
    x = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    x[3, 1, 2, 0] = float("nan")
    x[5, 0, 0, 1] = float("inf")
    x[6, 0, 0, 0] = 100.0  # finite; the method below fails on it
    return x


def zeroing(x: torch.Tensor, target: object) -> torch.Tensor:
    """A method that hides bad inputs as all-zero maps, and fails (NaN) on one finite item."""
    maps = x.mean(1).nan_to_num(0.0, 0.0, 0.0) * torch.isfinite(x).flatten(1).all(1)[:, None, None]
    maps[x[:, 0, 0, 0] == 100.0] = float("nan")
    return maps


def test_items_with_nan_or_inf_are_named_recorded_and_never_zero_maps(tmp_path):
    x = images()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = attribute_dataset(zeroing, TensorDataset(x), tmp_path, batch_size=4, progress=False)
    messages = [str(w.message) for w in caught]  # one per batch
    assert messages[0].startswith("item 3: input holds NaN or inf. ") and "results.failures" in messages[0]
    assert messages[1].startswith("item 5: input holds NaN or inf; item 6: map holds NaN or inf. ")
    assert res.failures == {3: "input holds NaN or inf", 5: "input holds NaN or inf", 6: "map holds NaN or inf"}
    assert open_results(tmp_path).failures == res.failures
    for i in (3, 5, 6):
        assert res.maps[i].isnan().all()
    good = [0, 1, 2, 4, 7]
    assert torch.equal(res.maps[good], x[good].mean(1))


def test_a_model_output_with_nan_is_recorded(tiny_cnn, tmp_path):
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    cam = GradCAM(tiny_cnn, "features.2")
    with torch.no_grad():
        tiny_cnn.fc.weight[0, 0] = float("nan")  # every item's logit 0 is NaN
    try:
        with pytest.warns(UserWarning, match=r"item 0: model output holds NaN or inf; item 1: model"):
            res = attribute_dataset(cam, TensorDataset(x), tmp_path, batch_size=4, target=1, progress=False)
    finally:
        with torch.no_grad():
            tiny_cnn.fc.weight[0, 0] = 0.0
    assert set(res.failures) == {0, 1, 2, 3} and res.maps[:].isnan().all()
