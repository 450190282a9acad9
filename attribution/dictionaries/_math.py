"""Pure tensor math of sparse dictionaries: activations, losses, the report's numbers, directions."""

from __future__ import annotations

from typing import Any

import torch


def relu(pre: torch.Tensor) -> torch.Tensor:
    """``max(pre, 0)``."""
    return torch.relu(pre)


def topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest of ``relu(pre)`` along the last axis kept, every other entry zero.

    Example:
        >>> topk(torch.tensor([[3.0, -1.0, 2.0, 0.5]]), 2)
        tensor([[3., 0., 2., 0.]])
    """
    positive = torch.relu(pre)
    values, indices = positive.topk(min(k, pre.shape[-1]), dim=-1, sorted=False)
    return torch.zeros_like(positive).scatter(-1, indices, values)


def batch_topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k * rows`` largest of ``relu(pre)`` over the whole batch kept (Bussmann et al. 2024), zero elsewhere.

    ``rows`` is the number of vectors (every axis but the last).

    Example:
        >>> batch_topk(torch.tensor([[3.0, 2.0], [0.5, 1.0]]), 1)
        tensor([[3., 2.],
                [0., 0.]])
    """
    positive = torch.relu(pre)
    flat = positive.reshape(-1)
    values, indices = flat.topk(min(k * (flat.numel() // max(pre.shape[-1], 1)), flat.numel()), sorted=False)
    return torch.zeros_like(flat).scatter(0, indices, values).reshape(pre.shape)


def jumprelu(pre: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``pre * (pre > threshold)`` (Rajamanoharan et al. 2024).

    Example:
        >>> jumprelu(torch.tensor([0.2, 0.6, -1.0]), torch.tensor([0.5, 0.5, -2.0]))
        tensor([ 0.0000,  0.6000, -1.0000])
    """
    return pre * (pre > threshold).to(pre.dtype)


def thresholded(pre: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``relu(pre) * (pre > threshold)``: BatchTopK at inference, one threshold for every feature."""
    return torch.relu(pre) * (pre > threshold).to(pre.dtype)


def rectangle(u: torch.Tensor) -> torch.Tensor:
    """The rectangle kernel ``1 if -1/2 < u < 1/2 else 0`` (Rajamanoharan et al. 2024).

    Example:
        >>> rectangle(torch.tensor([-0.5, -0.2, 0.0, 0.49, 0.5]))
        tensor([0., 1., 1., 1., 0.])
    """
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class _JumpReLU(torch.autograd.Function):
    """``pre * (pre > threshold)`` with the straight-through estimator of the threshold's gradient."""

    @staticmethod
    def forward(ctx: Any, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        pre, threshold = ctx.saved_tensors
        kernel = rectangle((pre - threshold) / ctx.bandwidth)
        to_threshold = (-(threshold / ctx.bandwidth) * kernel * grad).reshape(-1, pre.shape[-1]).sum(0)
        return (pre > threshold).to(grad.dtype) * grad, to_threshold, None


class _Step(torch.autograd.Function):
    """``pre > threshold`` as 0/1 with the straight-through estimator of the threshold's gradient (none to ``pre``)."""

    @staticmethod
    def forward(ctx: Any, pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        pre, threshold = ctx.saved_tensors
        kernel = rectangle((pre - threshold) / ctx.bandwidth)
        return None, (-(1 / ctx.bandwidth) * kernel * grad).reshape(-1, pre.shape[-1]).sum(0), None


def jumprelu_ste(pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """:func:`jumprelu` whose gradients are the paper's (Rajamanoharan et al. 2024, eq. 11).

    ``d/d pre = (pre > threshold)``; ``d/d threshold = -(threshold / bandwidth) * rectangle((pre - threshold) /
    bandwidth)``, summed over the rows, a straight-through estimate of the jump's derivative.

    Example:
        >>> t = torch.tensor([0.5], requires_grad=True)
        >>> jumprelu_ste(torch.tensor([[0.52], [0.9]]), t, 0.1).sum().backward()
        >>> t.grad  # only the first row is within bandwidth / 2 of the threshold: -0.5 / 0.1
        tensor([-5.])
    """
    return _JumpReLU.apply(pre, threshold, bandwidth)


def step_ste(pre: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
    """``(pre > threshold)`` as 0/1, summed into the L0 penalty; straight-through gradient to the threshold.

    ``d/d threshold = -(1 / bandwidth) * rectangle((pre - threshold) / bandwidth)`` (Rajamanoharan et al. 2024,
    eq. 12), summed over the rows; no gradient to ``pre``.

    Example:
        >>> t = torch.tensor([0.5], requires_grad=True)
        >>> step_ste(torch.tensor([[0.52], [0.9]]), t, 0.1).sum().backward()
        >>> t.grad
        tensor([-10.])
    """
    return _Step.apply(pre, threshold, bandwidth)


def l1_penalty(features: torch.Tensor, decoder: torch.Tensor) -> torch.Tensor:
    """``sum_i f_i |W_dec[i]|`` per vector: the L1 norm of the features weighted by their decoder rows' norms.

    Example:
        >>> l1_penalty(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0], [0.0, 0.5]]))  # 1 * 5 + 2 * 0.5
        tensor([6.])
    """
    return (features.abs() * decoder.norm(dim=-1)).sum(-1)


def warmed_up(value: float, step: int, steps: int) -> float:
    """``value`` scaled by ``(step + 1) / steps`` during the first ``steps`` steps (a linear warm-up), then itself.

    Example:
        >>> [warmed_up(2.0, s, 4) for s in range(5)]
        [0.5, 1.0, 1.5, 2.0, 2.0]
    """
    return value * (step + 1) / steps if step < steps else value


def unit_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with every row scaled to unit norm (a zero row stays zero)."""
    norms = weight.norm(dim=-1, keepdim=True)
    return weight / torch.where(norms > 0, norms, torch.ones_like(norms))


def without_parallel_gradient(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` less its component along each unit row of ``weight``: the step keeps the rows' norms to first order."""
    rows = unit_rows(weight)
    return grad - (grad * rows).sum(-1, keepdim=True) * rows


def auxiliary_topk(pre: torch.Tensor, dead: torch.Tensor, k_aux: int) -> torch.Tensor:
    """The ``k_aux`` largest ReLU'd pre-activations among the ``dead`` features per row (Gao et al. 2024, AuxK)."""
    masked = torch.where(dead, torch.relu(pre), torch.zeros_like(pre))
    return topk(masked, min(k_aux, int(dead.sum())))


def fvu(sq_error: float, sum_x: torch.Tensor, sum_sq: float, rows: int) -> float:
    """The fraction of variance unexplained from running sums: ``sq_error / (sum |x|^2 - |sum x|^2 / rows)``.

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
        >>> fvu(1.0, x.sum(0), float(x.pow(2).sum()), 2)  # sum |x - mean|^2 = (1 + 4) + (1 + 4) = 10
        0.1
    """
    total = sum_sq - float(sum_x.pow(2).sum()) / rows
    return sq_error / total if total > 0 else float("nan")


def loss_recovered(clean: float, spliced: float, zero: float) -> float:
    """``(zero - spliced) / (zero - clean)``: 1 when splicing costs nothing, 0 when it is as bad as zero-ablation.

    Example:
        >>> loss_recovered(clean=2.0, spliced=2.5, zero=4.0)
        0.75
    """
    return (zero - spliced) / (zero - clean) if zero != clean else float("nan")


def next_token_kl(clean_logits: torch.Tensor, spliced_logits: torch.Tensor) -> torch.Tensor:
    """KL(clean || spliced) of the softmax distributions at every position: ``(...)`` from ``(..., vocab)``."""
    clean = torch.log_softmax(clean_logits.double(), dim=-1)
    spliced = torch.log_softmax(spliced_logits.double(), dim=-1)
    return (clean.exp() * (clean - spliced)).sum(-1)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of each next token: ``(batch, tokens - 1)`` from logits ``(batch, tokens, vocab)``."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None].to(logp.device)).squeeze(-1)


def project_out(x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """``x`` less its component along the unit vector of ``direction`` (last axis).

    Example:
        >>> project_out(torch.tensor([[3.0, 4.0]]), torch.tensor([2.0, 0.0]))
        tensor([[0., 4.]])
    """
    unit = direction / direction.norm()
    return x - (x @ unit)[..., None] * unit
