"""intervention_sweep: known IIA per cell on the hand-built MLP, DAS on a trained MLP, labels, the plot, bad input."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from torch import nn

from attribution.causal import InterventionSweep, RotatedSubspace, Site, intervention_sweep
from attribution.causal.sweep import site_label
from tests.attribution.causal.equality import V, causal_model, hand_built, triples

matplotlib.use("Agg")


def identity_rotation(width: int, k: int) -> RotatedSubspace:
    """A DAS intervention whose rotation is the identity (with ``lr=0`` it stays so): the first ``k`` coordinates."""
    iv = RotatedSubspace(width, k).double()
    iv.rotation = torch.eye(width, dtype=torch.float64)
    return iv


def objects_of(inputs: torch.Tensor) -> torch.Tensor:
    """The object ids back from the one-hot inputs ``(n, 4 * V)``."""
    return inputs.unflatten(1, (4, V)).argmax(-1)


def test_each_cell_is_the_iia_the_causal_model_predicts():
    model = hand_built()  # layer "2": coordinate 0 holds a == b, coordinate 1 holds c == d
    train, test = triples(64, 0, "left"), triples(300, 1, "left")
    before = [p.clone() for p in model.parameters()]
    sweep = intervention_sweep(
        model, train, test, {"hidden": Site("2")}, ks=[0, 1, 2, 4], intervention=identity_rotation, lr=0.0,
        progress=False,
    )  # fmt: skip
    base, source = objects_of(test[0]), objects_of(test[1])
    b_left, b_right, _ = causal_model(base)
    s_left, s_right, _ = causal_model(source)
    # k=0: the base's own output (b_left == b_right) against the label s_left == b_right: right where b_left == s_left
    # k=1: coordinate 0 swapped, exactly the counterfactual; k=2: both bits swapped, right where s_right == b_right;
    # k=4, the whole width: the source's own output, the same (coordinates 2 and 3 are unused), with no training
    both = (s_right == b_right).double().mean()
    expected = [(b_left == s_left).double().mean(), 1.0, both, both]
    torch.testing.assert_close(sweep.iia[0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert 0.2 < expected[0] < 0.8 and 0.2 < expected[2] < 0.8  # the three cells differ: no lucky constant
    assert sweep.iia.axes == ("site", "k") and sweep.iia.labels == {"site": ["hidden"], "k": [0, 1, 2, 4]}
    assert sweep.best() == ("hidden", 1, 1.0)
    assert sorted(sweep.interventions) == [("hidden", 0), ("hidden", 1), ("hidden", 2), ("hidden", 4)]
    assert type(sweep.interventions["hidden", 4]).__name__ == "Interchange"  # the whole width is a plain swap
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_the_plot_is_labelled_with_the_sites_and_ks():
    model = hand_built()
    data = triples(32, 2, "right")
    sweep = intervention_sweep(
        model, data, data, [Site("2"), Site("0")], ks=[0, 1], intervention=identity_rotation, lr=0.0, progress=False
    )
    ax = sweep.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["2", "0"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["k=0", "k=1"]
    assert ax.images[0].get_clim() == (0.0, 1.0)
    assert len(ax.texts) == 4  # every cell's value written


def test_site_labels_name_positions_heads_and_inputs():
    assert site_label(Site("model.layers.1", positions=[3, -1])) == "model.layers.1 @3,-1"
    assert site_label(Site("attn.o_proj", site="input", heads=[0, 2])) == "attn.o_proj.input H0,2"
    assert site_label(Site(nn.Linear(2, 2))) == "Linear"


def test_bad_sweeps_are_named():
    model = hand_built()
    data = triples(16, 3, "left")
    with pytest.raises(ValueError, match="ks"):
        intervention_sweep(model, data, data, [Site("2")], ks=[-1], progress=False)
    with pytest.raises(TypeError, match="unknown training settings"):
        intervention_sweep(model, data, data, [Site("2")], ks=[1], epoch=3, progress=False)
    with pytest.raises(ValueError, match="same label"):
        intervention_sweep(model, data, data, [Site("2"), Site("2")], ks=[1], progress=False)
    with pytest.raises(TypeError, match="base, sources, labels"):
        intervention_sweep(model, data[:2], data, [Site("2")], ks=[1], progress=False)
    with pytest.raises(ValueError, match=r"labels.*shape \(16,\)"):
        intervention_sweep(model, (*data[:2], data[2][:3]), data, [Site("2")], ks=[1], progress=False)
    with pytest.raises(ValueError, match="k"):
        intervention_sweep(model, data, data, [Site("2")], ks=[5], progress=False)  # the site is 4 wide


# --- DAS on a trained MLP (pyvene's hierarchical-equality tutorial, objects as vectors) ---------------------------
D, N = 4, 20  # objects: 20 fixed random vectors in R^4; an input is four of them side by side


def draw(n: int, g: torch.Generator) -> torch.Tensor:
    """``(n, 4)`` object ids with each pair equal half the time."""
    ids = torch.randint(0, N, (n, 4), generator=g)
    same = torch.rand(n, 2, generator=g) < 0.5
    ids[:, 1] = torch.where(same[:, 0], ids[:, 0], ids[:, 1])
    ids[:, 3] = torch.where(same[:, 1], ids[:, 2], ids[:, 3])
    return ids


def label(ids: torch.Tensor, left: torch.Tensor | None = None) -> torch.Tensor:
    left = ids[:, 0] == ids[:, 1] if left is None else left
    return (left == (ids[:, 2] == ids[:, 3])).long()


@pytest.mark.slow
def test_das_on_a_trained_mlp_finds_the_left_equality_in_the_first_layer():
    g = torch.Generator().manual_seed(0)
    pool = torch.rand(N, D, generator=g) * 2 - 1
    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(
        nn.Linear(4 * D, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
    )
    model.append(nn.Linear(width, 2))
    ids = draw(10_000, g)
    x, y = pool[ids].flatten(1), label(ids)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(10):
        for rows in torch.randperm(len(x), generator=g).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
    model.eval()
    held = draw(1000, g)
    assert (model(pool[held].flatten(1)).argmax(1) == label(held)).double().mean() > 0.98

    def das_triples(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        base, source = draw(n, g), draw(n, g)
        return pool[base].flatten(1), pool[source].flatten(1), label(base, left=source[:, 0] == source[:, 1])

    train, test = das_triples(6000), das_triples(1000)
    torch.manual_seed(0)  # the rotation's initialisation
    sweep = intervention_sweep(model, train, test, [Site("0")], ks=[0, 16], epochs=5, lr=3e-3, progress=False)
    floor, das = sweep.iia[0].tolist()
    assert floor < 0.6  # no intervention: the base's output is right only by chance
    # measured 0.98 (0.96-0.99 over model seeds 0-3); pyvene reports 0.97 on its MLP. After the ReLU (layer "1") the
    # same search reaches only 0.83-0.89 with k = 16 and 0.77-0.95 with k = 4: the variable is linear before it.
    assert das >= 0.9
    assert isinstance(sweep, InterventionSweep)


def test_a_sweep_on_a_language_model_equals_one_call_per_cell_and_runs_each_source_and_prefix_once():
    from attribution.causal import Interchange, interchange_intervention_accuracy, train_intervention
    from tests.attribution.models import lm64

    model = lm64("llama")
    g = torch.Generator().manual_seed(5)
    train = (torch.randint(0, 40, (12, 7), generator=g), torch.randint(0, 40, (12, 7), generator=g))
    train = (*train, torch.randint(0, 40, (12,), generator=g))
    test = (torch.randint(0, 40, (9, 7), generator=g), torch.randint(0, 40, (9, 7), generator=g))
    test = (*test, model(test[1]).logits[:, -1].argmax(-1))  # the source's own answers: full patching scores 1
    sites = {"L0 @6": Site("model.layers.0", positions=[6]), "L1 @4,6": Site("model.layers.1", positions=[4, 6])}

    def make(width: int, k: int) -> RotatedSubspace:
        torch.manual_seed(width + k)
        return RotatedSubspace(width, k).double()

    rows: dict[int, int] = {}  # positions of a run -> rows run at that length
    hook = model.model.embed_tokens.register_forward_pre_hook(
        lambda m, args: rows.__setitem__(args[0].shape[1], rows.get(args[0].shape[1], 0) + args[0].shape[0])
    )
    try:
        sweep = intervention_sweep(
            model, train, test, sites, ks=[0, 2, "all"], intervention=make, epochs=2, lr=0.05, batch_size=5,
            progress=False,
        )  # fmt: skip
    finally:
        hook.remove()
    # whole prompts (7): the 12 train and 9 test sources once; prefixes once per first position (6 and 4) and set;
    # every step and score only the suffix (1 or 3 positions)
    assert {n: rows[n] for n in (7, 6, 4)} == {7: 21, 6: 21, 4: 21} and set(rows) == {7, 6, 4, 3, 1}
    for i, site in enumerate(sites.values()):
        expected = [
            interchange_intervention_accuracy(model, test[0], test[0], test[2], Interchange(), site),
            interchange_intervention_accuracy(
                model, *test, train_intervention(model, *train, make(16, 2), site, epochs=2, lr=0.05, batch_size=5),
                site,
            ),
            interchange_intervention_accuracy(model, *test, Interchange(), site),
        ]  # fmt: skip
        assert sweep.iia[i].tolist() == expected
        torch.testing.assert_close(
            sweep.interventions[list(sites)[i], 2].rotation,
            train_intervention(model, *train, make(16, 2), site, epochs=2, lr=0.05, batch_size=5).rotation,
            rtol=0, atol=1e-12,
        )  # fmt: skip
    assert sweep.iia[1, 2] == 1.0  # every position from the source: its own answer
