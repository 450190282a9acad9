"""A killed run resumes from its checkpoint to the same report, bit for bit; a changed run is refused by name."""

from __future__ import annotations

import pytest
import torch

from attribution.features import Directions, feature_statistics
from attribution.features import statistics as stats_module

from .test_statistics import assert_same


class Killed(Exception):
    """The stand-in for a kill."""


class Batches:
    """Batches of documents as a DataLoader gives them; raises after ``kill_after`` batches in all (over passes)."""

    def __init__(self, ids: torch.Tensor, size: int, kill_after: int | None = None) -> None:
        self.ids, self.size, self.kill_after, self.given = ids, size, kill_after, 0

    def __len__(self) -> int:
        return -(-len(self.ids) // self.size)

    def __iter__(self):
        for start in range(0, len(self.ids), self.size):
            if self.kill_after is not None and self.given >= self.kill_after:
                raise Killed
            self.given += 1
            yield {"input_ids": self.ids[start : start + self.size]}


def _run(model, data, checkpoint, **options):
    settings = {"k": 4, "bands": 3, "samples": 2, "context": (2, 1), "coactivation": True, "progress": False}
    return feature_statistics(model, data, Directions(torch.eye(6), "embed"), checkpoint=checkpoint,
                              **{**settings, **options})  # fmt: skip


SLOW = pytest.mark.slow


@pytest.mark.parametrize("kill_after", [pytest.param(1, marks=SLOW), 5, pytest.param(6, marks=SLOW),
                                        pytest.param(9, marks=SLOW), pytest.param(11, marks=SLOW), 14])  # fmt: skip
def test_a_run_killed_in_either_pass_resumes_to_the_same_report(planted, tmp_path, monkeypatch, kill_after):
    """23 documents in batches of 2: 12 batches a pass, a checkpoint every 4; kills in pass 1 and in pass 2."""
    model, ids, _ = planted
    whole = _run(model, Batches(ids, 2), None)
    path = tmp_path / "run.ckpt"
    with pytest.raises(Killed):
        _run(model, Batches(ids, 2, kill_after), path)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    ran = []
    original = stats_module._activations
    monkeypatch.setattr(stats_module, "_activations", lambda *a: ran.append(1) or original(*a))
    resumed = _run(model, Batches(ids, 2), path)
    assert_same(whole, resumed)
    done = (kill_after // 4) * 4 if kill_after < 12 else 12 + ((kill_after - 12) // 4) * 4
    assert len(ran) == 24 - done  # only the batches after the last checkpoint ran again
    assert len(_run(model, Batches(ids, 2), path).labels) == 6  # a finished run is read back


def test_a_tensor_run_resumes_too_and_a_finished_one_is_read_back(planted, tmp_path):
    model, ids, _ = planted
    path = tmp_path / "t.ckpt"
    first = _run(model, ids, path, batch_size=3)
    assert_same(first, _run(model, ids, path, batch_size=3))


@pytest.mark.parametrize(
    ("change", "name"),
    [({"k": 5}, "k"), ({"context": (3, 1)}, "context"), ({"bands": 2}, "bands"), ({"seed": 1}, "seed"),
     ({"batch_size": 4}, "batch_size")],
)  # fmt: skip
def test_a_resume_with_other_settings_is_refused_naming_the_setting(planted, tmp_path, change, name):
    model, ids, _ = planted
    path = tmp_path / "c.ckpt"
    _run(model, ids, path, batch_size=3)
    with pytest.raises(ValueError, match=f"another `{name}`"):
        _run(model, ids, path, **{"batch_size": 3, **change})


def test_a_resume_over_other_data_or_another_model_is_refused(planted, tmp_path):
    model, ids, _ = planted
    path = tmp_path / "d.ckpt"
    with pytest.raises(Killed):
        _run(model, Batches(ids, 2, kill_after=6), path)
    other = ids.clone()
    other[1, 3] = (other[1, 3] + 1) % 30
    with pytest.raises(ValueError, match="differ from those of the run"):
        _run(model, Batches(other, 2), path)
    model.embed.weight.data[2, 2] += 1
    with pytest.raises(ValueError, match="another `model`"):
        _run(model, Batches(ids, 2), path)
    tensor_path = tmp_path / "e.ckpt"
    _run(model, ids, tensor_path)
    with pytest.raises(ValueError, match="another `data`"):
        _run(model, other, tensor_path)
