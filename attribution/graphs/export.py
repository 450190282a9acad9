"""A graph as circuit-tracer's graph file (for its and Neuronpedia's viewers) and as a self-contained HTML page."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._html import TokenTable, script_json, visible
from .._inputs import decoder
from ._math import _cumulative
from ._page import PAGE as _PAGE

if TYPE_CHECKING:
    from .graph import AttributionGraph

CARD_EXAMPLES = 5
"""Top examples shown for a clicked node's unit."""
CARD_LOGITS = 6
"""Top and bottom logit effects shown for a clicked node's unit."""


def _process(text: str) -> str:
    """circuit-tracer's ``process_token``: newlines, tabs and returns as visible arrows."""
    return text.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def logit_label(graph: AttributionGraph, node: int, show: Callable[[int], str]) -> str:
    """Logit node ``node``'s target: ``show(token)``, or ``show(token) vs show(foil)`` when its value is a difference.

    The viewer, the graph file's ``clerp`` and the picture all name a logit difference by both of its tokens, so
    that a node whose value is ``logit(" are") - logit(" is")`` does not read as the logit of " are" alone.

    Example:
        >>> import torch
        >>> from attribution.graphs import Nodes, AttributionGraph
        >>> nodes = Nodes(("token", "logit", "logit"), torch.tensor([-1, 2, 2]), torch.tensor([0, 0, 0]),
        ...               torch.tensor([3, 5, 6]), torch.ones(3), torch.zeros(3))
        >>> graph = AttributionGraph(nodes, torch.zeros(3, 3).to_sparse(), torch.tensor([3]), torch.ones(2),
        ...                          torch.tensor([9, -1]), 2, 8, None)
        >>> logit_label(graph, 1, lambda t: f"t{t}"), logit_label(graph, 2, lambda t: f"t{t}")
        ('t5 vs t9', 't6')
    """
    foil = int(graph.foils[node - len(graph.nodes) + len(graph.foils)])  # the logit nodes come last, in order
    target = show(int(graph.nodes.index[node]))
    return target if foil < 0 else f"{target} vs {show(foil)}"


def node_ids(graph: AttributionGraph) -> list[str]:
    """circuit-tracer's node ids: ``{layer}_{index}_{pos}``, ``E_{token}_{pos}``, ``{layers + 1}_{token}_{pos}``.

    An error node is ``{layer}_-1_{pos}`` (its index is -1). circuit-tracer writes ``0_{layer}_{pos}``, which is
    also the id of the layer-0 unit ``layer`` at that position: with neurons at layer 0 two nodes would share it.

    Example:
        >>> import torch
        >>> from attribution.graphs import Nodes, AttributionGraph
        >>> nodes = Nodes(("neuron", "token", "logit"), torch.tensor([0, -1, 2]), torch.tensor([1, 0, 1]),
        ...               torch.tensor([7, 3, 9]), torch.ones(3), torch.zeros(3))
        >>> node_ids(AttributionGraph(nodes, torch.zeros(3, 3).to_sparse(), torch.tensor([3, 4]), torch.ones(1),
        ...                           torch.tensor([-1]), 2, 8, None))
        ['0_7_1', 'E_3_0', '3_9_1']
    """
    out = []
    columns = (graph.nodes.layer.tolist(), graph.nodes.position.tolist(), graph.nodes.index.tolist())
    for kind, layer, position, index in zip(graph.nodes.kind, *columns, strict=True):
        if kind == "token":
            out.append(f"E_{index}_{position}")
        elif kind == "logit":
            out.append(f"{graph.n_layers + 1}_{index}_{position}")
        else:
            out.append(f"{layer}_{index}_{position}")
    return out


