import pytest
import torch
from torch import nn

from attribution.perturbation._boxes import equal_sizes
from attribution.perturbation._incremental import IncrementalRunner, trace


def _crops(y: torch.Tensor, box: tuple[tuple[int, int], tuple[int, int]]) -> torch.Tensor:
    return y[..., box[0][0] : box[0][1], box[1][0] : box[1][1]]


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
            torch.testing.assert_close(runner.run(_crops(y, box), [box]), model(y), rtol=1e-10, atol=0)


def test_untraceable_models_give_the_reason() -> None:
    class Branchy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    reason = trace(Branchy())
    assert isinstance(reason, str) and "cannot trace Branchy" in reason


class _Downsample(nn.Module):
    """A resnet-style block: 3x3 stride-2 conv path plus a 1x1 stride-2 downsample on the skip, in-place ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.down = nn.Conv2d(4, 6, 1, stride=2, bias=False)
        self.lone = nn.Conv2d(6, 5, 1, stride=2)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.stem(x))
        x = self.relu(self.bn(self.conv(x)) + self.down(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(self.lone(x), 1), 1))


def test_one_by_one_stride_two_convs_with_odd_boxes_equal_full_forwards() -> None:
    """A box with an odd start and even length: a 1x1 stride-2 conv reads less than the changed box."""
    torch.manual_seed(1)
    model = _Downsample().double().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 3, 23, 18, dtype=torch.float64)
    graph = trace(model)
    assert not isinstance(graph, str)
    expected = [model(y) for y in [x]]
    with torch.no_grad():
        runner = IncrementalRunner(graph, x)
        for box in [((3, 7), (5, 9)), ((1, 3), (3, 5)), ((3, 4), (7, 8)), ((21, 23), (0, 18)), ((0, 23), (1, 17))]:
            y = x.clone()
            y[..., box[0][0] : box[0][1], box[1][0] : box[1][1]] = -1.5
            torch.testing.assert_close(runner.run(_crops(y, box), [box]), model(y), rtol=1e-10, atol=0)
        torch.testing.assert_close(model(x), expected[0], rtol=0, atol=0)  # the clean pass left the model as found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_torchvision_resnets_equal_full_forwards_in_float64(name: str) -> None:
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(2)
    model = getattr(models, name)(weights=None).double().eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # non-trivial running statistics
            nn.init.uniform_(module.running_mean, -0.2, 0.2)
            nn.init.uniform_(module.running_var, 0.5, 1.5)
    x = torch.randn(1, 3, 64, 80, dtype=torch.float64)
    graph = trace(model)
    assert not isinstance(graph, str)
    with torch.no_grad():
        runner = IncrementalRunner(graph, x)
        for box in [((3, 19), (5, 21)), ((0, 16), (61, 80)), ((33, 35), (1, 2)), ((48, 64), (0, 80))]:
            y = x.clone()
            y[..., box[0][0] : box[0][1], box[1][0] : box[1][1]] = 0.0
            torch.testing.assert_close(runner.run(_crops(y, box), [box]), model(y), rtol=1e-10, atol=1e-12)


def _group(y: torch.Tensor, boxes: list[tuple[tuple[int, int], tuple[int, int]]], value: float) -> torch.Tensor:
    """Per box, the image ``y`` with the box set to ``value``, stacked."""
    images = y.repeat(len(boxes), 1, 1, 1)
    for i, ((a, b), (c, d)) in enumerate(boxes):
        images[i, :, a:b, c:d] = value
    return images


@pytest.mark.parametrize("model_class", [_Net, _Downsample])
def test_a_group_of_windows_of_different_sizes_at_the_borders_equals_full_forwards(model_class: type) -> None:
    """Corner, edge and interior windows in one group: their boxes widened to one size, one stacked run per node."""
    torch.manual_seed(4)
    model = model_class().double().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 3, 31, 22, dtype=torch.float64)
    changes = [((0, 6), (0, 4)), ((27, 31), (19, 22)), ((12, 17), (0, 22)), ((3, 4), (7, 8)), ((9, 11), (17, 22))]
    windows = equal_sizes(changes, (31, 22))
    assert windows is not None and len({(b - a, d - c) for (a, b), (c, d) in windows}) == 1
    for (rows, cols), ((a, b), (c, d)) in zip(windows, changes, strict=True):  # each holds its change
        assert rows[0] <= a and b <= rows[1] and cols[0] <= c and d <= cols[1]
    graph = trace(model)
    assert not isinstance(graph, str)
    images = _group(x, changes, -0.8)
    crops = torch.stack([images[i, :, a:b, c:d] for i, ((a, b), (c, d)) in enumerate(windows)])
    with torch.no_grad():
        runner = IncrementalRunner(graph, x)
        ours = runner.run(crops, windows)
    torch.testing.assert_close(ours, model(images), rtol=1e-10, atol=1e-12)
    assert len({tuple(row.tolist()) for row in ours}) == len(changes)  # each window changes the output


class _Pools(nn.Module):
    """A max pool over negative values (its padding must not read as 0), a 1x1 stride-2 conv on the input (blind to
    odd rows and columns), ``y + y``, an addition whose second input changes more than its first, a broadcast one."""

    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Conv2d(3, 4, 1, 2)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.down = nn.Conv2d(4, 4, 3, padding=1)
        self.shift = nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]).reshape(1, 4, 1, 1))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.skip(x)
        y = self.pool(self.conv(x))
        y = y + y
        x = y + self.down(y) + skip + self.shift
        return self.head(x.mean((2, 3)))


def test_pools_strided_skips_and_additions_in_a_group_equal_full_forwards() -> None:
    torch.manual_seed(5)
    model = _Pools().double().eval()
    with torch.no_grad():
        model.conv.bias.fill_(-4.0)  # every activation negative: a pool window at the border takes a negative max
    x = torch.rand(1, 3, 25, 18, dtype=torch.float64)
    graph = trace(model)
    assert not isinstance(graph, str)
    runner = IncrementalRunner(graph, x)
    # the second group: one odd pixel, which the stride-2 skip does not see, beside an even one, which it sees
    for changes in (
        [((0, 4), (0, 5)), ((21, 25), (13, 18)), ((8, 12), (6, 11))],
        [((13, 14), (9, 10)), ((6, 7), (4, 5))],
    ):
        windows = equal_sizes(changes, (25, 18))
        assert windows is not None
        images = _group(x, changes, 0.9)
        crops = torch.stack([images[i, :, a:b, c:d] for i, ((a, b), (c, d)) in enumerate(windows)])
        with torch.no_grad():
            ours = runner.run(crops, windows)
            assert (model.pool(model.conv(x)) < 0).all()
        torch.testing.assert_close(ours, model(images), rtol=1e-10, atol=1e-12)
    assert torch.equal(model.skip(images[:1]), model.skip(x)) and not torch.equal(model.skip(images[1:]), model.skip(x))
