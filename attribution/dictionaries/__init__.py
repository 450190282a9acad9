"""Sparse dictionaries as hook groups: SAEs and transcoders loaded, spliced, trained and evaluated on any model.

A dictionary maps a site's activations ``x (..., d_in)`` to sparse features ``(..., n_features)`` and back:
:class:`SAE` reconstructs the site it reads, :class:`Transcoder` predicts another site (an MLP's output from its
input). Both are plain ``nn.Module`` s (float32 by default, any device) with ``encode``, ``decode`` and ``save``;
:func:`load_dictionary` reads hookscope's format and the folders of SAELens, sparsify, dictionary_learning and
circuit-tracer. :func:`splice` makes a dictionary one hook group of the model, its features and error term sites
that every patching method takes; :func:`train_dictionary` records a site into the dataset store and trains on
it, resumably; :func:`evaluate_dictionary` measures reconstruction and the spliced model's loss. :func:`steer`,
:func:`ablate_direction` and :func:`diff_means` work with directions of a site. Every call that hooks the model
leaves it exactly as it found it.
"""

from .directions import ablate_direction, diff_means, steer
from .evaluate import DictionaryReport, evaluate_dictionary
from .formats import load_dictionary
from .modules import SAE, Dictionary, Transcoder
from .splice import splice
from .train import train_dictionary

__all__ = [
    "Dictionary",
    "DictionaryReport",
    "SAE",
    "Transcoder",
    "ablate_direction",
    "diff_means",
    "evaluate_dictionary",
    "load_dictionary",
    "splice",
    "steer",
    "train_dictionary",
]
