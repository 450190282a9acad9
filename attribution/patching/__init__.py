"""Patching for any ``nn.Module``: record activations, patch them in, sweep over layers/positions/heads.

A *site* is the output (or the first input) of a named module; for modules that return tuples, mappings or
HuggingFace ``ModelOutput`` objects, ``element`` picks the tensor (an attention block returning ``(out, weights)``:
``element=0``; a ``ModelOutput``: ``element="last_hidden_state"``). For ``site="input"`` the site is the module's
first argument as called (positional, else the first keyword argument), and ``element`` names another one (a
position, or a parameter name such as ``"hidden_states"``). Positions index the activation's axis 1
(``(batch, tokens, ...)``); heads are read through an einops pattern that splits the last axis,
``"b t (h d) -> b t h d"`` by default.

Three sweeps share one kernel (``patching/_sweep.py``): :func:`activation_patching` (exact, one forward
per cell), :func:`attribution_patching` (every cell estimated from one backward pass) and :func:`path_patching` (one
sender's effect through chosen receivers only). Each returns a :class:`PatchingResult`: a tensor whose ``axes`` and
``labels`` (module names, positions, heads, examples) the plots read.
"""

from ._sweep import Cells
from .activation import activation_patching
from .attribution import attribution_patching
from .path import path_patching
from .result import PatchingResult
from .sites import Patch, Recorded, patch, record, replace

__all__ = [
    "Cells",
    "Patch",
    "PatchingResult",
    "Recorded",
    "activation_patching",
    "attribution_patching",
    "patch",
    "path_patching",
    "record",
    "replace",
]
