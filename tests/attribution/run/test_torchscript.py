"""Every family refuses a TorchScript model with hooks' own error, before it reads the model's structure."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import attribution as A

X = torch.randn(2, 3, 8, 8)
IDS = torch.tensor([[1, 0, 1]])


def _metric(out: torch.Tensor) -> torch.Tensor:
    return out[:, 0].sum()


METHODS: dict[str, Callable[[nn.Module], Any]] = {
    "GradCAM": lambda m: A.GradCAM(m, "0")(X, 0),
    "ScoreCAM": lambda m: A.ScoreCAM(m, "0")(X, 0),
    "Saliency": lambda m: A.Saliency(m)(X, 0),
    "Saliency(layer)": lambda m: A.Saliency(m, layer="0")(X, 0),
    "IntegratedGradients": lambda m: A.IntegratedGradients(m, steps=2)(X, 0),
    "GuidedGradCAM": lambda m: A.GuidedGradCAM(m, "0")(X, 0),
    "LRP": lambda m: A.LRP(m)(X, 0),
    "AttentionRollout": lambda m: A.AttentionRollout(m)(X),
    "GradientRollout": lambda m: A.GradientRollout(m)(X, 0),
    "activation_patching": lambda m: A.activation_patching(m, X, X + 1, "0", _metric, progress=False),
    "attribution_patching": lambda m: A.attribution_patching(m, X, X + 1, "0", _metric, progress=False),
    "record": lambda m: A.record(m, "0").__enter__(),
    "edge_attribution": lambda m: A.edge_attribution(m, X, X + 1, _metric, progress=False),
    "logit_lens": lambda m: A.logit_lens(m, IDS),
    "direct_logit_attribution": lambda m: A.direct_logit_attribution(m, IDS, 1),
    "AttnLRP": lambda m: A.AttnLRP(m),
    "attribute_generation": lambda m: A.attribute_generation(m, IDS, generated=IDS[0, :1]),
    "lm_layout": lambda m: A.lens.lm_layout(m),
}


@pytest.mark.parametrize("convert", ["script", "trace"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_torchscript_model_gets_hooks_error(method: str, convert: str) -> None:
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        model = torch.jit.script(eager) if convert == "script" else torch.jit.trace(eager, X)
    with pytest.raises(TypeError, match=r"`model` is a TorchScript module .*cannot call Python hooks.*eager"):
        METHODS[method](model)


def test_hooks_resolve_refuses_a_torchscript_model() -> None:
    """The name resolution of hooks, which the CAMs and layer variants use, not PyTorch's get_submodule error."""
    from hooks import resolve

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.jit.script(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"`model` is a TorchScript module"):
        resolve(model, "0")
