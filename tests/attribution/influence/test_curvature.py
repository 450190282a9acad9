"""The curvature blocks' math against dense Kronecker products and hand-made Fishers (float64)."""

from __future__ import annotations

import torch

from attribution.influence import _curvature as cv


def _vec(g: torch.Tensor) -> torch.Tensor:
    """Column-stacked ``vec`` (the convention of ``kron(A, S)``)."""
    return g.transpose(-1, -2).reshape(*g.shape[:-2], -1)


def _data(n: int = 7, t: int = 3, d_in: int = 4, d_out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, t, d_in, generator=g, dtype=torch.float64)
    delta = torch.randn(n, t, d_out, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2, d_out).double()
    return a, delta


def test_block_gradients_are_the_sum_over_positions_of_outer_products() -> None:
    a, delta = _data()
    slow = torch.stack([sum(torch.outer(delta[i, t], a[i, t]) for t in range(a.shape[1])) for i in range(a.shape[0])])
    torch.testing.assert_close(cv.block_gradients(a, delta), slow, rtol=1e-12, atol=1e-12)


def test_bias_column_is_appended_last() -> None:
    a = torch.tensor([[[2.0, -3.0]]])
    assert cv.with_bias_column(a).tolist() == [[[2.0, -3.0, 1.0]]]


def test_kfac_preconditioning_equals_the_dense_kronecker_inverse() -> None:
    a, delta = _data()
    big_a = cv.second_moment(a) / (a.shape[0] * a.shape[1])
    big_s = cv.second_moment(delta) / a.shape[0]
    (l_a, q_a), (l_s, q_s) = cv.eigenbasis(big_a), cv.eigenbasis(big_s)
    g = cv.block_gradients(a, delta)
    ours = cv.precondition_eigen(g, q_s, q_a, cv.kfac_eigenvalues(l_s, l_a), 0.3)
    dense = torch.kron(big_a, big_s) + 0.3 * torch.eye(big_a.shape[0] * big_s.shape[0], dtype=torch.float64)
    expected = torch.linalg.solve(dense, _vec(g).T).T
    torch.testing.assert_close(_vec(ours), expected, rtol=1e-10, atol=1e-12)


def test_ekfac_eigenvalues_refit_give_the_fisher_diagonal_in_the_eigenbasis() -> None:
    a, delta = _data()
    g = cv.block_gradients(a, delta)
    (_, q_a), (_, q_s) = cv.eigenbasis(cv.second_moment(a)), cv.eigenbasis(cv.second_moment(delta))
    lam = (cv.rotate(g, q_s, q_a) ** 2).mean(0)
    basis = torch.kron(q_a, q_s)  # vec(Q_S^T G Q_A) = (Q_A (x) Q_S)^T vec(G)
    fisher = _vec(g).T @ _vec(g) / g.shape[0]
    torch.testing.assert_close(_vec(lam[None])[0], torch.diagonal(basis.T @ fisher @ basis), rtol=1e-10, atol=1e-12)
    ours = cv.precondition_eigen(g, q_s, q_a, lam, 0.05)
    dense = basis @ torch.diag(_vec(lam[None])[0] + 0.05) @ basis.T
    torch.testing.assert_close(_vec(ours), torch.linalg.solve(dense, _vec(g).T).T, rtol=1e-10, atol=1e-12)


def test_kfac_equals_the_fisher_when_the_output_gradients_have_constant_size() -> None:
    """One output, one position, delta = +-sqrt(2): A (x) S is exactly E[g g^T] = 2 X^T X / n."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 1, 3, generator=g, dtype=torch.float64)
    delta = (torch.randint(0, 2, (9, 1, 1), generator=g) * 2 - 1).double() * 2**0.5
    kfac = torch.kron(cv.second_moment(x) / 9, cv.second_moment(delta) / 9)
    torch.testing.assert_close(kfac, 2 * x[:, 0].T @ x[:, 0] / 9, rtol=1e-12, atol=1e-12)


def test_eigenbasis_clamps_round_off_negatives_and_reconstructs() -> None:
    v = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)  # rank one: one eigenvalue is 0 up to round-off
    values, vectors = cv.eigenbasis(v)
    assert (values >= 0).all() and abs(values.max().item() - 5) < 1e-12
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, v, rtol=0, atol=1e-12)


def test_diagonal_preconditioning_and_default_damping() -> None:
    g = torch.tensor([[2.0, -4.0]])
    assert cv.precondition_diagonal(g, torch.tensor([1.0, 3.0]), 1.0).tolist() == [[1.0, -1.0]]
    assert abs(cv.default_damping(torch.tensor([1.0, 3.0], dtype=torch.float64)).item() - 0.2) < 1e-15


def _kronecker_cases() -> list[tuple[torch.nn.Module, torch.Tensor]]:
    from transformers.pytorch_utils import Conv1D

    g = torch.Generator().manual_seed(2)
    conv2 = torch.nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)).double()
    conv1 = torch.nn.Conv1d(2, 4, 3, padding="same", padding_mode="reflect").double()
    frozen = torch.nn.Linear(4, 3).double().requires_grad_(False)
    frozen.bias.requires_grad_(True)
    return [
        (torch.nn.Linear(4, 3).double(), torch.randn(3, 5, 4, generator=g, dtype=torch.float64)),
        (Conv1D(3, 4).double(), torch.randn(3, 5, 4, generator=g, dtype=torch.float64)),
        (conv2, torch.randn(3, 2, 7, 6, generator=g, dtype=torch.float64)),
        (conv1, torch.randn(3, 2, 9, generator=g, dtype=torch.float64)),
        (frozen, torch.randn(3, 5, 4, generator=g, dtype=torch.float64)),
    ]


def test_kronecker_rows_give_each_examples_gradient_as_a_block_and_back() -> None:
    """``sum_t delta_t a_t^T`` over the rows equals the per-example gradient (weight, then the bias as last column)."""
    from attribution.influence import _kronecker as kr
    from attribution.influence import per_example_gradients

    for module, x in _kronecker_cases():
        model = torch.nn.Sequential(module)
        target = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

        def loss(out: torch.Tensor, batch: object, target: torch.Tensor = target) -> torch.Tensor:
            return ((out - target) ** 2 * torch.linspace(0.5, 1.5, out.shape[-1]).double()).flatten(1).sum(1)

        grads = per_example_gradients(model, (x, torch.zeros(len(x))), loss)
        own = {name.split(".")[-1]: g for name, g in grads.items()}
        out = module(x)
        delta = torch.autograd.grad(loss(out, None).sum(), out)[0]
        block = cv.block_gradients(kr.input_rows(module, x), kr.output_rows(module, delta))
        torch.testing.assert_close(block, kr.to_block(module, own), rtol=1e-10, atol=1e-12)
        back = kr.from_block(module, block)
        assert back.keys() == own.keys()
        for key in own:
            torch.testing.assert_close(back[key], own[key], rtol=1e-10, atol=1e-12)
