"""TracIn: captum's analytic 1-D case, parity with captum's TracInCP, the sign convention, errors, the model kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from attribution.influence import RandomProjection, TracIn, per_example_gradients
from tests.support import hook_state

MSE = nn.MSELoss(reduction="none")
CE = nn.CrossEntropyLoss(reduction="none")


def test_analytic_one_dimensional_case():
    # y = w x with labels y = x and squared loss: g = 2 x (w x - x) = 2 x^2 (w - 1) at each checkpoint
    model = nn.Linear(1, 1, bias=False).double()
    ws, rates = [0.5, 2.0, -1.0], [0.1, 0.2, 0.3]
    checkpoints = [({"weight": torch.tensor([[w]], dtype=torch.float64)}, r) for w, r in zip(ws, rates, strict=True)]
    x_test = torch.tensor([[1.0], [-2.0]], dtype=torch.float64)
    x_train = torch.tensor([[0.5], [3.0], [-1.5]], dtype=torch.float64)
    tracin = TracIn(model, checkpoints, MSE)
    scores = tracin.scores((x_test, x_test), (x_train, x_train))
    expected = sum(r * (2 * x_test**2 * (w - 1)) @ (2 * x_train**2 * (w - 1)).T for w, r in zip(ws, rates, strict=True))
    torch.testing.assert_close(scores, expected, rtol=1e-12, atol=0)
    self_inf = tracin.self_influence((x_train, x_train))
    torch.testing.assert_close(
        self_inf, sum(r * (2 * x_train[:, 0] ** 2 * (w - 1)) ** 2 for w, r in zip(ws, rates, strict=True))
    )


def mlp_setting(features=5, bias=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(12, features, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    states = []
    optimiser = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(3):
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        optimiser.zero_grad()
        CE(model(x), y).mean().backward()
        optimiser.step()
    model.zero_grad(set_to_none=True)
    return model, x, y, states


@pytest.mark.peers
@pytest.mark.slow
def test_equals_captum_tracincp(tmp_path):
    captum = pytest.importorskip("captum.influence")
    model, x, y, states = mlp_setting()
    rates = [0.3, 0.2, 0.1]
    paths = []
    for i, state in enumerate(states):
        paths.append(str(tmp_path / f"ckpt{i}.pt"))
        torch.save(state, paths[-1])
    rate_of = dict(zip(paths, rates, strict=True))

    def load(net, path):
        net.load_state_dict(torch.load(path, weights_only=True))
        return rate_of[path]

    train = TensorDataset(x[4:], y[4:])
    reference = captum.TracInCP(model, train, paths, load, loss_fn=CE, batch_size=3)
    expected = reference.influence((x[:4], y[:4]))
    expected_self = reference.self_influence()
    model.load_state_dict(states[-1])
    tracin = TracIn(model, list(zip(paths, rates, strict=True)), CE)
    loader = DataLoader(train, batch_size=3)
    torch.testing.assert_close(tracin.scores((x[:4], y[:4]), loader), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(tracin.self_influence(loader), expected_self, rtol=1e-6, atol=0)


def test_duplicate_is_the_top_proponent_and_a_relabelled_copy_the_top_opponent():
    # 40 input features: the inputs of different examples are nearly orthogonal, so a copy's gradient dominates
    model, x, y, states = mlp_setting(features=40)
    test = (x[:3], y[:3])
    train_x = torch.cat([x[3:], x[:3], x[:3]])
    train_y = torch.cat([y[3:], y[:3], (y[:3] + 1) % 3])  # copies, then copies with another label
    tracin = TracIn(model, [(s, 0.1) for s in states], CE)
    values, indices = tracin.top(test, (train_x, train_y), k=2)
    assert indices[:, 0].tolist() == [9, 10, 11] and bool((values[:, 0] > 0).all())
    values, indices = tracin.top(test, (train_x, train_y), k=2, proponents=False)
    assert indices[:, 0].tolist() == [12, 13, 14] and bool((values[:, 0] < 0).all())


def test_projected_tracin_is_the_inner_product_of_projected_gradients_and_close_to_exact():
    model, x, y, states = mlp_setting(features=40, bias=False)
    projection = RandomProjection(128, seed=0)
    tracin = TracIn(model, [(states[0], 0.5)], CE, modules=["0"], projection=projection)
    projected = tracin.scores((x[:4], y[:4]), (x, y))
    model.load_state_dict(states[0])
    g = per_example_gradients(model, (x, y), CE, modules=["0"], projection=projection)["0.weight"]
    torch.testing.assert_close(projected, 0.5 * g[:4] @ g.T, rtol=1e-12, atol=1e-15)
    exact = TracIn(model, [(states[0], 0.5)], CE, modules=["0"]).scores((x[:4], y[:4]), (x, y))
    assert torch.corrcoef(torch.stack([projected.flatten(), exact.flatten()]))[0, 1] > 0.95


def test_model_is_given_back_its_parameters_also_on_error():
    model, x, y, states = mlp_setting()
    model.train()
    before, hooks_before = {k: v.clone() for k, v in model.state_dict().items()}, hook_state(model)
    tracin = TracIn(model, [(s, 0.1) for s in states], CE)
    tracin.scores((x, y), (x, y))
    calls = []

    def failing(outputs, batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return CE(outputs, batch[1])

    with pytest.raises(RuntimeError, match="boom"):
        TracIn(model, [(s, 0.1) for s in states], failing).scores((x, y), (x, y))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and hook_state(model) == hooks_before
    assert all(p.grad is None for p in model.parameters())


def test_mismatched_checkpoint_and_bad_arguments_are_refused():
    model, x, y, states = mlp_setting()
    wrong = dict(states[0])
    wrong["2.weight"] = torch.zeros(4, 7)
    del wrong["0.bias"]
    with pytest.raises(ValueError, match=r"missing \['0.bias'\].*2.weight: \(4, 7\) vs the model's \(3, 7\)"):
        TracIn(model, [(wrong, 0.1)], CE).scores((x, y), (x, y))
    with pytest.raises(ValueError, match="non-empty list"):
        TracIn(model, [], CE)
    with pytest.raises(TypeError, match="pair"):
        TracIn(model, [states[0]], CE)
    with pytest.raises(ValueError, match="reduction='mean'"):
        TracIn(model, [(states[0], 0.1)], nn.CrossEntropyLoss())


class _CountingCE(nn.CrossEntropyLoss):
    def __init__(self) -> None:
        super().__init__(reduction="none")
        self.calls = 0

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(outputs, labels)


def test_streamed_scores_are_the_scores_row_by_row_and_a_second_run_reads_them_back(tmp_path):
    model, x, y, states = mlp_setting()
    torch.save(states[1], tmp_path / "1.pt")  # a path checkpoint beside state dicts
    checkpoints = [(states[0], 0.3), (str(tmp_path / "1.pt"), 0.2), (states[2], 0.1)]
    tracin, dataset = TracIn(model, checkpoints, CE), TensorDataset(x[2:], y[2:])
    before, own = hook_state(model), {k: v.clone() for k, v in model.state_dict().items()}
    results = tracin.stream_scores((x[:2], y[:2]), dataset, tmp_path / "scores", batch_size=4)
    assert hook_state(model) == before and all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    expected = tracin.scores((x[:2], y[:2]), (x[2:], y[2:]))
    stored = torch.stack([torch.as_tensor(results.maps[j]) for j in range(len(results))])
    assert stored.shape == (10, 2)
    torch.testing.assert_close(stored.double(), expected.T, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    counting = _CountingCE()
    again = TracIn(model, checkpoints, counting).stream_scores((x[:2], y[:2]), dataset, tmp_path / "scores")
    assert counting.calls == 3  # the test batch once per checkpoint: every training row read back from the store
    assert torch.equal(torch.as_tensor(again.maps[9]), torch.as_tensor(results.maps[9]))
    other_rate = TracIn(model, [*checkpoints[:2], (states[2], 0.5)], CE)
    for run in (lambda: other_rate.stream_scores((x[:2], y[:2]), dataset, tmp_path / "scores"),
                lambda: tracin.stream_scores((x[:3], y[:3]), dataset, tmp_path / "scores")):  # fmt: skip
        with pytest.raises(ValueError, match="other settings"):  # another computation: refused, nothing mixed
            run()


def test_a_streamed_run_that_raises_leaves_the_model_as_found(tmp_path):
    model, x, y, states = mlp_setting()
    before, own = hook_state(model), {k: v.clone() for k, v in model.state_dict().items()}

    class Failing(_CountingCE):
        def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if self.calls == 5:  # the test batch 3 times, then in the second training batch's checkpoints
                raise RuntimeError("stopped")
            return super().forward(outputs, labels)

    tracin = TracIn(model, [(s, 0.1) for s in states], Failing())
    with pytest.raises(RuntimeError, match="stopped"):
        tracin.stream_scores((x[:2], y[:2]), TensorDataset(x[2:], y[2:]), tmp_path / "scores", batch_size=4)
    assert hook_state(model) == before
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
