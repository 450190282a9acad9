"""Check a graph on the real model: scale or ablate neuron nodes, compare the logit nodes' change with the graph's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from .._inputs import call
from .._run import kept_state
from ..models import lm_layout
from ..patching import Patch, patch
from ._math import predicted_change

if TYPE_CHECKING:
    from .graph import AttributionGraph


@dataclass(frozen=True)
class Verification:
    """What :meth:`attribution.AttributionGraph.verify` found, per logit node.

    Attributes:
        nodes: the node numbers changed.
        kind: ``"ablate"`` or ``"steer"``; ``scale``: the factor on their activations (0 for ablation).
        real: ``(logits,)`` the change of each logit node's value in the real model (attention and norms live).
        predicted: ``(logits,)`` the graph's linear prediction (its edges, frozen attention and norms).
        clean: ``(logits,)`` the logit nodes' values before the change.
    """

    nodes: torch.Tensor
    kind: str
    scale: float
    real: torch.Tensor
    predicted: torch.Tensor
    clean: torch.Tensor


def verify(
    graph: AttributionGraph,
    model: nn.Module,
    nodes: Sequence[int] | torch.Tensor,
    *,
    kind: Literal["ablate", "steer"] = "ablate",
    scale: float = 0.0,
) -> Verification:
    """Multiply the activations of neuron ``nodes`` by ``scale`` (0: zero-ablation) in the real model and in the graph.

    The real run patches the down projections' inputs (:func:`attribution.patch`) and reads each logit node's value
    (its logit minus the mean logit, or minus its foil's). The graph's prediction propagates the relative changes
    ``scale - 1`` through its edges, layer by layer (a linear model with frozen attention and norms, through the
    graph's nodes only); a multiplied node also passes on, times ``scale``, what reaches it from the others.

    Args:
        graph: the graph (of ``model`` on ``graph.inputs``).
        model: the model.
        nodes: node numbers of neuron nodes.
        kind: ``"ablate"`` (``scale`` must be 0) or ``"steer"``.
        scale: the factor on the nodes' activations.

    Returns:
        The real and predicted changes of the logit nodes.
    """
    chosen = torch.as_tensor(nodes, dtype=torch.long).flatten()
    if kind not in ("ablate", "steer"):
        raise ValueError(f"`kind` must be 'ablate' or 'steer'; got {kind!r}")
    if kind == "ablate" and scale != 0.0:
        raise ValueError(f"`kind='ablate'` sets the nodes to zero: leave `scale` at 0 (got {scale}) or use 'steer'")
    bad = [int(i) for i in chosen if not 0 <= int(i) < len(graph.nodes) or graph.nodes.kind[int(i)] != "neuron"]
    if bad:
        raise ValueError(f"`nodes` must be numbers of neuron nodes (graph.nodes.where('neuron')); got {bad[:5]}")
    acts = graph.nodes.activation.to(graph.adjacency.dtype)
    factor = torch.ones(len(graph.nodes), dtype=graph.adjacency.dtype)
    factor[chosen] = scale
    moved = predicted_change(graph.adjacency, acts, graph.nodes.layer, factor)
    logits = graph.nodes.where("logit")
    clean = graph.nodes.activation[logits]
    changed = _real_values(graph, model, chosen, scale)
    return Verification(chosen, kind, scale, changed - clean, moved[logits].double(), clean)


def _real_values(graph: AttributionGraph, model: nn.Module, chosen: torch.Tensor, scale: float) -> torch.Tensor:
    """The logit nodes' values in the real model with the chosen neurons' activations scaled."""
    layout = lm_layout(model)
    names = {}
    for layer in sorted(set(graph.nodes.layer[chosen].tolist())):
        here = chosen[graph.nodes.layer[chosen] == layer]
        factor = (graph.nodes.position[here], graph.nodes.index[here])
        names[layout.layers[layer].mlp_parts.neurons] = Patch(_scaled(factor, scale))
    with kept_state(model), torch.no_grad(), patch(model, names, site="input"):
        output = call(model, graph.inputs)
    z = getattr(output, "logits", output)[0, -1].double().cpu()
    logits = graph.nodes.where("logit")
    tokens, foils = graph.nodes.index[logits], graph.foils
    return torch.where(foils >= 0, z[tokens] - z[foils.clamp_min(0)], z[tokens] - z.mean())


def _scaled(where: tuple[torch.Tensor, torch.Tensor], scale: float) -> Any:
    """A patch function: the activation with ``[0, positions, neurons]`` multiplied by ``scale``."""
    positions, neurons = where

    def fn(a: torch.Tensor) -> torch.Tensor:
        out = a.clone()
        out[0, positions.to(a.device), neurons.to(a.device)] *= scale
        return out

    return fn
