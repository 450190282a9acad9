"""The three sweeps take their cells as one value, ``cells=Cells(...)``, or as today's keywords, never both."""

from __future__ import annotations

import pytest
import torch

from attribution import activation_patching, attribution_patching, path_patching
from attribution.patching import Cells
from tests.attribution.models import last_position_per_item, last_position_sum, sweep_setting

metric, per_item = last_position_sum, last_position_per_item


@pytest.fixture
def setting():
    """Three 6-wide sites, 4 positions, 3 examples: every axis a different size."""
    return sweep_setting()


def sweeps():
    """Each sweep as ``f(model, a, b, layers, metric, **options)``; path patching with the last layer as receiver."""
    return [
        lambda *args, **kw: activation_patching(*args, progress=False, **kw),
        lambda *args, **kw: attribution_patching(*args, **kw),
        lambda m, a, b, layers, f, **kw: path_patching(m, a, b, layers, "2", f, freeze=(), progress=False, **kw),
    ]


@pytest.mark.parametrize("sweep", sweeps(), ids=["activation", "attribution", "path"])
@pytest.mark.parametrize(
    "options",
    [
        {"positions": [3, -4], "heads": 2},
        {"positions": False, "heads": 3, "head_pattern": "b t (d h) -> b t h d"},
        {"positions": [1, 2], "per_example": True},
    ],
)
def test_cells_gives_the_same_numbers_and_labels_as_the_keywords(setting, sweep, options):
    model, clean, corrupted = setting
    f = per_item if options.get("per_example") else metric
    by_keywords = sweep(model, clean, corrupted, ["1", "0"], f, **options)
    by_value = sweep(model, clean, corrupted, ["1", "0"], f, cells=Cells(**options))
    torch.testing.assert_close(by_value, by_keywords, rtol=0, atol=0, equal_nan=True)
    assert by_value.labels == by_keywords.labels


@pytest.mark.parametrize("sweep", sweeps(), ids=["activation", "attribution", "path"])
def test_cells_and_a_keyword_together_are_refused(setting, sweep):
    model, clean, corrupted = setting
    with pytest.raises(TypeError, match=r"give the cells once: `cells`=.* not both"):
        sweep(model, clean, corrupted, ["0"], metric, cells=Cells(heads=2), positions=False)
    with pytest.raises(TypeError, match=r"`cells` must be a Cells"):
        sweep(model, clean, corrupted, ["0"], metric, cells={"heads": 2})


def test_path_patching_takes_the_cells_to_run_as_only_and_the_old_spelling_with_a_warning(setting):
    model, clean, corrupted = setting
    only = path_patching(model, clean, corrupted, ["0", "1"], "2", metric, only=[(1, 2)], progress=False)
    with pytest.warns(DeprecationWarning, match="pass them as `only=`") as caught:
        old = path_patching(model, clean, corrupted, ["0", "1"], "2", metric, cells=[(1, 2)], progress=False)
    assert caught[0].filename == __file__  # the warning points at the caller
    torch.testing.assert_close(old, only, rtol=0, atol=0, equal_nan=True)
    assert only.isnan().sum() == only.numel() - 1 and not only[1, 2].isnan()
    with pytest.raises(TypeError, match="give the cells to run once, as `only`"):
        path_patching(model, clean, corrupted, ["0"], "2", metric, cells=[(0, 1)], only=[(0, 1)], progress=False)
