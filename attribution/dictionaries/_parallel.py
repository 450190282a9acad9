"""Data parallel training under ``torchrun``: each process's share of a batch and the collectives of one step.

Every function is the identity (or takes everything) in one process, so that the one-process run computes exactly
what it computed before data parallelism existed. The process group is the one the dataset store uses (created from
torchrun's environment by whichever of the two comes first): gloo on the CPU, plus NCCL for CUDA tensors when
CUDA is available. (The few lines shared with ``attribution/datasets/_distributed.py`` are repeated here, since a
family imports no private name of another; they would belong in the kernel.)
"""

from __future__ import annotations

import atexit
import os

import numpy as np
import torch
import torch.distributed as dist

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup() -> tuple[int, int]:
    """``(rank, world_size)``, first creating the process group from torchrun's environment if there is none."""
    if not dist.is_available():
        return 0, 1
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not all(name in os.environ for name in _TORCHRUN_VARIABLES) or int(os.environ["WORLD_SIZE"]) <= 1:
        return 0, 1
    backend = "gloo"
    if torch.cuda.is_available() and dist.is_nccl_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    atexit.register(_destroy)
    return dist.get_rank(), dist.get_world_size()


def _destroy() -> None:
    """Destroy the process group at exit (so that torch does not warn about a leak)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    """Where tensors for collectives must live: the CPU, unless the group has no CPU backend (NCCL alone)."""
    if active() and "cpu:" not in dist.get_backend_config():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every process (a no-op in one process)."""
    if active():
        dist.barrier()


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over the processes (a new tensor in several processes; itself in one)."""
    if not active():
        return tensor
    reduced = tensor.detach().to(_device(), copy=True)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(tensor.device)


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
    reduced = value.detach().reshape(1).to(_device())
    dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
    return reduced.to(value.device).reshape(())


def gather(values: torch.Tensor) -> torch.Tensor:
    """Every process's ``values`` (one shape in all) concatenated along the first axis, in rank order."""
    if not active():
        return values
    local = values.detach().contiguous().to(_device())
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
            sent = t.detach().to(_device())
            dist.broadcast(sent, src=0)
            t.copy_(sent.to(t.device))
