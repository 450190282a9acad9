"""Data parallel training under ``torchrun``: each process's share of a batch and the collectives of one step.

Every function is the identity (or takes everything) in one process, so that the one-process run computes exactly
what it computed before data parallelism existed. The process group and the plain collectives are the kernel's
(``attribution/_distributed.py``, shared with the dataset store): gloo on the CPU, plus NCCL for CUDA tensors when
CUDA is available.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .._distributed import active, all_sum, barrier, device, setup

__all__ = ["active", "all_sum", "any_over_processes", "barrier", "broadcast", "gather", "min_over_processes"]
__all__ += ["device", "setup", "share", "sum_gradients"]


def share(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This process's rows of a step: ``order`` cut into ``world`` contiguous parts that differ by at most one row.

    Example:
        >>> [share(np.arange(5), r, 2).tolist() for r in range(2)]
        [[0, 1, 2], [3, 4]]
    """
    return np.array_split(order, world)[rank] if world > 1 else order


def any_over_processes(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` or'ed over the processes (a bool tensor)."""
    if not active():
        return mask
    return all_sum(mask.to(torch.int32)) > 0


def min_over_processes(value: torch.Tensor) -> torch.Tensor:
    """The smallest of the processes' ``value`` (a 0-d tensor)."""
    if not active():
        return value
    reduced = value.detach().reshape(1).to(device())
    dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
    return reduced.to(value.device).reshape(())


def gather(values: torch.Tensor) -> torch.Tensor:
    """Every process's ``values`` (one shape in all) concatenated along the first axis, in rank order."""
    if not active():
        return values
    local = values.detach().contiguous().to(device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(values.device)


def sum_gradients(parameters: list[torch.Tensor]) -> None:
    """Replace each parameter's ``.grad`` by its sum over the processes (one all-reduce of one flat buffer)."""
    if not active():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = all_sum(torch.cat([g.reshape(-1) for g in grads]))
    for p, part in zip(parameters, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = part.view_as(p).clone()


def broadcast(tensors: list[torch.Tensor]) -> None:
    """Overwrite every process's ``tensors`` with rank 0's (so that all start from the same dictionary)."""
    if not active():
        return
    with torch.no_grad():
        for t in tensors:
            sent = t.detach().to(device())
            dist.broadcast(sent, src=0)
            t.copy_(sent.to(t.device))
