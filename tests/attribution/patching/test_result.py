"""Patching results carry their axes and labels, and stay plain tensors for everything else."""

from __future__ import annotations

import copy
import io
import pickle

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch

from attribution import activation_patching, attribution_patching, path_patching
from attribution.patching import PatchingResult
from attribution.plot import plot_atp_vs_exact, plot_patching, plot_path_patching
from tests.attribution.models import last_position_per_item, last_position_sum, sweep_setting

matplotlib.use("Agg")


metric, per_item = last_position_sum, last_position_per_item


@pytest.fixture
def setting():
    """Three 6-wide sites, 4 positions, 3 examples: every axis a different size."""
    return sweep_setting()


def labels_of(result: PatchingResult) -> dict:
    assert isinstance(result, PatchingResult)
    return result.labels


@pytest.mark.parametrize("sweep", [activation_patching, attribution_patching])
def test_layers_positions_heads_in_the_users_order_on_a_non_square_result(setting, sweep):
    model, clean, corrupted = setting
    result = sweep(model, clean, corrupted, ["2", "0", "1"], metric, heads=2, progress=False)
    assert result.shape == (3, 4, 2)
    assert result.axes == ("layer", "position", "head")
    assert labels_of(result) == {"layer": ["2", "0", "1"], "position": [0, 1, 2, 3], "head": [0, 1]}


def test_a_glob_labels_the_layers_in_model_order(setting):
    model, clean, corrupted = setting
    result = activation_patching(model, clean, corrupted, "*", metric, positions=False, progress=False)
    assert result.axes == ("layer",) and result.labels == {"layer": ["0", "1", "2"]}


def test_per_example_adds_an_example_axis_last(setting):
    model, clean, corrupted = setting
    result = activation_patching(model, clean, corrupted, ["0", "2"], per_item, per_example=True, progress=False)
    assert result.shape == (2, 4, 3)
    assert result.labels == {"layer": ["0", "2"], "position": [0, 1, 2, 3], "example": [0, 1, 2]}


def test_positions_as_a_list_are_labelled_as_given(setting):
    model, clean, corrupted = setting
    result = activation_patching(model, clean, corrupted, ["0"], metric, positions=[3, 0, -1], progress=False)
    assert result.labels["position"] == [3, 0, -1]
    whole = activation_patching(model, clean, corrupted, ["0"], metric, progress=False)
    torch.testing.assert_close(torch.as_tensor(result), whole[:, [3, 0, 3]], rtol=0, atol=0)


def test_heads_without_positions(setting):
    model, clean, corrupted = setting
    result = attribution_patching(model, clean, corrupted, ["0", "1"], metric, positions=False, heads=3)
    assert result.shape == (2, 3) and result.labels == {"layer": ["0", "1"], "head": [0, 1, 2]}


def test_path_patching_labels_its_senders(setting):
    model, clean, corrupted = setting
    result = path_patching(model, clean, corrupted, ["2", "0"], "2", metric, positions=[1, 3], progress=False)
    assert result.axes == ("sender", "position") and result.labels == {"sender": ["2", "0"], "position": [1, 3]}


def test_torch_operations_give_plain_tensors_with_the_same_numbers(setting):
    model, clean, corrupted = setting
    result = activation_patching(model, clean, corrupted, ["0", "1", "2"], metric, normalize=True, progress=False)
    plain = torch.tensor(result.tolist(), dtype=result.dtype)  # the numbers, rebuilt without the class
    assert result.shape == (3, 4) and result.dtype == torch.float32
    for value, expected in [
        (result + 1, plain + 1),
        (result * result, plain * plain),
        (result.sum(0), plain.sum(0)),
        (result.T, plain.T),
        (result[1:, 2], plain[1:, 2]),
        (result[torch.tensor([2, 0])], plain[torch.tensor([2, 0])]),
        (torch.where(result > 0, result, -result), plain.abs()),
        (result.detach().double().cpu(), plain.double()),
    ]:
        assert type(value) is torch.Tensor
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
    assert type(torch.stack([result, result])) is torch.Tensor
    assert float(result[2, 1]) == float(plain[2, 1]) and result.numpy().tolist() == plain.tolist()
    assert torch.as_tensor(result).labels["layer"] == ["0", "1", "2"]  # as_tensor gives the result itself
    assert repr(result) == repr(plain)  # printed as before


