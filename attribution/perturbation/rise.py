"""RISE (Petsiuk et al., 2018): the target score under random smooth masks, averaged with the masks as weights."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..targets import Target
from ._base import PerturbationMethod
from ._evaluate import nan_items
from ._masks import rise_masks


class RISE(PerturbationMethod):
    """RISE (Petsiuk et al., 2018, https://arxiv.org/abs/1806.07421): ``sum_i S(x * M_i) M_i / (N p)``.

    Each of the ``N = masks`` masks is a random ``cell x cell`` grid of cells kept with probability ``p``,
    upsampled bilinearly to ``(cell + 1)`` cells of ``ceil(H / cell) x ceil(W / cell)`` pixels and cropped to
    ``(H, W)`` at a random shift within one cell. The masks act on the last two axes of an item (all channels
    alike); the map is the same in every channel, shaped like ``inputs``. ``S`` is the target score: a logit for
    class targets (the paper uses the class probability: pass a callable target for it).

    Args:
        model: the network.
        masks: the number of masks ``N``.
        cell: the grid's cells per side ``s``.
        p: the probability that a cell is kept.
        seed: the seed of the grids and shifts.
        perturbations_per_forward: masks per model call; ``None``: as many as fit the memory budget.
        show_progress: a progress bar on a terminal for calls that take more than a second.

    Example:
        >>> import torch
        >>> from attribution import RISE
        >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2))
        >>> RISE(model, masks=50, cell=4)(torch.randn(1, 1, 8, 8), target=0).shape
        torch.Size([1, 1, 8, 8])
    """

    def __init__(
        self,
        model: nn.Module,
        masks: int = 4000,
        cell: int = 7,
        p: float = 0.5,
        seed: int = 0,
        *,
        perturbations_per_forward: int | None = None,
        show_progress: bool = True,
    ) -> None:
        super().__init__(
            model, baseline=0.0, perturbations_per_forward=perturbations_per_forward, show_progress=show_progress
        )
        for name, value in (("masks", masks), ("cell", cell)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1; got {value!r}")
        if not 0 < p <= 1:
            raise ValueError(f"`p` must be in (0, 1]; got {p!r}")
        self.masks, self.cell, self.p, self.seed = masks, cell, float(p), seed

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The saliency map, shaped like ``inputs`` (the same in every channel)."""
        x, single = self._inputs(inputs)
        if not x.is_floating_point() or x.dim() < 3:
            raise TypeError(
                f"RISE masks images: `inputs` must be floating-point (batch, ..., H, W); got {tuple(x.shape)} {x.dtype}"
            )
        h, w = x.shape[-2:]
        grids, shifts = self._draw(h, w)
        lead = (1,) * (x.dim() - 3)

        def weights(first: int, stop: int) -> torch.Tensor:
            return rise_masks(grids[first:stop], shifts[first:stop], (h, w)).view(stop - first, *lead, h, w)

        with self._evaluator(x, target) as run:
            scores = run.scores(self.masks, weights)
        self.forwards = run.forwards
        total = scores.new_zeros(x.shape[0], h, w, dtype=torch.float64)
        for first in range(0, self.masks, 256):
            stop = min(self.masks, first + 256)
            m = rise_masks(grids[first:stop], shifts[first:stop], (h, w)).to(scores.device)
            total += torch.einsum("bk,khw->bhw", scores[:, first:stop].double(), m)
        saliency = (total / (self.masks * self.p)).view(x.shape[0], *lead, h, w).expand_as(x).contiguous()
        saliency = nan_items(saliency, torch.cat([run.full[:, None], scores], 1), "RISE")
        return run.result(saliency, single)

    def _draw(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The binary grids ``(N, s, s)`` and the shifts ``(N, 2)``, from a generator seeded with ``seed``."""
        generator = torch.Generator().manual_seed(self.seed)
        grids = (torch.rand(self.masks, self.cell, self.cell, generator=generator) < self.p).double()
        cell_h, cell_w = math.ceil(h / self.cell), math.ceil(w / self.cell)
        dy = torch.randint(cell_h, (self.masks,), generator=generator)
        dx = torch.randint(cell_w, (self.masks,), generator=generator)
        return grids, torch.stack([dy, dx], 1)