def graph_file(graph: AttributionGraph, slug: str, *, tokenizer: Any = None, scan: str = "neurons") -> dict[str, Any]:
    """circuit-tracer's graph file as a dict: ``metadata``, ``qParams``, ``nodes``, ``links``.

    Neurons and features are written as circuit-tracer's features (``feature_type`` "cross layer transcoder",
    ``feature`` the Cantor pairing of layer and index, as circuit-tracer 0.5 numbers them) so that its viewer shows
    them; errors as its "mlp reconstruction error" nodes (``feature`` -1, ``activation`` the error's norm); the first
    logit node is the target. A logit node's ``clerp`` is circuit-tracer's ``Output "token" (p=...)``, with
    ``vs "foil"`` after the token for a logit difference (its ``p`` then the pair's weight, ``1 / pairs``: the
    viewer parses the first quoted token and the ``p``).
    Only nodes with an edge (and every token and logit) are written, as circuit-tracer does.
    """
    text = decoder(tokenizer)

    def quoted(token: int) -> str:
        return f'"{_process(text(token))}"'

    ids = node_ids(graph)
    cumulative = _cumulative(graph.nodes.influence.double())
    adjacency = graph.adjacency.coalesce()
    target, source = adjacency.indices().tolist()
    links = [{"source": ids[s], "target": ids[t], "weight": float(w)}
             for t, s, w in zip(target, source, adjacency.values().tolist(), strict=True)]  # fmt: skip
    linked = set(target) | set(source)
    nodes, first_logit = [], True
    for i, (kind, node_id) in enumerate(zip(graph.nodes.kind, ids, strict=True)):
        layer, position, index = (int(graph.nodes.layer[i]), int(graph.nodes.position[i]), int(graph.nodes.index[i]))
        common = {"node_id": node_id, "ctx_idx": position, "influence": float(cumulative[i]), "run_idx": 0,
                  "reverse_ctx_idx": 0}  # fmt: skip
        if kind in ("neuron", "feature") and i in linked:
            nodes.append({**common, "feature": _cantor(layer, index), "layer": str(layer),
                          "feature_type": "cross layer transcoder", "jsNodeId": f"{layer}_{index}-0",
                          "activation": float(graph.nodes.activation[i]), "clerp": f"L{layer} {kind} {index}",
                          "token_prob": 0.0, "is_target_logit": False})  # fmt: skip
        elif kind == "error" and i in linked:
            nodes.append({**common, "feature": -1, "layer": str(layer), "feature_type": "mlp reconstruction error",
                          "jsNodeId": f"{layer}_-1-{position}", "activation": float(graph.nodes.activation[i]),
                          "clerp": f"L{layer} error", "token_prob": 0.0, "is_target_logit": False})  # fmt: skip
        elif kind == "token":
            nodes.append({**common, "feature": position, "layer": "E", "feature_type": "embedding",
                          "jsNodeId": f"E_{index}-{position}", "clerp": "", "token_prob": 0.0,
                          "is_target_logit": False, "activation": None})  # fmt: skip
        elif kind == "logit":
            rank = i - len(graph.nodes) + len(graph.logit_weights)
            prob = float(graph.logit_weights[rank])
            nodes.append({**common, "feature": index, "layer": str(graph.n_layers + 1), "feature_type": "logit",
                          "jsNodeId": f"L_{index}-{position}", "token_prob": prob, "is_target_logit": first_logit,
                          "clerp": f"Output {logit_label(graph, i, quoted)} (p={prob:.3f})", "influence": None,
                          "activation": float(graph.nodes.activation[i])})  # fmt: skip
            first_logit = False
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [],
                "prompt_tokens": [_process(text(t)) for t in graph.tokens.tolist()],
                "prompt": "".join(text(t) for t in graph.tokens.tolist()),
                "node_threshold": graph.node_threshold, "schema_version": 1}  # fmt: skip
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}


def write_json(graph: AttributionGraph, path: Path, *, tokenizer: Any = None, scan: str = "neurons") -> dict[str, Any]:
    """Write the graph file at ``path`` (the slug is its stem) and add it to ``graph-metadata.json`` beside it."""
    content = graph_file(graph, path.stem, tokenizer=tokenizer, scan=scan)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1), encoding="utf-8")
    index = path.parent / "graph-metadata.json"
    listed = json.loads(index.read_text(encoding="utf-8")) if index.exists() else {"graphs": []}
    listed["graphs"] = [g for g in listed.get("graphs", []) if g.get("slug") != path.stem] + [content["metadata"]]
    index.write_text(json.dumps(listed, indent=2), encoding="utf-8")
    return content


