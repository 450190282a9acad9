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
