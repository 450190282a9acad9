"""Fits that resume from a checkpoint, fingerprinted training sources, and two torchrun processes equal to one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.influence import InfluenceFunction
from tests._torchrun import torchrun
from tests.attribution.influence import _torchrun_worker as worker

CE = nn.CrossEntropyLoss(reduction="none")


class Interrupted(Exception):
    """Stands for a kill."""


class Counting(nn.CrossEntropyLoss):
    """Cross-entropy per example that counts its calls and raises on call number ``after`` (a kill mid-pass)."""

    def __init__(self, after: int = 0) -> None:
        super().__init__(reduction="none")
        self.after, self.calls = after, 0

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.after:
            raise Interrupted
        return super().forward(outputs, labels)


@pytest.mark.parametrize(("method", "after"), [("ekfac", 3), ("ekfac", 8), ("kfac", 4), ("diagonal", 2)])
def test_a_fit_killed_in_either_pass_resumes_to_the_same_state_bitwise(tmp_path, method, after):
    model, train, _ = worker.setting()
    whole = InfluenceFunction(model, CE, method=method, progress=False).fit(train).state
    path = tmp_path / "fit.ckpt"
    with pytest.raises(Interrupted):  # 5 batches a pass: call 3 is in the first pass, call 8 in the second
        InfluenceFunction(model, Counting(after), method=method, progress=False).fit(train, path, 0.0)
    assert path.exists()
    counting = Counting()
    resumed = InfluenceFunction(model, counting, method=method, progress=False).fit(train, path, 0.0).state
    assert sorted(resumed) == sorted(whole)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    passes = 2 if method == "ekfac" else 1
    assert counting.calls == 5 * passes - (after - 1)  # the batches done before the kill were not computed again


def test_an_arnoldi_fit_killed_mid_iteration_resumes_to_the_same_eigenpairs_bitwise(tmp_path):
    model, train, _ = worker.setting()
    settings = {"method": "arnoldi", "arnoldi_dim": 6, "projection_dim": 3, "damping": 0.1, "progress": False}
    whole = InfluenceFunction(model, CE, **settings).fit(train).state
    path = tmp_path / "fit.ckpt"
    with pytest.raises(Interrupted):  # 5 batches a step: call 13 is in step 3, after steps 1 and 2 were saved
        InfluenceFunction(model, Counting(13), **settings).fit(train, path, 0.0)
    counting = Counting()
    resumed = InfluenceFunction(model, counting, **settings).fit(train, path, 0.0).state
    assert sorted(resumed) == sorted(whole)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert counting.calls == 5 * 6 - 10  # steps 3 to 6 only
    with pytest.raises(ValueError, match=r"another fit.*arnoldi_dim"):  # another Krylov space: refused
        InfluenceFunction(model, CE, **{**settings, "arnoldi_dim": 8}).fit(train, path)


def test_a_checkpoint_is_refused_for_another_fit_or_other_batches(tmp_path):
    model, train, _ = worker.setting()
    path = tmp_path / "fit.ckpt"
    with pytest.raises(Interrupted):
        InfluenceFunction(model, Counting(3), progress=False).fit(train, path, 0.0)
    with pytest.raises(ValueError, match=r"another fit.*seed"):
        InfluenceFunction(model, CE, seed=1, progress=False).fit(train, path)
    changed = [(x + 1, y) if i == 1 else (x, y) for i, (x, y) in enumerate(train)]
    with pytest.raises(ValueError, match="batch 1 of the training source differs"):
        InfluenceFunction(model, CE, progress=False).fit(changed, path)
    with torch.no_grad():
        model[0].weight[0, 0] += 1
    with pytest.raises(ValueError, match="model"):
        InfluenceFunction(model, CE, progress=False).fit(train, path)
    with pytest.raises(ValueError, match="applies to the diagonal, K-FAC, EK-FAC and Arnoldi fits, not method='exact'"):
        InfluenceFunction(model, CE, method="exact", progress=False).fit(train, path)


def test_scores_refuse_the_fitted_source_when_its_batches_changed():
    model, train, test = worker.setting()
    x = torch.cat([b[0] for b in train])
    y = torch.cat([b[1] for b in train])
    dataset = torch.utils.data.TensorDataset(x, y)
    shuffled = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True, generator=shuffled)
    influence = InfluenceFunction(model, CE, progress=False).fit(loader)
    with pytest.raises(ValueError, match=r"changed since \.fit.*shuffle=False"):
        influence.scores(test, loader)  # a shuffled loader: other batches than the fit's
    steady = torch.utils.data.DataLoader(dataset, batch_size=5)
    fitted = InfluenceFunction(model, CE, progress=False).fit(steady)
    assert fitted.scores(test, steady).shape == (4, 23)  # the same batches again
    assert fitted.scores(test, train[:2]).shape == (4, 10)  # another source: scored, not compared
    x[7] += 1  # the dataset's tensor changed in place since the fit: batch 1
    with pytest.raises(ValueError, match="its batch 1 is not the one the fit read"):
        fitted.self_influence(steady)


@pytest.mark.slow
def test_two_torchrun_processes_give_the_one_process_factors_and_scores(tmp_path):
    torchrun(worker.__file__, str(tmp_path))
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    one, scores, self_influence = worker.fitted()
    for key, value in one.state.items():
        if key.startswith("q_"):  # eigenvectors: equal up to each column's sign
            value, other = value.abs(), two["state"][key].abs()
        else:
            other = two["state"][key]
        torch.testing.assert_close(other, value, rtol=1e-12, atol=1e-14, msg=key)
    torch.testing.assert_close(two["scores"], scores, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(two["self"], self_influence, rtol=1e-10, atol=1e-12)


def test_streamed_scores_are_the_scores_row_by_row_and_a_second_run_reads_them_back(tmp_path):
    model, train, test = worker.setting()
    dataset = torch.utils.data.TensorDataset(torch.cat([b[0] for b in train]), torch.cat([b[1] for b in train]))
    influence = InfluenceFunction(model, CE, progress=False).fit(train)
    results = influence.stream_scores(test, dataset, tmp_path / "scores", batch_size=4)
    expected = influence.scores(test, torch.utils.data.DataLoader(dataset, batch_size=4))
    stored = torch.stack([torch.as_tensor(results.maps[j]) for j in range(len(results))])
    assert stored.dtype == torch.float32 and stored.shape == (23, 4)
    torch.testing.assert_close(stored.double(), expected.T, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    calls = Counting()
    again = InfluenceFunction(model, calls, progress=False)
    again.state, again.train_digests = influence.state, influence.train_digests
    reread = again.stream_scores(test, dataset, tmp_path / "scores", batch_size=4)
    assert calls.calls == 1  # the test batch only: every training row was read back from the store
    assert torch.equal(torch.as_tensor(reread.maps[22]), torch.as_tensor(results.maps[22]))
    with pytest.raises(ValueError, match="other settings"):  # other test examples: another computation, refused
        influence.stream_scores((test[0] + 1, test[1]), dataset, tmp_path / "scores", batch_size=4)
    with pytest.raises(TypeError, match="map-style Dataset"):
        influence.stream_scores(test, iter(train), tmp_path / "other")
