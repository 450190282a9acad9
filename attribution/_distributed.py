"""``torch.distributed`` under ``torchrun``: a process group from its environment, shares, reductions.

The dataset store's runs (``attribution/datasets``) and dictionary training (``attribution/dictionaries``) split
their work over the processes with these; in one process every function is the identity (or takes everything).
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import torch
import torch.distributed as dist

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup() -> tuple[int, int]:
    """``(rank, world_size)``, first initialising the process group from torchrun's environment if needed.

    A group the user initialised is used as it is. Under ``torchrun`` with more than one process and no group yet,
    one is created from the environment variables torchrun sets: gloo for CPU tensors, plus NCCL for CUDA tensors
    when CUDA is available (``"cpu:gloo,cuda:nccl"``; each process then uses the GPU ``LOCAL_RANK``). It is
    destroyed when the process exits. Outside torchrun this is one process: ``(0, 1)``.
    """
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
    """Destroy the process group :func:`setup` created (at exit, so that torch does not warn about a leak)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    """Whether a process group with more than one process is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def share(count: int, rank: int, world: int) -> range:
    """The units ``0..count-1`` that ``rank`` takes: every ``world``-th from ``rank`` on (no padding, no overlap)."""
    return range(rank, count, world)


def device() -> torch.device:
    """Where tensors for collectives must live: the CPU, unless the group has no CPU backend (NCCL alone)."""
    if active() and "cpu:" not in dist.get_backend_config():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Wait for every process (a no-op in one process)."""
    if active():
        dist.barrier()


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all processes (a new tensor on the tensor's device; itself in one process)."""
    if not active():
        return tensor
    reduced = tensor.detach().to(device(), copy=True)  # a copy: the caller's tensor is never reduced in place
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced.to(tensor.device)


def all_max(value: int) -> int:
    """The largest ``value`` of all processes."""
    if not active():
        return value
    reduced = torch.tensor([value], dtype=torch.int64, device=device())
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return int(reduced.item())


def all_gather(value: Any) -> list[Any]:
    """Every process's ``value`` (picklable), in rank order."""
    if not active():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
