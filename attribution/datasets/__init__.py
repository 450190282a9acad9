"""Attribution over whole datasets: the resumable sharded runner, the results reader, aggregates and the CLI.

:func:`attribute_dataset` streams the maps of any method to disk in shards (``runner.py``, ``_shards.py``), on one
process or many under ``torchrun`` (``_distributed.py``); :func:`open_results` reads them back lazily;
``aggregate.py`` reduces them (:func:`class_means`) or averages a patching sweep over prompt pairs
(:func:`mean_patching`); ``cli.py`` is ``python -m attribution.cli`` (the ``hookscope-cam`` script). A folder that
another process is writing to raises :class:`InUseError`. :func:`load_efficientnet_lite0` builds the one set of real
weights the project ships (the command line's ``--model efficientnet_lite0``).
"""

from ._identity import model_digest, tensor_digest
from ._lock import InUseError
from ._shipped import load_efficientnet_lite0
from .aggregate import ClassMeans, PatchingMean, class_means, mean_patching
from .runner import Column, Results, attribute_dataset, open_results

__all__ = [
    "ClassMeans",
    "Column",
    "InUseError",
    "PatchingMean",
    "Results",
    "attribute_dataset",
    "class_means",
    "load_efficientnet_lite0",
    "mean_patching",
    "model_digest",
    "open_results",
    "tensor_digest",
]