def html_page(graph: AttributionGraph, *, tokenizer: Any = None, top_tokens: Any = None, features: Any = None) -> str:
    """The self-contained viewer's page (see :meth:`AttributionGraph.to_html`)."""
    text = decoder(tokenizer)
    cards, card_of, tokens = _feature_cards(graph, features, tokenizer)

    def shown(token: int) -> str:
        return visible(text(token))

    nodes = []
    for i in range(len(graph.nodes)):
        node = graph.nodes[i]
        names = {"token": visible(text(node.index)), "feature": f"L{node.layer}/f{node.index}",
                 "error": f"L{node.layer}/error"}  # fmt: skip
        label = names.get(node.kind, f"L{node.layer}/{node.index}")
        if node.kind == "logit":
            label = "→" + logit_label(graph, i, shown)
        card = card_of.get(i, -1)
        if card >= 0 and cards[card]["reads"] is not None:
            label = f"“{cards[card]['reads']}” {label}"
        tops = [str(t) for t in (top_tokens or {}).get(i, [])]
        nodes.append({"kind": node.kind, "layer": node.layer, "pos": node.position, "index": node.index,
                      "act": _finite(node.activation), "infl": _finite(node.influence), "label": label,
                      "top": tops, "unit": card})  # fmt: skip
    adjacency = graph.adjacency.coalesce()
    target, source = adjacency.indices().tolist()
    edges = [[s, t, _finite(w)] for t, s, w in zip(target, source, adjacency.values().tolist(), strict=True)]
    data = script_json({"nodes": nodes, "edges": edges, "layers": graph.n_layers, "units": cards, "V": tokens.texts,
                        "tokens": [visible(text(t)) for t in graph.tokens.tolist()]}, compact=False)  # fmt: skip
    title = html.escape(f"Attribution graph: {len(graph.nodes)} nodes, {len(edges)} edges")
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", data)


def _feature_cards(
    graph: AttributionGraph, report: Any, tokenizer: Any
) -> tuple[list[dict[str, Any]], dict[int, int], TokenTable]:
    """``(cards, {node: card}, token texts)``: the summary of each neuron's or feature's unit in ``report``.

    A node's unit is ``report.find(kind, layer, index)``; nodes of one unit share its card. A card is
    :func:`attribution.features.dashboard.unit_card`'s, with ``reads``: the visible text of its top example's token.
    """
    if report is None:
        return [], {}, TokenTable(decoder(tokenizer))
    from ..features import UnitReport
    from ..features.dashboard import unit_card

    if not isinstance(report, UnitReport):
        raise TypeError(f"`features` must be a UnitReport (from feature_statistics); got {type(report).__name__}")
    tokens = TokenTable(decoder(report.tokenizer if report.tokenizer is not None else tokenizer))
    cards: list[dict[str, Any]] = []
    number: dict[int, int] = {}
    card_of: dict[int, int] = {}
    for i, (kind, layer, index) in enumerate(zip(graph.nodes.kind, graph.nodes.layer.tolist(),
                                                 graph.nodes.index.tolist(), strict=True)):  # fmt: skip
        unit = report.find(kind, layer, index) if kind in ("neuron", "feature") else None
        if unit is None:
            continue
        if unit not in number:
            card = unit_card(report, unit, tokens, examples=CARD_EXAMPLES, logits=CARD_LOGITS)
            top = card["top"]
            card["reads"] = tokens.texts[top[0]["t"][top[0]["o"]]] if top else None
            number[unit] = len(cards)
            cards.append(card)
        card_of[i] = number[unit]
    return cards, card_of, tokens


def _cantor(x: int, y: int) -> int:
    """circuit-tracer's feature number of (layer, index): the Cantor pairing."""
    return (x + y) * (x + y + 1) // 2 + y


def _finite(x: float) -> float:
    """``x`` rounded for the page (JSON has no NaN)."""
    return round(float(x), 6) if math.isfinite(x) else 0.0
