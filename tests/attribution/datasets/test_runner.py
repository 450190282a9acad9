"""attribute_dataset and open_results in one process: parity with direct calls, targets, storage, resume, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from attribution import (
    AttentionRollout,
    GradCAM,
    ScoreCAM,
    activation_patching,
    attribute_dataset,
    class_means,
    mean_patching,
    open_results,
)
from attribution.datasets import _shards
from tests.attribution.datasets import _worker as worker
from tests.support import TinyCNN, hook_state

ITEMS = 11


@pytest.fixture
def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ITEMS, 3, 8, 8, generator=g), torch.randint(0, 5, (ITEMS,), generator=g))


def batches(stop: int, size: int, shard: int) -> list[range]:
    """The batches the runner forms: ``size`` items at a time within shards of ``shard`` items."""
    return [range(s, min(s + size, b + shard, stop)) for b in range(0, stop, shard) for s in range(b, b + shard, size)]


class Counting:
    """A method that counts the items it was called on, and can raise after ``fail_after`` calls."""

    def __init__(self, cam: GradCAM, fail_after: int | None = None) -> None:
        self.cam, self.model, self.fail_after = cam, cam.model, fail_after
        self.calls = self.items = 0

    def __call__(self, inputs: torch.Tensor, target: object = None) -> torch.Tensor:
        if self.fail_after is not None and self.calls == self.fail_after:
            raise KeyboardInterrupt
        self.calls += 1
        self.items += len(inputs)
        return self.cam(inputs, target)

    def __repr__(self) -> str:
        return repr(self.cam)


def test_maps_targets_and_scores_equal_direct_calls(tiny_cnn: TinyCNN, data: TensorDataset, tmp_path: Path):
    cam = GradCAM(tiny_cnn, "features.2")
    before = hook_state(tiny_cnn)
    res = attribute_dataset(cam, data, tmp_path, batch_size=4, shard_size=4, progress=False)
    assert hook_state(tiny_cnn) == before
    assert len(res) == ITEMS
    assert res.fields == ("maps", "index", "targets", "classes", "scores", "probs")
    images = data.tensors[0]
    for rows in batches(ITEMS, 4, 4):
        x = images[rows.start : rows.stop]
        assert torch.equal(res.maps[rows.start : rows.stop], cam(x))  # the same batches: bitwise equal
        with torch.no_grad():
            logits = tiny_cnn(x)
        top = logits.topk(5, dim=1)
        assert torch.equal(res.targets[rows.start : rows.stop], logits.argmax(1))
        assert torch.equal(res.classes[rows.start : rows.stop], top.indices)
        torch.testing.assert_close(res.scores[rows.start : rows.stop], top.values)
        torch.testing.assert_close(res.probs[rows.start : rows.stop], logits.softmax(1).gather(1, top.indices))
    assert torch.equal(res.index[:], torch.arange(ITEMS))
    assert res.maps[0].dtype == torch.float32 and res.maps.shape == (ITEMS, 8, 8)


@pytest.mark.parametrize("kind", ["int", "label", "per_item", "callable"])
def test_each_kind_of_target_reaches_the_method_and_is_recorded(kind, tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    images, labels = data.tensors
    per_item = torch.tensor([4, 0, 1, 3, 2, 2, 0, 1, 4, 3, 0])
    target, given, stored = {
        "int": (3, torch.full((ITEMS,), 3), torch.full((ITEMS,), 3)),
        "label": ("label", labels, labels),
        "per_item": (per_item.tolist(), per_item, per_item),
        "callable": (lambda out: out[:, 1] - out[:, 0], None, torch.full((ITEMS,), -1)),
    }[kind]
    res = attribute_dataset(cam, data, tmp_path, batch_size=3, shard_size=6, target=target, progress=False)
    for rows in batches(ITEMS, 3, 6):
        x = images[rows.start : rows.stop]
        expected = cam(x, target if given is None else given[rows.start : rows.stop])
        assert torch.equal(res.maps[rows.start : rows.stop], expected)
    assert torch.equal(res.targets[:], stored)


def test_float16_storage_equals_the_float32_maps_rounded(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    full = attribute_dataset(cam, data, tmp_path / "32", batch_size=4, progress=False)
    half = attribute_dataset(cam, data, tmp_path / "16", batch_size=4, dtype="float16", progress=False)
    assert half.maps.dtype == torch.float16 and half.maps[3].dtype == torch.float16
    assert torch.equal(half.maps[:], full.maps[:].half())
    assert (tmp_path / "16/shards/000000/maps.npy").stat().st_size < (
        tmp_path / "32/shards/000000/maps.npy"
    ).stat().st_size
    with pytest.warns(UserWarning, match="exceed float16's range"):
        big = attribute_dataset(lambda x, t: x[:, 0] * 1e6, data, tmp_path / "big", batch_size=4, dtype=torch.float16)
    assert torch.isinf(big.maps[:]).any()


def test_open_results_reads_only_the_shards_asked_for(tiny_cnn, data, tmp_path, monkeypatch):
    cam = GradCAM(tiny_cnn, "features.2")
    attribute_dataset(cam, data, tmp_path, batch_size=2, shard_size=2, progress=False)  # 6 shards
    expected = torch.cat([cam(data.tensors[0][r.start : r.stop]) for r in batches(ITEMS, 2, 2)])
    loaded: list[str] = []
    load = np.load
    monkeypatch.setattr(np, "load", lambda path, **kw: loaded.append(Path(path).parent.name) or load(path, **kw))
    res = open_results(tmp_path)
    assert loaded == [] and len(res) == ITEMS
    assert torch.equal(res.maps[7], expected[7]) and loaded == ["000003"]
    assert int(res.index[7]) == 7 and int(res.targets[7]) == int(res.classes[7][0])
    for p in (tmp_path / "shards/000000").glob("*.npy"):  # items of other shards stay readable without shard 0
        p.unlink()
    assert torch.equal(res.maps[-1], expected[10])
    assert torch.equal(res.maps[3:9], expected[3:9])
    assert torch.equal(res.maps[[10, 2, 5]], expected[[10, 2, 5]])
    assert torch.equal(res.maps[torch.tensor([9, 4])], expected[[9, 4]])
    mask = np.zeros(ITEMS, dtype=bool)
    mask[[2, 8]] = True
    assert torch.equal(res.maps[mask], expected[[2, 8]])
    with pytest.raises(FileNotFoundError, match=r"000000/maps\.npy is missing"):
        res.maps[1]
    with pytest.raises(IndexError, match="index 11 is out of range for 11 items"):
        res.maps[11]
    with pytest.raises(IndexError, match="-12"):
        res.targets[[0, -12]]
    plain = attribute_dataset(lambda x, t: x[:, 0], data, tmp_path / "f", batch_size=4, progress=False)
    with pytest.raises(KeyError, match="no field 'classes'"):
        plain.column("classes")


def test_open_maps_are_bounded(tiny_cnn, data, tmp_path, monkeypatch):
    monkeypatch.setattr(_shards, "OPEN_LIMIT", 3)
    res = attribute_dataset(GradCAM(tiny_cnn, "features.2"), data, tmp_path, batch_size=1, shard_size=1, progress=False)
    maps = list(res.maps)
    assert len(maps) == ITEMS and torch.equal(torch.stack(maps), res.maps[:])
    assert len(res._open) == 3


def test_rollout_without_target_parameter_and_user_functions(data, tmp_path):
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(8, 4, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16).eval()
    rollout = AttentionRollout(vit)
    res = attribute_dataset(rollout, data, tmp_path / "r", batch_size=4, progress=False)
    x = data.tensors[0]
    assert torch.equal(res.maps[4:8], rollout(x[4:8]))
    with torch.no_grad():
        assert torch.equal(res.targets[:], vit(x).argmax(1))
    with pytest.raises(ValueError, match="takes no target"):
        attribute_dataset(rollout, data, tmp_path / "r2", batch_size=4, target=1)

    def saliency(inputs: torch.Tensor, target: object) -> torch.Tensor:
        return inputs.abs().amax(1)

    plain = attribute_dataset(saliency, data, tmp_path / "f", batch_size=4, progress=False)
    assert plain.fields == ("maps", "index", "targets")
    assert torch.equal(plain.targets[:], torch.full((ITEMS,), -1)) and torch.equal(plain.maps[:], x.abs().amax(1))

    def scaled_by_first_logit(inputs: torch.Tensor, target: object) -> torch.Tensor:
        with torch.no_grad():
            return inputs.abs().amax(1) * vit(inputs)[:, :1, None]

    with_model = attribute_dataset(scaled_by_first_logit, data, tmp_path / "m", batch_size=4, model=vit, topk=2)
    with torch.no_grad():
        logits = vit(x)
    assert torch.equal(with_model.classes[:], logits.topk(2, dim=1).indices)
    assert torch.equal(with_model.targets[:], logits.argmax(1))
    unseen = attribute_dataset(saliency, data, tmp_path / "n", batch_size=4, model=vit, progress=False)
    assert unseen.fields == ("maps", "index", "targets")  # the model given never ran: nothing to observe


def test_score_cam_scores_come_from_its_first_forward(tiny_cnn, data, tmp_path):
    cam = ScoreCAM(tiny_cnn, "features.2", progress=False)
    res = attribute_dataset(cam, data, tmp_path, batch_size=4, topk=3, progress=False)
    with torch.no_grad():
        logits = tiny_cnn(data.tensors[0])
    torch.testing.assert_close(res.scores[:], logits.topk(3, dim=1).values)
    assert torch.equal(res.targets[:], logits.argmax(1))


def test_interrupted_run_resumes_without_duplicates_or_gaps(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    reference = attribute_dataset(cam, data, tmp_path / "ref", batch_size=2, shard_size=4, progress=False)
    first = Counting(cam, fail_after=3)  # shard 0 (2 batches) written, shard 1 interrupted after its first batch
    before = hook_state(tiny_cnn)
    with pytest.raises(KeyboardInterrupt):
        attribute_dataset(first, data, tmp_path / "run", batch_size=2, shard_size=4, progress=False)
    assert hook_state(tiny_cnn) == before  # the observing hook is gone after Ctrl-C
    shards = sorted(p.name for p in (tmp_path / "run/shards").iterdir())
    assert shards == ["000000"]  # the half-written shard was removed, not published
    with pytest.raises(FileNotFoundError, match=r"not finished \(1 of 3 shards"):
        open_results(tmp_path / "run")
    second = Counting(cam)
    res = attribute_dataset(second, data, tmp_path / "run", batch_size=2, progress=False)  # shard size as stored
    assert second.items == ITEMS - 4
    assert torch.equal(res.index[:], torch.arange(ITEMS))
    assert torch.equal(res.maps[:], reference.maps[:]) and torch.equal(res.classes[:], reference.classes[:])
    third = Counting(cam)
    attribute_dataset(third, data, tmp_path / "run", batch_size=2, progress=False)
    assert third.calls == 0


def test_a_leftover_temporary_shard_is_never_read(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        attribute_dataset(Counting(cam, fail_after=2), data, out, batch_size=2, shard_size=4, progress=False)
    stale = out / "shards" / "000001.tmp-otherhost-99"  # as a killed process leaves it: a header, half the rows
    stale.mkdir()
    (stale / "maps.npy").write_bytes(b"\x93NUMPY garbage")
    assert not _shards.is_complete(out, 1)
    res = attribute_dataset(cam, data, out, batch_size=2, progress=False)
    assert not stale.exists()
    assert torch.equal(res.maps[4:6], cam(data.tensors[0][4:6]))
    assert torch.equal(res.maps[6:8], cam(data.tensors[0][6:8]))


def test_another_run_in_the_same_directory_is_refused(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    attribute_dataset(cam, data, tmp_path, batch_size=4, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(dtype: 'float32' there, 'float16' now\)"):
        attribute_dataset(cam, data, tmp_path, batch_size=4, dtype=torch.float16)
    with pytest.raises(ValueError, match=re.escape("method: \"GradCAM(TinyCNN, layers=['features.2'])\" there")):
        attribute_dataset(GradCAM(tiny_cnn, "features.0"), data, tmp_path, batch_size=4)
    with pytest.raises(ValueError, match="target"):
        attribute_dataset(cam, data, tmp_path, batch_size=4, target=[0] * ITEMS)
    settings = json.loads((tmp_path / "settings.json").read_text())
    assert settings["items"] == ITEMS and settings["target"] == "top class"


def test_dataloader_options_are_kept_and_its_order_ignored(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")
    loader = DataLoader(
        data, batch_size=3, shuffle=True, collate_fn=lambda items: torch.stack([x for x, _ in items]) * 2
    )
    res = attribute_dataset(cam, loader, tmp_path, progress=False)
    assert json.loads((tmp_path / "settings.json").read_text())["shard_size"] == 3
    assert torch.equal(res.maps[:3], cam(data.tensors[0][:3] * 2))
    assert torch.equal(res.index[:], torch.arange(ITEMS))


def test_dict_items_give_inputs_and_labels(tmp_path):
    items = [{"x": torch.full((2,), float(i)), "label": i % 3} for i in range(5)]
    seen = []

    def method(inputs: dict, target: torch.Tensor) -> torch.Tensor:
        seen.append(sorted(inputs))
        return inputs["x"] + target[:, None]

    res = attribute_dataset(method, items, tmp_path, batch_size=2, target="label", progress=False)
    assert seen == [["x"]] * 3
    assert torch.equal(res.maps[4], torch.tensor([5.0, 5.0])) and torch.equal(
        res.targets[:], torch.tensor([0, 1, 2, 0, 1])
    )


def test_bad_arguments_are_refused_with_clear_errors(tiny_cnn, data, tmp_path):
    cam = GradCAM(tiny_cnn, "features.2")

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(3, 8, 8)

    with pytest.raises(TypeError, match="iterable-style dataset"):
        attribute_dataset(cam, Stream(), tmp_path, batch_size=2)
    with pytest.raises(TypeError, match="`batch_size` is needed"):
        attribute_dataset(cam, data, tmp_path)
    with pytest.raises(ValueError, match="`target` has 3 entries but `data` has 11 items"):
        attribute_dataset(cam, data, tmp_path, batch_size=2, target=[1, 2, 3])
    with pytest.raises(ValueError, match="must be 'label'"):
        attribute_dataset(cam, data, tmp_path, batch_size=2, target="labels")
    with pytest.raises(ValueError, match=r"`dtype` must be torch\.float32 or torch\.float16"):
        attribute_dataset(cam, data, tmp_path, batch_size=2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="`data` is empty"):
        attribute_dataset(cam, [], tmp_path, batch_size=2)
    with pytest.raises(ValueError, match="for a batch of 4 items it returned shape \\(1, 8, 8\\)"):
        attribute_dataset(lambda x, t: x[:1, 0], data, tmp_path / "b", batch_size=4)
    with pytest.raises(ValueError, match="target='label' needs items"):
        attribute_dataset(cam, TensorDataset(data.tensors[0]), tmp_path / "l", batch_size=4, target="label")
    assert not list((tmp_path / "b" / "shards").iterdir())  # the failed shard left nothing behind


def test_the_model_is_left_as_found_after_an_error(tiny_cnn, data, tmp_path):
    tiny_cnn.train()
    before = hook_state(tiny_cnn)
    cam = GradCAM(tiny_cnn, "features.2")
    with pytest.raises(ValueError, match="out of range"):
        attribute_dataset(cam, data, tmp_path, batch_size=4, target=9)
    assert hook_state(tiny_cnn) == before and tiny_cnn.training


def test_class_means_equal_the_mean_of_each_class_maps(tiny_cnn, data, tmp_path):
    res = attribute_dataset(GradCAM(tiny_cnn, "features.2"), data, tmp_path, batch_size=2, target="label")
    means = class_means(res)
    labels, maps = data.tensors[1], res.maps[:].double()
    assert torch.equal(means.classes, labels.unique())
    for cls in labels.unique().tolist():
        torch.testing.assert_close(means[cls], maps[labels == cls].mean(0))
    assert torch.equal(means.counts, torch.bincount(labels)[labels.unique()])
    top = class_means(res, by="classes")
    assert int(top.counts.sum()) == ITEMS and torch.equal(top.classes, res.classes[:][:, 0].unique())
    with pytest.raises(KeyError, match="class 7 has no items"):
        means[7]
    plain = attribute_dataset(lambda x, t: x[:, 0], data, tmp_path / "plain", batch_size=4, progress=False)
    assert class_means(plain).means.shape == (0, 8, 8)  # every target is -1 (unknown): no class
    with pytest.raises(KeyError, match="no field 'classes'"):
        class_means(plain, by="classes")


def test_mean_patching_is_the_mean_of_the_per_pair_sweeps():
    model, pairs = worker.mlp(), worker.pairs()
    result = mean_patching(model, pairs, ["0", "1"], worker.metric, progress=False)
    each = torch.stack([activation_patching(model, c, k, ["0", "1"], worker.metric, progress=False) for c, k in pairs])
    torch.testing.assert_close(result.mean, each.double().mean(0))
    torch.testing.assert_close(result.std, each.double().std(0))
    assert result.count == len(pairs) and result.mean.shape == (2, 3)


def test_mean_patching_with_the_real_attribution_patching():
    from attribution import attribution_patching

    model, pairs = worker.mlp(), worker.pairs()
    result = mean_patching(model, pairs, ["0", "1"], worker.metric, patching=attribution_patching, progress=False)
    each = torch.stack([attribution_patching(model, c, k, ["0", "1"], worker.metric, progress=False) for c, k in pairs])
    torch.testing.assert_close(result.mean, each.double().mean(0))
    assert result.count == len(pairs) and result.mean.shape == (2, 3)


def test_mean_patching_takes_any_function_with_the_patching_signature():
    calls = []

    def attribution_patching(model, clean, corrupted, layers, metric, *, positions=True):
        calls.append((layers, positions))
        return clean[0].sum(-1) - corrupted[0].sum(-1)  # no `progress` parameter: none is passed

    pairs = [{"clean": torch.ones(1, 2, 3) * i, "corrupted": torch.zeros(1, 2, 3)} for i in range(3)]
    result = mean_patching(torch.nn.Identity(), pairs, "x", None, patching=attribution_patching, positions=False)
    assert calls == [("x", False)] * 3
    torch.testing.assert_close(result.mean, torch.full((2,), 3.0, dtype=torch.float64))
    uneven = [(torch.ones(1, 2, 3), torch.ones(1, 2, 3)), (torch.ones(1, 3, 3), torch.ones(1, 3, 3))]
    with pytest.raises(ValueError, match="pair 1 gives a result of shape \\(3,\\) but pair 0 gave \\(2,\\)"):
        mean_patching(torch.nn.Identity(), uneven, "x", None, patching=attribution_patching)
    with pytest.raises(ValueError, match="pair 0 must be \\(clean, corrupted\\)"):
        mean_patching(torch.nn.Identity(), [torch.ones(2)], "x", None, patching=attribution_patching)


def test_samplers_that_take_other_items_are_refused(data, tmp_path):
    subset = torch.utils.data.SubsetRandomSampler([1, 4, 6])
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 2, drop_last=False)
    cases = {
        "a SubsetRandomSampler": DataLoader(data, batch_size=2, sampler=subset),
        "drop_last=True": DataLoader(data, batch_size=2, drop_last=True),
        r"a batch sampler \(list\)": DataLoader(data, batch_sampler=[[0, 1], [2]]),
        "a RandomSampler with replacement": DataLoader(
            data, batch_size=2, sampler=torch.utils.data.RandomSampler(data, replacement=True)
        ),
    }
    for why, loader in cases.items():
        with pytest.raises(ValueError, match=f"DataLoader with {why}.*Subset"):
            attribute_dataset(lambda x, t: x.mean(1), loader, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()  # refused before anything is written
    res = attribute_dataset(lambda x, t: x.mean(1), DataLoader(data, batch_sampler=batches), tmp_path / "y")
    assert torch.equal(res.index[:], torch.arange(ITEMS))  # a plain BatchSampler over every item is fine


def test_columns_take_0d_tensors_and_empty_lists_like_numpy(tmp_path):
    x = torch.rand(7, 2, 3)
    res = attribute_dataset(lambda x, t: x.mean(1), x, tmp_path, batch_size=3, progress=False)
    assert torch.equal(res.maps[torch.tensor(3)], x[3].mean(0))
    assert torch.equal(res.maps[np.int64(-1)], x[6].mean(0))
    assert res.maps[[]].shape == (0, 3) and res.maps[torch.tensor([], dtype=torch.long)].shape == (0, 3)
    with pytest.raises(TypeError, match="index with an int"):
        res.maps[torch.tensor(2.0)]


def test_abort_on_a_full_disk_leaves_no_temporary_directory_or_open_file(tmp_path):
    writer = _shards.ShardWriter(tmp_path, 0, rows=4)
    writer.append({"maps": np.zeros((2, 3), np.float32)})

    class Full:
        def __init__(self, f):
            self.f = f

        def close(self):
            self.f.close()
            raise OSError(28, "No space left on device")

    opened = writer.files["maps"]
    writer.files["maps"] = Full(opened)
    writer.abort()
    assert opened.closed and not list((tmp_path / "shards").iterdir())