def test_an_in_place_change_keeps_the_object_and_its_labels():
    result = PatchingResult(torch.zeros(2, 3), {"layer": ["a", "b"], "position": [0, 1, 2]})
    result[0, 1] = 5.0
    result.mul_(2)
    assert isinstance(result, PatchingResult) and result.labels["layer"] == ["a", "b"]
    assert result.tolist() == [[0.0, 10.0, 0.0], [0.0, 0.0, 0.0]]


def test_pickle_deepcopy_and_torch_save_round_trips_keep_values_and_labels(setting):
    model, clean, corrupted = setting
    result = activation_patching(model, clean, corrupted, ["2", "0"], metric, heads=2, progress=False)
    buffer = io.BytesIO()
    torch.save({"result": result}, buffer)
    copies = [pickle.loads(pickle.dumps(result)), copy.deepcopy(result)]
    for weights_only in (True, False):
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=weights_only)["result"])
    for back in copies:
        assert type(back) is PatchingResult and back.axes == result.axes and back.labels == result.labels
        torch.testing.assert_close(back, result, rtol=0, atol=0)
    copies[1].labels["layer"][0] = "changed"
    assert result.labels["layer"][0] == "2"  # a deep copy


def test_isel_drops_one_axis_and_keeps_the_other_labels():
    values = torch.arange(24.0).reshape(2, 3, 4)
    result = PatchingResult(values, {"layer": ["a", "b"], "position": [0, 1, 2], "example": [0, 1, 2, 3]})
    picked = result.isel(example=3)
    assert picked.labels == {"layer": ["a", "b"], "position": [0, 1, 2]}
    torch.testing.assert_close(torch.as_tensor(picked), values[:, :, 3], rtol=0, atol=0)
    with pytest.raises(KeyError, match="'head' is not an axis"):
        result.isel(head=0)


def test_labels_that_do_not_fit_the_values_are_refused():
    with pytest.raises(ValueError, match="name 1 axes"):
        PatchingResult(torch.zeros(2, 3), {"layer": ["a", "b"]})
    with pytest.raises(ValueError, match="3 labels for axis 'layer' of size 2"):
        PatchingResult(torch.zeros(2), {"layer": ["a", "b", "c"]})


def ticks(ax) -> tuple[list[str], list[str]]:
    return [t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()]


def test_plot_patching_reads_the_labels_and_explicit_arguments_win():
    result = PatchingResult(torch.randn(2, 3), {"layer": ["blocks.1", "blocks.0"], "position": [4, 0, -1]})
    tokens = ["<s>", "The", "cat", "sat", "on", "mat"]
    assert ticks(plot_patching(result)) == (["blocks.1", "blocks.0"], ["4", "0", "-1"])
    assert ticks(plot_patching(result, tokens=tokens)) == (["blocks.1", "blocks.0"], ["on", "<s>", "mat"])
    assert ticks(plot_patching(result, tokens=["x", "y", "z"], layers=["a", "b"])) == (["a", "b"], ["x", "y", "z"])
    assert ticks(plot_patching(torch.as_tensor(result).clone())) == (["L0", "L1"], ["0", "1", "2"])  # plain
    plt.close("all")


def test_plot_patching_of_layers_positions_heads_and_of_layers_heads():
    three = PatchingResult(torch.randn(2, 3, 2), {"layer": ["p", "q"], "position": [0, 1, 2], "head": [0, 1]})
    assert ticks(plot_patching(three))[0] == ["p.H0", "p.H1", "q.H0", "q.H1"]
    two = PatchingResult(torch.randn(2, 3), {"layer": ["p", "q"], "head": [0, 1, 2]})
    assert ticks(plot_patching(two)) == (["p", "q"], ["H0", "H1", "H2"])
    per_example = PatchingResult(torch.randn(2, 3), {"layer": ["p", "q"], "example": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"example axis .*isel\(example=i\)"):
        plot_patching(per_example)
    plt.close("all")


def test_the_scatter_and_the_bars_label_cells_from_the_result():
    exact = PatchingResult(torch.tensor([[0.0, 1.0], [2.0, 9.0]]), {"layer": ["a", "b"], "position": [3, 7]})
    ax = plot_atp_vs_exact(torch.as_tensor(exact).clone() * 0.5, exact, annotate=1)
    assert [t.get_text() for t in ax.texts] == ["b 7"]
    path = PatchingResult(torch.tensor([0.1, -0.4]), {"sender": ["x.attn", "y.mlp"]})
    assert ticks(plot_path_patching(path))[0] == ["x.attn", "y.mlp"]
    plt.close("all")
