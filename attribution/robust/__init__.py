"""Adversarial robustness: FGSM, PGD and the smallest perturbation that flips a prediction, with captum's semantics.

The attacks take the model, its inputs (a tensor ``(B, ...)`` or a tuple of them, ``model(*inputs)``) and a target
in the forms every method takes, run the model in eval mode with autograd on the inputs only, and return the
perturbed inputs in the form they were given; the model is left exactly as it was found. Their default loss is
captum's ``-log`` of the target's score, which expects a model that outputs probabilities; pass
``loss=torch.nn.CrossEntropyLoss(reduction="none")`` for logits.

Example:
    >>> import torch
    >>> from attribution.robust import fgsm, pgd
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(dim=1)).eval()
    >>> x = torch.randn(2, 4)
    >>> fgsm(model, x, [0, 2], epsilon=0.1).shape, pgd(model, x, epsilon=0.1, step_size=0.05, steps=3).shape
    (torch.Size([2, 4]), torch.Size([2, 4]))
"""

from .attacks import fgsm, pgd
from .minimal import min_perturbation

__all__ = ["fgsm", "min_perturbation", "pgd"]
