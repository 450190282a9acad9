"""Check a graph on the real model: scale or ablate nodes, compare the logit nodes' change with the graph's."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from .._inputs import call
from .._run import kept_state
from ..dictionaries.splice import splice
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
    """Multiply the activations of ``nodes`` by ``scale`` (0: zero-ablation) in the real model and in the graph.

    The real run patches the down projections' inputs for neurons (:func:`attribution.patch`); for features and
    errors it splices the graph's dictionaries (:func:`attribution.splice`, ``error=True``) and patches their
    ``features`` and ``error`` sites (an error node scales its whole vector). It reads each logit node's value (its
    logit minus the mean logit, or minus its foil's). The graph's prediction propagates the relative changes
    ``scale - 1`` through its edges, layer by layer (a linear model with frozen attention and norms, through the
    graph's nodes only); a multiplied node also passes on, times ``scale``, what reaches it from the others.

    Args:
        graph: the graph (of ``model`` on ``graph.inputs``).
        model: the model.
        nodes: node numbers of neuron, feature or error nodes.
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
    units = ("neuron", "feature", "error")
    bad = [int(i) for i in chosen if not 0 <= int(i) < len(graph.nodes) or graph.nodes.kind[int(i)] not in units]
    if bad:
        raise ValueError(
            f"`nodes` must be numbers of neuron, feature or error nodes (graph.nodes.where('neuron'), ...); got "
            f"{bad[:5]}"
        )
    acts = graph.nodes.activation.to(graph.adjacency.dtype)
    factor = torch.ones(len(graph.nodes), dtype=graph.adjacency.dtype)
    factor[chosen] = scale
    moved = predicted_change(graph.adjacency, acts, graph.nodes.layer, factor)
    logits = graph.nodes.where("logit")
    clean = graph.nodes.activation[logits]
    changed = _real_values(graph, model, chosen, scale)
    return Verification(chosen, kind, scale, changed - clean, moved[logits].double(), clean)


def _real_values(graph: AttributionGraph, model: nn.Module, chosen: torch.Tensor, scale: float) -> torch.Tensor:
    """The logit nodes' values in the real model with the chosen nodes' activations scaled."""
    layout = lm_layout(model)
    nodes = graph.nodes
    kinds = [nodes.kind[int(i)] for i in chosen]
    names = {}
    for layer in sorted(set(nodes.layer[chosen].tolist())):
        parts = layout.layers[layer]
        sites = {"neuron": parts.mlp_parts.neurons if parts.mlp_parts else "", "error": f"{parts.mlp}.dictionary.error",
                 "feature": f"{parts.mlp}.dictionary.features"}  # fmt: skip
        for kind, site in sites.items():
            here = chosen[(nodes.layer[chosen] == layer) & torch.tensor([k == kind for k in kinds])]
            if len(here):
                units = None if kind == "error" else nodes.index[here]  # an error: its whole vector
                names[site] = Patch(_scaled((nodes.position[here], units), scale))
    dictionaries = "feature" in kinds or "error" in kinds
    spliced = splice(model, dict(graph.basis)) if dictionaries else contextlib.nullcontext()
    with kept_state(model), torch.no_grad(), spliced, patch(model, names, site="input"):
        output = call(model, graph.inputs)
    z = getattr(output, "logits", output)[0, -1].double().cpu()
    logits = graph.nodes.where("logit")
    tokens, foils = graph.nodes.index[logits], graph.foils
    return torch.where(foils >= 0, z[tokens] - z[foils.clamp_min(0)], z[tokens] - z.mean())


def _scaled(where: tuple[torch.Tensor, torch.Tensor | None], scale: float) -> Any:
    """A patch function: the activation with ``[0, positions, units]`` (``units`` None: every one) times ``scale``."""
    positions, units = where

    def fn(a: torch.Tensor) -> torch.Tensor:
        out = a.clone()
        if units is None:
            out[0, positions.to(a.device)] *= scale
        else:
            out[0, positions.to(a.device), units.to(a.device)] *= scale
        return out

    return fn
