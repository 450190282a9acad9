"""Activation patching: TransformerLens parity on the reference transformer, invariants, record/patch, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import Patch, activation_patching, patch, record
from tests.attribution.models import tiny_gpt
from tests.support import hook_state

# The reference numbers came from TransformerLens on another machine; the clean logits agree to 2e-6 here.
TOL = {"rtol": 0, "atol": 1e-5}


@pytest.fixture(scope="module")
def reference():
    model, ref = tiny_gpt()
    answers = ref["answer_tokens"]
    rows = torch.arange(len(answers))

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:
        return logits[rows, -1, answers[:, 0]] - logits[rows, -1, answers[:, 1]]

    return model, ref, logit_diff


def sweep(reference, layers, **kwargs):
    model, ref, logit_diff = reference
    per_example = kwargs.get("per_example", False)
    metric = logit_diff if per_example else (lambda logits: logit_diff(logits).mean())
    return activation_patching(
        model, ref["clean_tokens"], ref["corrupted_tokens"], layers, metric, progress=False, **kwargs
    )


def test_reference_model_reproduces_the_clean_logits(reference):
    model, ref, logit_diff = reference
    with torch.no_grad():
        logits = model(ref["clean_tokens"])
    torch.testing.assert_close(logits, ref["clean_logits"], **TOL)
    torch.testing.assert_close(logit_diff(logits).mean(), ref["clean_metric"], **TOL)


def test_residual_stream_by_layer_and_position(reference):
    _, ref, _ = reference
    layers = ["layers.0", "layers.1"]
    torch.testing.assert_close(sweep(reference, layers, site="input"), ref["resid_pre"], **TOL)
    torch.testing.assert_close(
        sweep(reference, layers, site="input", per_example=True), ref["resid_pre_per_example"], **TOL
    )
    normalized = sweep(reference, layers, site="input", normalize=True)
    torch.testing.assert_close(normalized, ref["resid_pre_normalized"], **TOL)


def test_attention_and_mlp_outputs(reference):
    _, ref, _ = reference
    torch.testing.assert_close(sweep(reference, "layers.*.attn", element=0), ref["block_every"][1], **TOL)
    torch.testing.assert_close(sweep(reference, "layers.*.mlp"), ref["block_every"][2], **TOL)
    torch.testing.assert_close(sweep(reference, "layers.?", site="input"), ref["block_every"][0], **TOL)


def test_per_head_outputs(reference):
    _, ref, _ = reference
    kwargs = {"site": "input", "heads": 4}
    torch.testing.assert_close(
        sweep(reference, "layers.*.attn.o", positions=False, **kwargs), ref["attn_head_out_all_pos"], **TOL
    )
    by_pos = sweep(reference, "layers.*.attn.o", **kwargs)
    torch.testing.assert_close(by_pos, ref["attn_head_out_by_pos"], **TOL)
    batched = sweep(reference, "layers.*.attn.o", cells_per_forward=6, **kwargs)
    torch.testing.assert_close(batched, by_pos, rtol=0, atol=1e-6)  # other batch sizes: other float rounding


def test_clean_into_itself_changes_nothing_exactly(reference):
    model, ref, logit_diff = reference
    clean = ref["clean_tokens"]
    metric = lambda logits: logit_diff(logits).mean()  # noqa: E731
    with torch.no_grad():
        clean_metric = metric(model(clean))
    result = activation_patching(model, clean, clean, "layers.*.attn.o", metric, site="input", heads=4, progress=False)
    assert torch.equal(result, torch.full_like(result, clean_metric.item()))


def test_patching_every_position_gives_the_clean_metric(reference):
    model, ref, logit_diff = reference
    with torch.no_grad():
        clean_metric = logit_diff(model(ref["clean_tokens"])).mean().item()
    for layers, kwargs in [("layers.?", {"site": "input"}), ("layers.*.mlp", {}), ("layers.*.attn", {"element": 0})]:
        whole = sweep(reference, layers, positions=False, **kwargs)
        assert whole.shape == (2,)
        # the residual stream carries everything: patching all of it is the clean run, to the last bit
        exact = layers == "layers.?"
        target = torch.full_like(whole, clean_metric)
        assert torch.equal(whole, target) if exact else not torch.allclose(whole, target)


def test_noising_equals_a_hand_made_patch(reference):
    model, ref, logit_diff = reference
    noised = sweep(reference, ["layers.1.mlp"], direction="noise", positions=[2, -1])
    with record(model, "layers.1.mlp") as corrupted_acts:
        model(ref["corrupted_tokens"])
    for column, position in enumerate([2, -1]):
        with patch(model, {"layers.1.mlp": Patch(corrupted_acts["layers.1.mlp"], index=(slice(None), position))}):
            expected = logit_diff(model(ref["clean_tokens"])).mean()
        torch.testing.assert_close(noised[0, column], expected.detach(), **TOL)


def test_record_and_patch_context_managers(reference):
    model, ref, _ = reference
    before = hook_state(model)
    x = ref["clean_tokens"]
    with (
        record(model, ["layers.0.attn", "layers.0.attn.o"], element=None, site="output") as acts,
        pytest.raises(TypeError, match=r"is a tuple: pass element=i"),
    ):
        model(x)
    with record(model, "layers.0.attn", element=1) as acts:
        model(x)
    assert acts["layers.0.attn"].shape == (4, 4, 8, 8)  # the attention pattern (batch, heads, query, key)
    torch.testing.assert_close(acts["layers.0.attn"].sum(-1), torch.ones(4, 4, 8))
    with record(model, "layers.0.attn.o", site="input") as heads:
        clean_logits = model(x)
    # a function patch through the einops head view, at one index: zero head 2 at every position
    every = slice(None)
    zero_head = Patch(lambda v: v * 0, index=(every, every, 2), pattern="b t (h d) -> b t h d", sizes={"h": 4})
    with patch(model, {"layers.0.attn.o": zero_head}, site="input"):
        with record(model, "layers.0.attn.o", site="input") as seen:
            patched_logits = model(x)  # the recorder, registered after the patch, sees the patched input
    with record(model, "layers.0.attn.o", site="input") as after:
        model(x)
    view, clean_view = seen["layers.0.attn.o"].view(4, 8, 4, 16), heads["layers.0.attn.o"].view(4, 8, 4, 16)
    assert torch.equal(view[:, :, 2], torch.zeros(4, 8, 16))
    assert torch.equal(view[:, :, [0, 1, 3]], clean_view[:, :, [0, 1, 3]])
    assert not torch.equal(patched_logits, clean_logits)
    torch.testing.assert_close(after["layers.0.attn.o"], heads["layers.0.attn.o"])  # the patch is gone
    # a tensor patch at one position of the output
    with (
        patch(model, {"layers.1.mlp": Patch(torch.zeros(4, 8, 64), index=(slice(None), 3))}),
        record(model, "layers.1.mlp") as mlp,
    ):
        model(x)
    assert torch.equal(mlp["layers.1.mlp"][:, 3], torch.zeros(4, 64)) and mlp["layers.1.mlp"][:, 2].abs().sum() > 0
    assert hook_state(model) == before


def test_metric_and_shape_errors_come_before_the_sweep(reference):
    model, ref, logit_diff = reference
    forwards = []
    handle = model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=r"same shapes; got \(4, 8\) and \(4, 7\)"):
            activation_patching(model, ref["clean_tokens"], ref["corrupted_tokens"][:, :7], "layers.0", logit_diff)
        assert forwards == []
        with pytest.raises(ValueError, match=r"must return a scalar tensor; got \(4,\) \(pass per_example=True\?\)"):
            activation_patching(model, ref["clean_tokens"], ref["corrupted_tokens"], "layers.0", logit_diff)
        with pytest.raises(IndexError, match="position 9 is out of range for 8 positions"):
            sweep(reference, "layers.0", positions=[9], site="input")
        with pytest.raises(ValueError, match="3 heads do not divide the last axis"):
            sweep(reference, "layers.0.attn.o", heads=3, site="input")
        with pytest.raises(KeyError, match=r"did you mean 'layers\.1'"):
            sweep(reference, "layer.1")
        assert len(forwards) <= 6  # only the clean and corrupted reference runs
    finally:
        handle.remove()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_no_hook_left_when_the_metric_raises_or_is_interrupted(reference, error):
    model, ref, logit_diff = reference
    before = hook_state(model)
    with torch.no_grad():
        expected = model(ref["clean_tokens"])
    calls = []

    def metric(logits):
        calls.append(1)
        if len(calls) == 5:
            raise error("stop")
        return logit_diff(logits).mean()

    with pytest.raises(error):
        activation_patching(model, ref["clean_tokens"], ref["corrupted_tokens"], "layers.*", metric, progress=False)
    assert hook_state(model) == before
    assert not model.training
    with torch.no_grad():
        torch.testing.assert_close(model(ref["clean_tokens"]), expected, rtol=0, atol=0)


def test_progress_bar_can_be_turned_off(reference, capsys):
    sweep(reference, "layers.0.mlp")
    assert "activation patching" not in capsys.readouterr().err


def test_works_for_a_cnn_and_keeps_the_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 2)).train()
    clean, corrupted = torch.randn(2, 3, 5, 5), torch.randn(2, 3, 5, 5)
    # positions are axis 1 of the activation: the channels of a conv output
    result = activation_patching(model, clean, corrupted, ["0", "1"], lambda out: out[:, 0].mean(), progress=False)
    assert result.shape == (2, 4) and model.training


def test_a_module_called_twice_gets_each_of_its_calls_back():
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            x = x + self.block(x)
            x = x + self.block(x)
            return self.head(x)

    model = Twice().eval()
    clean = torch.randn(2, 3, 4)
    metric = lambda out: out[:, -1].mean()  # noqa: E731
    with torch.no_grad():
        clean_metric = metric(model(clean))
    into_itself = activation_patching(model, clean, clean, "block", metric, progress=False)
    assert torch.equal(into_itself, torch.full_like(into_itself, clean_metric.item()))
    with record(model, "block") as acts:
        model(clean)
    assert len(acts.calls["block"]) == 2 and torch.equal(acts["block"], acts.calls["block"][1])


def test_head_patterns_with_other_axis_orders():
    model = nn.Sequential(nn.Identity())  # its output (b, t, h*d) is the site
    clean, corrupted = torch.zeros(1, 2, 4), torch.ones(1, 2, 4)
    metric = lambda out: out[0, 0, 2:].sum()  # head 1 at position 0 (two channels)  # noqa: E731
    default = activation_patching(model, clean, corrupted, "0", metric, heads=2, progress=False)
    swapped = activation_patching(
        model, clean, corrupted, "0", metric, heads=2, head_pattern="b t (h d) -> b h t d", progress=False
    )
    expected = torch.tensor([[[2.0, 0.0], [2.0, 2.0]]])  # (layer, position, head): zeroed only at (0, head 1)
    torch.testing.assert_close(default, expected)
    torch.testing.assert_close(swapped, expected)
    with pytest.raises(ValueError, match=r"must view the activation with plain axes named b \(batch\), h \(heads\)"):
        activation_patching(model, clean, corrupted, "0", metric, heads=2, head_pattern="b s (h d) -> b s h d")


def test_patch_globs_named_tuples_and_tensors_without_batch_axis():
    from typing import NamedTuple

    class Out(NamedTuple):
        out: torch.Tensor
        weights: torch.Tensor

    class Attn(nn.Module):
        def forward(self, x, table):
            return Out(x + table, x.abs())

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Attn(), Attn()

        def forward(self, x, table):
            return self.b(self.a(x, table).out, table).out

    model = Model()
    x, table = torch.randn(3, 2, 4), torch.randn(1, 2, 4)  # `table` has no batch axis to repeat
    with patch(model, {"[ab]": Patch(lambda v: v * 0, element=0)}):
        assert torch.equal(model(x, table), torch.zeros(3, 2, 4))
    one = activation_patching(
        model, (x, table), (x.flip(0), table), ["a", "b"], lambda o: o.sum(), element=0, progress=False
    )
    batched = activation_patching(
        model,
        (x, table),
        (x.flip(0), table),
        ["a", "b"],
        lambda o: o.sum(),
        element=0,
        cells_per_forward=3,
        progress=False,
    )
    torch.testing.assert_close(batched, one)
