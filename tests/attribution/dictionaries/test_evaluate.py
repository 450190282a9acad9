"""evaluate_dictionary: every number of the report against a hand computation on a float64 language model."""

from __future__ import annotations

import math

import pytest
import torch

from attribution import SAE, Transcoder, evaluate_dictionary
from tests.attribution.models import lm64
from tests.support import hook_state

SITE = "model.layers.1.mlp"


@pytest.fixture(scope="module")
def model():
    lm = lm64("llama")
    with torch.no_grad():  # a layer-1 MLP whose output matters: zero-ablating it changes the loss
        lm.get_submodule(SITE).down_proj.weight.mul_(40)
    return lm


def batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 40, (2, 6), generator=g), torch.randint(0, 40, (3, 6), generator=g)]


def hand_logits(model, ids, replace=None):
    """Logits of a plain run, the site's output replaced by ``replace(input, output)`` through a PyTorch hook."""
    handle = None
    if replace is not None:
        handle = model.get_submodule(SITE).register_forward_hook(lambda m, a, out: replace(a[0], out))
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        if handle is not None:
            handle.remove()


def hand_ce(logits, ids):
    """Mean over batch x (tokens - 1) of -log softmax(logits[t])[ids[t + 1]], one position at a time."""
    values = []
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            values.append(-float(torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]]))
    return values


def hand_report(model, dictionary, transcoder=False):
    ys, sources, ce, kls = [], [], {"clean": [], "spliced": [], "zero": []}, []
    for ids in batches():
        seen = {}
        clean = hand_logits(model, ids, lambda i, o, seen=seen: seen.update(i=i, o=o))
        spliced = hand_logits(model, ids, lambda i, o: dictionary(i if transcoder else o))
        zero = hand_logits(model, ids, lambda i, o: torch.zeros_like(o))
        ys.append(seen["o"].reshape(-1, 16))
        sources.append((seen["i"] if transcoder else seen["o"]).reshape(-1, 16))
        for name, logits in (("clean", clean), ("spliced", spliced), ("zero", zero)):
            ce[name] += hand_ce(logits, ids)
        p, q = torch.softmax(clean, -1), torch.softmax(spliced, -1)
        kls += [float((p[b, t] * (p[b, t].log() - q[b, t].log())).sum()) for b in range(len(ids)) for t in range(6)]
    y, src = torch.cat(ys), torch.cat(sources)
    f = dictionary.encode(src).detach()
    y_hat = dictionary(src).detach()
    fvu = float((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    losses = {name: sum(v) / len(v) for name, v in ce.items()}
    return {
        "fvu": fvu,
        "l0": float((f != 0).sum(-1).double().mean()),
        "dead_fraction": float(((f != 0).sum(0) == 0).double().mean()),
        "loss_clean": losses["clean"],
        "loss_spliced": losses["spliced"],
        "loss_zero": losses["zero"],
        "loss_recovered": (losses["zero"] - losses["spliced"]) / (losses["zero"] - losses["clean"]),
        "kl": sum(kls) / len(kls),
        "tokens": 30,
    }


@pytest.mark.parametrize("kind", ["sae", "transcoder"])
def test_the_report_equals_the_hand_computation(model, kind):
    torch.manual_seed(0)
    if kind == "sae":
        dictionary = SAE(16, 64, activation="topk", k=4).double()
    else:
        dictionary = Transcoder(16, 16, 64, activation="relu", skip=True).double()
    with torch.no_grad():
        dictionary.b_enc[::2] = -1e3  # half of the features never fire: a real dead fraction
    before = hook_state(model)
    report = evaluate_dictionary(model, batches(), SITE, dictionary, progress=False)
    expected = hand_report(model, dictionary, transcoder=kind == "transcoder")
    for name, value in expected.items():
        assert math.isclose(getattr(report, name), value, rel_tol=1e-9, abs_tol=1e-12), (
            name,
            getattr(report, name),
            value,
        )
    assert 0.5 <= report.dead_fraction < 1 and report.l0 > 0 and abs(report.loss_zero - report.loss_clean) > 1e-3
    assert hook_state(model) == before and "FVU" in str(report)


def shift_lm(gain: float, vocab: int = 7) -> torch.nn.Module:
    """A language model that predicts ``token + 1``: one-hot embedding, the site (a shift by one, times ``gain``), the
    identity as unembedding. With a large gain the site carries the prediction; with a tiny one it hardly matters."""
    lm = torch.nn.Sequential(torch.nn.Embedding(vocab, vocab), torch.nn.Linear(vocab, vocab), torch.nn.Identity())
    lm = lm.double().eval()  # before the weights are set: the gain exactly in float64
    with torch.no_grad():
        lm[0].weight.copy_(torch.eye(vocab))
        lm[1].weight.copy_(torch.eye(vocab, dtype=torch.float64).roll(1, 0) * gain)
        lm[1].bias.zero_()
    return lm


def shift_batches(vocab: int = 7):
    starts = torch.tensor([[0], [3], [5]])
    return [(starts + torch.arange(6)) % vocab]


def test_a_site_whose_ablation_matters_gives_a_well_conditioned_loss_recovered(no_warnings):
    report = evaluate_dictionary(
        shift_lm(8.0), shift_batches(), "1", SAE(7, 14, activation="relu").double(), progress=False
    )
    assert report.loss_clean < 0.01 and math.isclose(report.loss_zero, math.log(7), rel_tol=1e-12)
    assert not report.ill_conditioned and "ill-conditioned" not in str(report)


def test_an_ill_conditioned_loss_recovered_is_said_in_a_warning_and_the_report():
    """Gain g = 1e-3: clean loss ln(6 + e^g) - g, zero-ablated ln 7; the gap is about g (1 - 1/7), 0.04% of ln 7."""
    clean, zero = math.log(6 + math.exp(1e-3)) - 1e-3, math.log(7)
    with pytest.warns(
        UserWarning,
        match=rf"loss recovered \(.*%\) is ill-conditioned at `site` '1': zero-ablating it moves the loss from "
        rf"{clean:.4f} to {zero:.4f} nats \(\+0\.04%, expected at least \+5%\)",
    ):
        report = evaluate_dictionary(
            shift_lm(1e-3), shift_batches(), "1", SAE(7, 14, activation="relu").double(), progress=False
        )
    assert math.isclose(report.loss_clean, clean, rel_tol=1e-12) and math.isclose(report.loss_zero, zero, rel_tol=1e-12)
    assert report.ill_conditioned and "ill-conditioned: zero-ablation barely changes the loss" in str(report)
