"""Attribution graphs of language models: tokens, MLP neurons or features, logits, and the direct effects between them.

:func:`attribution_graph` explains one prompt as circuit tracing does (Ameisen et al. 2025) with the MLP neurons as
the basis (Transluce 2025), so no trained dictionary is needed; ``basis={mlp: dictionary}`` puts an SAE's or a
transcoder's features, and one error node per position, in place of that MLP's neurons. Every edge is a direct
effect in the frozen model of the prompt (attention probabilities and norm scales held, other nodes held), computed
by batched gradient injection; the :class:`AttributionGraph` holds a node table and a sparse adjacency, and gives
the influence, circuit-tracer's pruning, its graph file, an HTML viewer, a picture and a check on the real model.
"""

from .build import attribution_graph
from .graph import AttributionGraph, Node, Nodes
from .plot import plot_graph
from .verify import Verification

__all__ = ["AttributionGraph", "Node", "Nodes", "Verification", "attribution_graph", "plot_graph"]
