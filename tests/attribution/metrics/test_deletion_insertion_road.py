"""Deletion, insertion and ROAD end to end: numbers worked out by hand, target forms, the model left as it was found."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
import torch
from torch import nn

from attribution import GradCAM, targets
from attribution.metrics import deletion, deletion_insertion, insertion, road
from tests.support import hook_state


class PixelSum(nn.Module):
    """Two logits: the sum of all input values, and 0 (so class 0's probability is sigmoid(sum))."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(x))
        total = x.sum(dim=(1, 2, 3))
        return torch.stack([total, torch.zeros_like(total)], dim=1)


IMAGE = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 1, 2, 2)
MAP = torch.tensor([[0.9, 0.1], [0.5, 0.7]]).view(1, 2, 2)  # order: (0, 0), (1, 1), (1, 0), (0, 1)


def test_deletion_by_hand():
    result = deletion(PixelSum(), IMAGE, MAP, 0, steps=4, score="logit")
    assert result.kind == "deletion"
    assert result.fractions.tolist() == [0, 0.25, 0.5, 0.75, 1]
    assert result.scores.tolist() == [[10, 9, 5, 2, 0]]  # removes 1, then 4, then 3, then 2
    assert result.auc.tolist() == [pytest.approx(0.25 * (9.5 + 7 + 3.5 + 1))]
    probability = deletion(PixelSum(), IMAGE, MAP, 0, steps=4)
    expected = [1 / (1 + math.exp(-s)) for s in (10, 9, 5, 2, 0)]
    assert probability.scores[0].tolist() == pytest.approx(expected)


def test_insertion_by_hand():
    result = insertion(PixelSum(), IMAGE, MAP, 0, steps=4, score="logit", baseline="zeros")
    assert result.scores.tolist() == [[0, 1, 5, 8, 10]]
    assert result.auc.tolist() == [pytest.approx(0.25 * (0.5 + 3 + 6.5 + 9))]
    mean = insertion(PixelSum(), IMAGE, MAP, 0, steps=2, score="logit", baseline="mean")
    assert mean.scores.tolist() == [[10, 2.5 * 2 + 1 + 4, 10]]  # the mean image sums to the image's sum


def test_deletion_insertion_by_hand_runs_the_shared_points_once():
    model = PixelSum()
    removed, revealed = deletion_insertion(model, IMAGE, MAP, 0, baselines=("zeros", "zeros"), steps=4, score="logit")
    assert (removed.kind, revealed.kind) == ("deletion", "insertion")
    assert removed.scores.tolist() == [[10, 9, 5, 2, 0]]
    assert revealed.scores.tolist() == [[0, 1, 5, 8, 10]]
    assert model.calls == [1, 7]  # the unperturbed image, then 4 deletion points and 3 insertion points: 2 * steps
    model.calls.clear()
    removed, revealed = deletion_insertion(model, IMAGE, MAP, 0, baselines=("zeros", "mean"), steps=2, score="logit")
    assert revealed.scores.tolist() == [[10, 2.5 * 2 + 1 + 4, 10]]  # as insertion(baseline="mean") by hand
    assert model.calls == [1, 4]  # two baselines: insertion's all-baseline point is its own forward


@pytest.mark.parametrize("baselines", [("zeros", "blur"), ("mean", "mean")])
def test_deletion_insertion_equals_the_two_calls(baselines):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 6))
    model = model.double().eval()
    images, maps = torch.randn(3, 3, 12, 12, dtype=torch.float64), torch.rand(3, 12, 12)
    both = deletion_insertion(model, images, maps, [1, 2, 3], baselines=baselines, steps=7, batch_size=5)
    apart = (
        deletion(model, images, maps, [1, 2, 3], baseline=baselines[0], steps=7, batch_size=5),
        insertion(model, images, maps, [1, 2, 3], baseline=baselines[1], steps=7, batch_size=5),
    )
    for combined, alone in zip(both, apart, strict=True):
        assert combined.kind == alone.kind
        torch.testing.assert_close(combined.fractions, alone.fractions)
        torch.testing.assert_close(combined.scores, alone.scores, rtol=1e-12, atol=1e-12)  # other batches, float64
        torch.testing.assert_close(combined.auc, alone.auc, rtol=1e-12, atol=1e-12)
    by_callable = deletion_insertion(model, images, maps, targets.ClassLogit([1, 2, 3]), baselines=baselines, steps=7)
    by_class = deletion_insertion(model, images, maps, [1, 2, 3], baselines=baselines, steps=7, score="logit")
    for a, b in zip(by_callable, by_class, strict=True):
        torch.testing.assert_close(a.scores, b.scores)
    with pytest.raises(TypeError, match="pair"):
        deletion_insertion(model, images, maps, baselines="zeros")


