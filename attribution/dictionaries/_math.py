"""Pure tensor math of sparse dictionaries: activations, losses, the report's numbers, directions."""

from __future__ import annotations

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
