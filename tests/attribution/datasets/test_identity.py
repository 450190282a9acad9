"""A resume continues only the same computation: model weights, method and target code and values, and data."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from attribution import GradCAM, attribute_dataset
from attribution.datasets import _identity
from tests.support import TinyCNN

ITEMS = 12


@pytest.fixture
def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ITEMS, 3, 8, 8, generator=g), torch.randint(0, 5, (ITEMS,), generator=g))


class Interrupt:
    """Wraps a method; raises KeyboardInterrupt on its ``after``-th call (a Ctrl-C after a shard was written)."""

    def __init__(self, method: Any, after: int = 2) -> None:
        self.method, self.after, self.calls = method, after, 0
        self.model = getattr(method, "model", None)

    def __call__(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        if self.calls == self.after:
            raise KeyboardInterrupt
        self.calls += 1
        return self.method(inputs, target)

    def __repr__(self) -> str:
        return _identity.describe(self.method)


def interrupted(method: Any, data: Any, out: Path, **kwargs: Any) -> None:
    """A run stopped after its first shard (two batches of 2)."""
    with pytest.raises(KeyboardInterrupt):
        attribute_dataset(Interrupt(method), data, out, batch_size=2, shard_size=4, progress=False, **kwargs)


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def scale(x: torch.Tensor, t: Any, factor: float) -> torch.Tensor:
    return x.mean(1) * factor


def test_a_lambda_method_with_other_values_or_code_is_refused(data, tmp_path):
    factor = 2.0
    interrupted(lambda x, t: x.mean(1) * factor, data, tmp_path)
    stored = files(tmp_path)
    factor = 3.0  # the closure's value changed: another computation
    with pytest.raises(ValueError, match=r"other settings \(method: .*overwrite=True"):
        attribute_dataset(lambda x, t: x.mean(1) * factor, data, tmp_path, batch_size=2, progress=False)
    with pytest.raises(ValueError, match="method"):
        attribute_dataset(lambda x, t: x.mean(1) * 2.0 + 1, data, tmp_path, batch_size=2, progress=False)
    assert files(tmp_path) == stored  # nothing written or deleted by a refused resume
    factor = 2.0
    res = attribute_dataset(lambda x, t: x.mean(1) * factor, data, tmp_path, batch_size=2, progress=False)
    assert torch.equal(res.maps[:], data.tensors[0].mean(1) * 2.0)


def test_a_partial_with_other_arguments_is_refused(data, tmp_path):
    attribute_dataset(functools.partial(scale, factor=2.0), data, tmp_path, batch_size=2, progress=False)
    with pytest.raises(ValueError, match="method"):
        attribute_dataset(functools.partial(scale, factor=3.0), data, tmp_path, batch_size=2, progress=False)


def test_a_lambda_target_with_other_code_is_refused(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    interrupted(cam, data, tmp_path, target=lambda out: out[:, 1])
    with pytest.raises(ValueError, match="target: 'callable"):
        attribute_dataset(cam, data, tmp_path, batch_size=2, target=lambda out: out[:, 2], progress=False)


def test_other_weights_are_refused_and_overwrite_starts_over(data, tmp_path):
    torch.manual_seed(0)
    model = TinyCNN().eval()
    interrupted(GradCAM(model, "features.2"), data, tmp_path)
    with torch.no_grad():
        model.fc.bias[0] += 1  # one changed parameter
    cam = GradCAM(model, "features.2")
    with pytest.raises(ValueError, match=r"model: 'TinyCNN \(weights [0-9a-f]{16}\)' there"):
        attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False)
    res = attribute_dataset(cam, data, tmp_path, batch_size=2, progress=False, overwrite=True)
    fresh = attribute_dataset(cam, data, tmp_path / "fresh", batch_size=2, shard_size=4, progress=False)
    assert torch.equal(res.maps[:], fresh.maps[:]) and torch.equal(res.scores[:], fresh.scores[:])


def test_other_data_of_the_same_length_is_refused(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    interrupted(cam, data, tmp_path, target="label")
    images, labels = data.tensors
    changed = images.clone()
    changed[2, 0, 0, 0] += 1  # one value of one stored item
    with pytest.raises(ValueError, match=r"`data` differs .* items \[2\]"):
        attribute_dataset(cam, TensorDataset(changed, labels), tmp_path, batch_size=2, target="label")
    relabelled = labels.clone()
    relabelled[1] += 1
    with pytest.raises(ValueError, match=r"items \[1\]"):
        attribute_dataset(cam, TensorDataset(images, relabelled), tmp_path, batch_size=2, target="label")


class Opaque:
    """A callable whose values cannot be read: no attributes, the default repr."""

    __slots__ = ("cam",)

    def __init__(self, cam: GradCAM) -> None:
        self.cam = cam

    def __call__(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        return self.cam(inputs, target)


def test_an_unreadable_method_resumes_only_under_a_run_name(tiny_cnn, data, tmp_path):
    method = Opaque(GradCAM(tiny_cnn, "features.2"))
    interrupted(method, data, tmp_path / "a")
    with pytest.raises(ValueError, match=r"cannot check .* run_name="):
        attribute_dataset(method, data, tmp_path / "a", batch_size=2, progress=False)
    interrupted(method, data, tmp_path / "b", run_name="v1")
    res = attribute_dataset(method, data, tmp_path / "b", batch_size=2, run_name="v1", progress=False)
    assert torch.equal(res.maps[:], method(data.tensors[0]))
    with pytest.raises(ValueError, match="run_name: 'v1' there, 'v2' now"):
        attribute_dataset(method, data, tmp_path / "b", batch_size=2, run_name="v2", progress=False)


def test_descriptions_follow_code_and_values_not_addresses():
    def make(k: float) -> Any:
        return lambda x: x * k

    assert _identity.describe(make(1.0)) == _identity.describe(make(1.0))
    assert _identity.describe(make(1.0)) != _identity.describe(make(2.0))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.load_state_dict(a.state_dict())
    assert _identity.model_digest(a) == _identity.model_digest(b)
    b.register_buffer("extra", torch.zeros(1))
    assert _identity.model_digest(a) != _identity.model_digest(b)
    assert _identity.describe(torch.tensor([1.0, 2.0])) != _identity.describe(torch.tensor([2.0, 1.0]))
