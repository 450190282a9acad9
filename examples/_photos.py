"""Real photos that ship inside installed packages, with object boxes drawn by hand for the pointing game.

matplotlib's sample data has ``grace_hopper.jpg``; scikit-image's wheel has ``chelsea.png`` (a cat), ``coffee.png``,
``astronaut.png`` and ``rocket.jpg`` in ``skimage/data/`` (other scikit-image samples are downloaded on demand and
are not used). Nothing is downloaded.

``BOXES`` gives, for each photo, the box ``(x1, y1, x2, y2)`` of the object named by EfficientNet-Lite0's top class,
in pixels of the 224x224 centre crop that ``_efficientnet_lite0.preprocess`` makes. They were drawn by hand by
looking at the crops on a 16-pixel grid, so they are accurate to a few pixels.
"""

from __future__ import annotations

from _efficientnet_lite0 import grace_hopper
from PIL import Image

PHOTOS = ("grace_hopper", "chelsea", "coffee", "astronaut", "rocket")
"""The photos, by name."""

BOXES = {
    "grace_hopper": (0, 128, 224, 224),  # "academic gown": the dark jacket below the collar
    "chelsea": (0, 0, 224, 224),  # "tiger cat": the cat fills the whole crop
    "coffee": (34, 0, 192, 176),  # "espresso": the cup with the coffee, handle included
    "astronaut": (120, 156, 224, 224),  # "football helmet": the space helmet, bottom right
    "rocket": (98, 56, 129, 224),  # "missile": the rocket on its pad, nose to bottom
}
"""Hand-drawn box of the top class's object in each 224x224 crop, ``(x1, y1, x2, y2)``."""


def photo(name: str) -> Image.Image:
    """Returns one of ``PHOTOS`` as an RGB PIL image (scikit-image is needed for all but ``grace_hopper``)."""
    if name == "grace_hopper":
        return grace_hopper()
    if name not in PHOTOS:
        raise ValueError(f"unknown photo {name!r}; choose from {PHOTOS}")
    from skimage import data

    return Image.fromarray(getattr(data, name)()[..., :3]).convert("RGB")