def test_steps_that_do_not_divide_the_pixels_and_batches_of_any_size():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 6)).eval()
    images, maps = torch.randn(3, 3, 10, 10), torch.rand(3, 10, 10)
    one = deletion(model, images, maps, steps=7, batch_size=1)
    assert one.fractions.tolist() == pytest.approx([(k * 100 // 7) / 100 for k in range(8)])
    many = deletion(model, images, maps, steps=7, batch_size=64)
    torch.testing.assert_close(one.scores, many.scores)
    alone = deletion(model, images[1:2], maps[1:2], steps=7)
    torch.testing.assert_close(alone.scores[0], many.scores[1])
    single = insertion(model, images[0], maps[0], steps=7)  # (C, H, W) with (H, W): a batch of one
    assert single.scores.shape == (1, 8)


def test_the_batches_of_perturbed_images_are_full():
    model = PixelSum()
    deletion(model, IMAGE.expand(3, -1, -1, -1), MAP.expand(3, -1, -1), 0, steps=4, batch_size=5)
    assert model.calls == [3, 5, 5, 2]  # the unperturbed batch, then 12 perturbed images in batches of 5


def test_target_forms_agree():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 5)).eval()
    images, maps = torch.randn(2, 3, 6, 6), torch.rand(2, 6, 6)
    with torch.no_grad():
        top = model(images).argmax(dim=1).tolist()
    by_none = deletion(model, images, maps, steps=4)
    by_list = deletion(model, images, maps, top, steps=4)
    by_tensor = deletion(model, images, maps, torch.tensor(top), steps=4)
    by_callable = deletion(
        model, images, maps, lambda out: out.softmax(dim=1).gather(1, out.argmax(dim=1)[:, None])[:, 0], steps=4
    )
    torch.testing.assert_close(by_list.scores, by_none.scores)
    torch.testing.assert_close(by_tensor.scores, by_none.scores)
    assert by_callable.scores[:, 0].tolist() == pytest.approx(by_none.scores[:, 0].tolist())  # same class unperturbed
    logits = deletion(model, images, maps, 3, steps=4, score="logit")
    with torch.no_grad():
        assert logits.scores[:, 0].tolist() == pytest.approx(model(images)[:, 3].tolist(), abs=1e-6)


def test_callable_targets_get_one_copy_of_each_image_in_batch_order():
    # a target with one class per image must see its images' copies in their rows, whatever the batch size
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 5)).eval()
    images, maps, classes = torch.randn(3, 3, 6, 6), torch.rand(3, 6, 6), [4, 0, 2]
    for batch_size in (1, 7, 100):  # groups of 3 rows: one, two (sliced) and all of them per forward
        by_class = deletion(model, images, maps, classes, steps=4, score="logit", batch_size=batch_size)
        by_callable = deletion(model, images, maps, targets.ClassLogit(classes), steps=4, batch_size=batch_size)
        torch.testing.assert_close(by_callable.scores, by_class.scores)
        gap = road(model, images, maps, targets.ClassLogit(classes), percentiles=[30, 60], batch_size=batch_size)
        gap_by_class = road(model, images, maps, classes, percentiles=[30, 60], score="logit", batch_size=batch_size)
        torch.testing.assert_close(gap.morf, gap_by_class.morf)
        torch.testing.assert_close(gap.lerf, gap_by_class.lerf)


