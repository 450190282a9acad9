"""Leave the model as it was found: train/eval flags of every module, the grad mode, no hooks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Run the body with ``model`` in eval mode, outside inference mode; restore every module's flag and the grad mode.

    Dropout would make a saliency map random and batch norm in train mode would update its running statistics (so
    the model's later outputs would change): attribution calls therefore run in eval mode, whatever the model's
    mode, and put each module's own ``training`` flag back afterwards, also when the body raises.
    """
    flags = [(m, m.training) for m in model.modules()]
    grad_mode = torch.is_grad_enabled()
    try:
        if any(flag for _, flag in flags):
            model.eval()
        with torch.inference_mode(False):
            yield
    finally:
        for module, flag in flags:
            if module.training != flag:
                module.training = flag
        torch.set_grad_enabled(grad_mode)
