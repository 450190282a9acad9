"""Pure tensor math of edge attribution: head writes, per-reader slices, the norm's vector-Jacobian product."""

from __future__ import annotations

from collections.abc import Callable

import torch


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32, so that half-precision activations are not multiplied and summed in half precision."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def head_writes(z: torch.Tensor, w_o: torch.Tensor, heads: int) -> torch.Tensor:
    """What each head adds to the residual stream: ``(heads, batch, tokens, d_model)``.

    Args:
        z: ``(batch, tokens, heads * d_head)``, the heads side by side (the output projection's input).
        w_o: ``(d_model, heads * d_head)``, the output projection's weight as ``(out, in)``.
        heads: the number of heads.

    Example:
        >>> z, w = torch.randn(2, 3, 4), torch.randn(5, 4)
        >>> bool(torch.allclose(head_writes(z, w, 2).sum(0), z @ w.T, atol=1e-6))
        True
    """
    return torch.einsum("bthe,dhe->hbtd", z.unflatten(-1, (heads, -1)), w_o.unflatten(1, (heads, -1)))


def split_readers(outputs: list[torch.Tensor], d_head: int) -> torch.Tensor:
    """The q/k/v projections' outputs, one slice per reader: ``(readers, batch, tokens, d_head)``.

    ``outputs`` is ``[q, k, v]`` (each ``(batch, tokens, n * d_head)``) or one fused ``[qkv]`` with q, k and v side
    by side; readers come in graph order (q per head, k per group, v per group).

    Example:
        >>> q, k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 4), torch.randn(1, 2, 4)
        >>> split_readers([q, k, v], 2).shape  # 4 query heads, 2 groups
        torch.Size([8, 1, 2, 2])
    """
    return torch.cat([x.unflatten(-1, (-1, d_head)) for x in outputs], dim=-2).movedim(-2, 0)


def reader_inputs(x: torch.Tensor, x_corrupted: torch.Tensor, deltas: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each reader's input: ``x`` minus the deltas of its writers outside the circuit, ``(readers, *x.shape)``.

    A reader with none outside reads ``x`` itself and one with all its writers outside the corrupted run's residual
    stream ``x_corrupted`` (the same value, bitwise), so that the full and the empty circuits are exact.

    Args:
        x: ``(batch, tokens, d_model)``, the residual stream of the run at the readers.
        x_corrupted: the corrupted run's residual stream at the same place.
        deltas: ``(writers, batch, tokens, d_model)``, each upstream writer's activation minus its corrupted one.
        out: ``(readers, writers)`` boolean, True where the edge is outside the circuit.

    Example:
        >>> x, deltas = torch.ones(1, 1, 2), torch.tensor([[[[1.0, 2.0]]], [[[3.0, 4.0]]]])
        >>> reader_inputs(x, x - deltas.sum(0), deltas, torch.tensor([[True, False], [False, False]])).flatten(1)
        tensor([[ 0., -1.],
                [ 1.,  1.]])
    """
    out = out.to(deltas.device)
    change = (out.to(deltas.dtype) @ deltas.flatten(1)).view(len(out), *x.shape)
    inputs = x.to(change.dtype) - change
    inputs[out.all(1)] = x_corrupted.to(inputs.dtype)
    inputs[~out.any(1)] = x.to(inputs.dtype)
    return inputs.to(x.dtype)


def norm_vjp(norm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
    """``J_norm(x)^T c`` for each cotangent ``c``: ``(readers, *x.shape)`` from ``(readers, *x.shape)``.

    ``norm`` acts on the last axis (LayerNorm, RMSNorm), so it runs once on ``x`` repeated per reader.

    Example:
        >>> norm, x, c = torch.nn.LayerNorm(3), torch.randn(2, 3), torch.randn(4, 2, 3)
        >>> rows = [torch.func.vjp(norm, x)[1](ci)[0] for ci in c]
        >>> bool(torch.allclose(norm_vjp(norm, x, c), torch.stack(rows), atol=1e-6))
        True
    """
    with torch.enable_grad():
        repeated = x.detach().unsqueeze(0).expand(len(cotangents), *x.shape).requires_grad_(True)
        (grad,) = torch.autograd.grad(norm(repeated), repeated, cotangents.to(x.dtype))
    return grad
