"""At most one warning per cause per forward, saying what to do."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hooks import Recorder


class ConvBNAct(nn.Module):
    """timm's BatchNormAct pattern: an identity ``drop`` then an in-place activation on its output."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.drop = nn.Identity()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self.conv(x)))


def _runtime_warnings(model: nn.Module, x: torch.Tensor) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(model, "**", capture=("output", "grad_input", "grad_output")):
            model(x).sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_many_identity_outputs_written_in_place_give_one_warning_naming_them():
    torch.manual_seed(0)
    model = nn.Sequential(*[ConvBNAct(2) for _ in range(7)])
    messages = _runtime_warnings(model, torch.randn(1, 2, 5, 5))
    assert len(messages) == 1
    assert "7 module call(s)" in messages[0] and "'0.drop'" in messages[0] and "and 2 more" in messages[0]
    assert "Hook the module that writes in place" in messages[0]


@pytest.mark.slow
def test_a_timm_cnn_under_a_recorder_of_every_module_warns_at_most_once_per_forward():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=3).eval()
    assert len(_runtime_warnings(model, torch.randn(1, 3, 32, 32))) <= 1
