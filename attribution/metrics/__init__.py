"""How faithful is an attribution? Perturbation metrics, the pointing game, randomisation, infidelity, sensitivity.

Each metric takes the model, the inputs (images ``(B, C, H, W)``, or model inputs that hold them, as the CAMs take
them), the maps ``(B, H, W)`` of any method and the target in the forms the CAMs take, and returns a small result
with one value per image. Perturbed inputs run in batches in
eval mode without autograd, and the model is left exactly as it was found. :func:`infidelity` and
:func:`sensitivity_max` (captum's definitions) take attributions shaped like the inputs, of any inputs, and return
``(B,)``.

Example:
    >>> import torch
    >>> from attribution.metrics import deletion, insertion
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4)).eval()
    >>> images, maps = torch.randn(2, 3, 8, 8), torch.rand(2, 8, 8)
    >>> deletion(model, images, maps, steps=8).auc.shape, insertion(model, images, maps, steps=8).scores.shape
    (torch.Size([2]), torch.Size([2, 9]))
"""

from .deletion import CurveResult, deletion, deletion_insertion, insertion
from .infidelity import infidelity
from .pointing import PointingResult, pointing_game
from .randomization import RandomizationResult, randomization_test
from .road import RoadResult, road
from .sensitivity import sensitivity_max

__all__ = [
    "CurveResult",
    "PointingResult",
    "RandomizationResult",
    "RoadResult",
    "deletion",
    "deletion_insertion",
    "infidelity",
    "insertion",
    "pointing_game",
    "randomization_test",
    "road",
    "sensitivity_max",
]
