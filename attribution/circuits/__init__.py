"""Circuits of decoder-only transformers: edge attribution (EAP, EAP-IG), faithfulness, exact edge effects.

Example:
    >>> import torch, transformers
    >>> from attribution.circuits import edge_attribution, faithfulness
    >>> config = transformers.GPT2Config(vocab_size=20, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    >>> _ = torch.manual_seed(0)
    >>> model = transformers.GPT2LMHeadModel(config).eval()
    >>> clean, corrupted = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 5, 3, 4]])
    >>> metric = lambda out: out.logits[0, -1, 2] - out.logits[0, -1, 5]
    >>> scores = edge_attribution(model, clean, corrupted, metric, progress=False)
    >>> float(faithfulness(model, clean, corrupted, metric, scores.top(scores.scores.isfinite().sum())))
    1.0
"""

from .circuit import Circuit
from .edges import EdgeScores, edge_attribution
from .evaluate import evaluate, exact_edge_effects, faithfulness, faithfulness_curve
from .graph import Graph, read_graph
from .plot import plot_circuit

__all__ = [
    "Circuit",
    "EdgeScores",
    "Graph",
    "edge_attribution",
    "evaluate",
    "exact_edge_effects",
    "faithfulness",
    "faithfulness_curve",
    "plot_circuit",
    "read_graph",
]
