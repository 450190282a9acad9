import torch
from torch import nn

from attribution.perturbation._incremental import IncrementalRunner, trace


class _Net(nn.Module):
    """Stride-2 convs, padding, dilation, max pool, BatchNorm, residual adds, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 5, stride=2, padding=2)
        self.bn = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.a = nn.Conv2d(6, 6, 3, padding=2, dilation=2)
        self.b = nn.Conv2d(6, 6, 3, padding=1)
        self.down = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.skip = nn.Conv2d(6, 8, 1, stride=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.stem(x))))
        x = x + self.b(torch.relu(self.a(x)))
        x = torch.relu(self.down(x)) + self.skip(x)
        return self.head(x.mean((2, 3)))


def test_incremental_outputs_equal_full_forwards_in_float64() -> None:
    torch.manual_seed(0)
    model = _Net().double().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 3, 37, 29, dtype=torch.float64)
    graph = trace(model)
    assert not isinstance(graph, str)
    with torch.no_grad():
        runner = IncrementalRunner(graph, x)
        for box in [((0, 5), (0, 7)), ((10, 21), (13, 16)), ((30, 37), (20, 29)), ((0, 37), (0, 29))]:
            y = x.clone()
            y[..., box[0][0] : box[0][1], box[1][0] : box[1][1]] = 0.0
            torch.testing.assert_close(runner.run(y, box), model(y), rtol=1e-10, atol=0)


def test_untraceable_models_give_the_reason() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    reason = trace(Branchy())
    assert isinstance(reason, str) and "cannot trace Branchy" in reason
