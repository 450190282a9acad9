import warnings

import pytest
import torch
from torch import nn

from attribution import Occlusion


class _TinyResNet(nn.Module):
    """A stem with BatchNorm and max pool, a basic block, a downsampling block (1x1 stride-2 skip), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.a = nn.Sequential(nn.Conv2d(4, 4, 3, 1, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, 1, 1))
        self.b = nn.Sequential(nn.Conv2d(4, 6, 3, 2, 1), nn.ReLU(), nn.Conv2d(6, 6, 3, 1, 1))
        self.down = nn.Conv2d(4, 6, 1, 2)
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stem(x))
        x = torch.relu(x + self.a(x))
        x = torch.relu(self.b(x) + self.down(x))
        return self.head(nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def _model() -> nn.Module:
    torch.manual_seed(3)
    model = _TinyResNet().double()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            nn.init.uniform_(module.running_mean, -0.5, 0.5)
            nn.init.uniform_(module.running_var, 0.5, 2.0)
            nn.init.uniform_(module.weight, -1.5, 1.5)
    return model


CASES = [
    ({"window": (3, 5, 4), "stride": (3, 2, 3)}, [0, 4]),
    ({"window": (2, 7, 4), "stride": (1, 6, 4), "baseline": -0.7}, [3, 1]),
    # groups of 4 windows mixing rows, the last windows cut at the edges: boxes widened to one size per group
    ({"window": (3, 6, 4), "stride": (3, 5, 3), "baseline": 0.4, "perturbations_per_forward": 4}, [1, 2]),
    (
        {"window": (3, 4, 6), "stride": 3, "baseline": torch.linspace(-1, 1, 2 * 3 * 13 * 10).reshape(2, 3, 13, 10)},
        None,
    ),
]


@pytest.mark.parametrize(("options", "target"), CASES)
def test_incremental_occlusion_equals_full_forwards(options: dict, target: list[int] | None) -> None:
    model = _model().train()  # left in train mode: the call runs in eval mode and restores it
    x = torch.randn(2, 3, 13, 10, dtype=torch.float64)
    before = [p.clone() for p in model.state_dict().values()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # incremental applies: no warning
        fast = Occlusion(model, incremental=True, show_progress=False, **options)
        ours = fast(x, target=target)
    full = Occlusion(model, incremental=False, show_progress=False, **options)(x, target=target)
    torch.testing.assert_close(ours, full, rtol=1e-10, atol=1e-12)
    assert (ours > 0).any() and (ours < 0).any()
    assert fast.forwards > full.shape[0]  # counted: one clean and one incremental run per item and window
    assert model.training and all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values(), strict=True))


def test_incremental_occlusion_matches_captum() -> None:
    captum = pytest.importorskip("captum.attr")
    model = _model().eval()
    x = torch.randn(2, 3, 13, 10, dtype=torch.float64)
    ours = Occlusion(model, (3, 5, 4), (3, 2, 3), baseline=0.25, show_progress=False)(x, target=[2, 0])
    theirs = captum.Occlusion(model).attribute(
        x, sliding_window_shapes=(3, 5, 4), strides=(3, 2, 3), baselines=0.25, target=[2, 0]
    )
    # captum accumulates and returns float32: 1e-6 relative to the largest attribution
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item())


def test_fallback_warns_with_the_reason_only_when_asked() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x).mean((2, 3))
            return y if x.sum() > 0 else -y

    model = Branchy().double()
    x = torch.rand(1, 3, 7, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="Occlusion runs full forwards: torch.fx cannot trace Branchy"):
        asked = Occlusion(model, (3, 3, 2), incremental=True, show_progress=False)(x, target=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = Occlusion(model, (3, 3, 2), incremental=None, show_progress=False)(x, target=1)
    torch.testing.assert_close(asked, auto, rtol=0, atol=0)