class Keyword(nn.Module):
    """Takes its images by keyword, as HuggingFace vision models take ``pixel_values``, and a scale per image."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))

    def forward(self, pixel_values: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(pixel_values if scale is None else pixel_values * scale[:, None, None, None])


def curves(result: object) -> torch.Tensor:
    return torch.cat([result.morf, result.lerf], dim=1) if hasattr(result, "morf") else result.scores


@pytest.mark.parametrize("name", ["deletion", "insertion", "road"])
def test_inputs_in_the_forms_the_cams_take(name):
    torch.manual_seed(0)
    model = Keyword().eval()
    metric = {"deletion": deletion, "insertion": insertion, "road": road}[name]
    settings = {"percentiles": [25, 50]} if name == "road" else {"steps": 4}

    def run(model: nn.Module, inputs: object, maps: torch.Tensor, **options: object) -> object:
        return metric(model, inputs, maps, batch_size=4, **settings, **options)  # 4: groups of 3 images split

    images, maps, scale = torch.randn(3, 3, 8, 8), torch.rand(3, 8, 8), torch.tensor([1.0, -2.0, 0.5])
    options = {"noise": 0} if name == "road" else {"baseline": "zeros"}  # both commute with the scale
    expected = curves(run(model, images * scale[:, None, None, None], maps, target=[1, 2, 3], **options))
    for inputs in (
        {"pixel_values": images, "scale": scale},  # model(**inputs); the scale goes with its image
        MappingProxyType({"pixel_values": images, "scale": scale}),  # any Mapping (a HuggingFace BatchFeature)
        (images, scale),  # model(*inputs)
    ):
        torch.testing.assert_close(curves(run(model, inputs, maps, target=[1, 2, 3], **options)), expected)
    one = curves(run(model, {"pixel_values": images[1]}, maps[1], target=2, **options))  # one image, one map
    torch.testing.assert_close(one, curves(run(model, images[1:2], maps[1:2], target=2, **options)))


def test_road_of_a_batch_is_the_road_of_each_image():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 10 * 10, 3)).eval()
    images, maps = torch.randn(3, 3, 12, 12), torch.rand(3, 12, 12)
    exact = road(model, images, maps, percentiles=[20, 50, 70], noise=0, batch_size=4)
    for i in range(3):
        alone = road(model, images[i], maps[i], percentiles=[20, 50, 70], noise=0)
        torch.testing.assert_close(alone.morf[0], exact.morf[i])
        torch.testing.assert_close(alone.lerf[0], exact.lerf[i])
    noisy, first = (road(model, x, m, percentiles=[20, 50, 70]) for x, m in ((images, maps), (images[:1], maps[:1])))
    torch.testing.assert_close(first.morf[0], noisy.morf[0])  # an image's noise does not depend on the images after it
    torch.testing.assert_close(first.lerf[0], noisy.lerf[0])


def test_none_keeps_the_class_of_the_unperturbed_image():
    # the top class flips once pixels are removed: the curve must follow the unperturbed top class, not the new one
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2, bias=True)).eval()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0]]))
        model[1].bias.copy_(torch.tensor([0.0, 5.0]))
    result = deletion(model, IMAGE, MAP, steps=4, score="logit")  # class 0 on the image (10 > 5)
    assert result.scores.tolist() == [[10, 9, 5, 2, 0]]


def test_road_by_hand():
    image = torch.tensor([[0.0, 0, 0], [0, 9, 0], [0, 0, 6]]).view(1, 1, 3, 3)
    saliency = torch.tensor([[0.5, 0.5, 0.5], [0.5, 1.0, 0.5], [0.5, 0.5, 0.0]]).view(1, 3, 3)
    result = road(PixelSum(), image, saliency, 0, percentiles=[100 / 9], noise=0, score="logit")
    assert result.percentiles.tolist() == [pytest.approx(100 / 9)]
    assert result.score.tolist() == [15]
    assert result.morf.tolist() == [[pytest.approx(6 + 6 / 12)]]  # the centre becomes 6/12
    assert result.lerf.tolist() == [[pytest.approx(9 + 9 / 5)]]  # the corner becomes 9 * (1/12) / (5/12)
    assert result.morf_auc.tolist() == result.morf[:, 0].tolist()
    assert result.auc.tolist() == [pytest.approx((9 + 9 / 5 - 6.5) / 2)]


def test_road_noise_is_seeded_and_independent_of_the_batch_size():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 10 * 10, 3)).eval()
    images, maps = torch.randn(2, 3, 12, 12), torch.rand(2, 12, 12)
    state = torch.random.get_rng_state()
    a = road(model, images, maps, percentiles=[20, 60], batch_size=3)
    b = road(model, images, maps, percentiles=[20, 60], batch_size=8)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is not touched
    torch.testing.assert_close(a.morf, b.morf)
    torch.testing.assert_close(a.lerf, b.lerf)
    other = road(model, images, maps, percentiles=[20, 60], seed=1)
    assert not torch.equal(other.morf, a.morf)
    exact = road(model, images, maps, percentiles=[20, 60], noise=0)
    assert (exact.morf - a.morf).abs().max() < 0.05  # noise of 0.01 moves the probabilities a little


class Stateful(nn.Module):
    """Batch norm and dropout (both change with the mode), a frozen layer, and a user's own hook."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4, 3)
        self.fc.weight.requires_grad_(False)
        self.fuse = 0
        self.seen: list[int] = []
        self.conv.register_forward_hook(lambda m, a, o: self.seen.append(len(o)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fuse -= 1
        if self.fuse == 0:
            raise KeyboardInterrupt
        return self.fc(self.drop(self.bn(self.conv(x))).mean(dim=(2, 3)))


def snapshot(model: nn.Module) -> dict:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
        "flags": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "hooks": hook_state(model),
    }


def assert_same(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["flags"] == before["flags"]
    assert after["requires_grad"] == before["requires_grad"]
    assert after["hooks"] == before["hooks"]
    for key, value in before["tensors"].items():
        assert torch.equal(after["tensors"][key], value), key
    for key, grad in before["grads"].items():
        assert (grad is None and after["grads"][key] is None) or torch.equal(after["grads"][key], grad), key
    assert torch.is_grad_enabled()


METRICS = {
    "deletion": lambda m, x, s, **k: deletion(m, x, s, steps=4, batch_size=3, **k),
    "insertion": lambda m, x, s, **k: insertion(m, x, s, steps=4, batch_size=3, **k),
    "deletion_insertion": lambda m, x, s, **k: deletion_insertion(m, x, s, steps=4, batch_size=3, **k)[1],
    "road": lambda m, x, s, **k: road(m, x, s, percentiles=[25, 50], batch_size=3, **k),
}


@pytest.mark.parametrize("name", METRICS)
def test_the_model_is_left_as_it_was_found(name):
    torch.manual_seed(0)
    model = Stateful().train()
    model.bn.eval()  # a mixed state that a blanket model.train() afterwards would not restore
    model(torch.randn(4, 3, 8, 8)).sum().backward()  # running statistics and .grad that must stay
    before = snapshot(model)
    images, maps = torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8)
    first = METRICS[name](model, images, maps)
    assert_same(model, before)
    again = METRICS[name](model, images, maps)
    torch.testing.assert_close(again.auc, first.auc)  # eval mode: no dropout, so the result is deterministic
    with pytest.raises(ValueError, match="out of range"):
        METRICS[name](model, images, maps, target=7)
    assert_same(model, before)
    model.fuse = 3  # the third forward, a batch of perturbed images, is interrupted as by Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        METRICS[name](model, images, maps)
    assert_same(model, before)


def test_metrics_of_a_cam_end_to_end(tiny_cnn):
    images = torch.randn(2, 3, 16, 16)
    maps = GradCAM(tiny_cnn, "features.2")(images)
    before = snapshot(tiny_cnn)
    result = deletion(tiny_cnn, images, maps, steps=8)
    with torch.no_grad():
        probs = tiny_cnn(images).softmax(dim=1).amax(dim=1)
    torch.testing.assert_close(result.scores[:, 0], probs)
    assert_same(tiny_cnn, before)


def test_bad_inputs_get_clear_errors():
    model = PixelSum()
    images, maps = torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8)
    with pytest.raises(ValueError, match=r"got maps \(2, 1, 8, 8\) for images \(2, 3, 8, 8\); drop the channel axis"):
        deletion(model, images, maps[:, None])
    with pytest.raises(ValueError, match=r"got maps \(2, 4, 4\) for images \(2, 3, 8, 8\); upsample the maps"):
        deletion(model, images, maps[:, :4, :4])
    with pytest.raises(ValueError, match=r"got maps \(3, 8, 8\)"):
        insertion(model, images, torch.rand(3, 8, 8))
    with pytest.raises(ValueError, match="NaN or infinite"):
        road(model, images, torch.full((2, 8, 8), float("nan")))
    with pytest.raises(ValueError, match="`target` has 3 entries but the batch has 2"):
        deletion(model, images, maps, [0, 1, 0])
    with pytest.raises(ValueError, match="`score` must be 'probability' or 'logit'"):
        deletion(model, images, maps, score="prob")
    with pytest.raises(ValueError, match="`percentiles` must be values strictly between 0 and 100"):
        road(model, images, maps, percentiles=[50, 100])
    with pytest.raises(ValueError, match="`noise` must be a standard deviation >= 0"):
        road(model, images, maps, noise=-0.1)
    with pytest.raises(ValueError, match="`steps` must be an int from 1"):
        deletion(model, images, maps, steps=0)
    with pytest.raises(ValueError, match="`batch_size` must be a positive int"):
        insertion(model, images, maps, batch_size=0)
    with pytest.raises(TypeError, match="floating-point"):
        deletion(model, images.to(torch.uint8), maps)
    with pytest.raises(ValueError, match=r"a callable `target` must return scores of shape \(2,\)"):
        deletion(model, images, maps, lambda out: out[:1, 0], steps=2, batch_size=5)
    with pytest.raises(TypeError, match="a list of images"):
        deletion(model, list(images), maps)
    with pytest.raises(TypeError, match=r"a mapping with pixel_values \(B, C, H, W\)"):
        deletion(model, {"x": images}, maps)
    with pytest.warns(UserWarning, match=r"the map of item\(s\) \[1\] is constant"):
        deletion(model, images, torch.stack([maps[0], torch.zeros(8, 8)]), steps=2)
