"""The logit lens: the residual stream after each decoder layer, read through the model's final norm and unembedding.

nostalgebraist, *interpreting GPT: the logit lens* (LessWrong, 2020). The last layer's entry is the model's own
logits, computed by the same modules on the same tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._run import HookedRun, select
from ..models import LMLayout
from ._inputs import token_ids
from ._layout import layout_of


def logit_lens(
    model: nn.Module,
    input_ids: torch.Tensor,
    layers: Sequence[int] | None = None,
    *,
    layout: LMLayout | None = None,
) -> torch.Tensor:
    """``unembedding(final_norm(h_l))`` for the output ``h_l`` of each chosen decoder layer ``l``.

    Args:
        model: a HuggingFace causal LM (Llama, Qwen2, Mistral, Gemma, Phi, GPT-2, GPT-NeoX), or another one with
            ``layout``.
        input_ids: ``(B, T)`` or ``(T,)`` token ids.
        layers: layer indices (negative from the end), entries in that order; ``None``: every layer in order.
        layout: the model's modules, where they cannot be found by name: ``lm_layout(model, final_norm=...)``
            (see :func:`attribution.lens.lm_layout`).

    Returns:
        ``(len(layers), B, T, vocab)`` logits; the last layer's entry equals ``model(input_ids).logits``.

    Raises:
        ValueError: token ids outside the vocabulary, a layer index out of range, a part that cannot be found.

    Example:
        >>> import torch, transformers
        >>> from attribution.lens import logit_lens
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> ids = torch.tensor([[1, 5, 7, 2]])
        >>> lens = logit_lens(model, ids)
        >>> lens.shape, torch.equal(lens[-1], model(ids).logits)
        (torch.Size([3, 1, 4, 40]), True)
    """
    layout = layout_of(model, layout)
    ids = token_ids(model, input_ids)
    names = [layer.module for layer in layout.layers]
    chosen = _layer_indices(layers, len(names))
    outputs: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, output: Any, *, name: str) -> None:
        outputs[name] = select(output[0] if isinstance(output, tuple) else output, None, f"the output of {name!r}")

    with HookedRun(model, "logit_lens") as run:
        run.group.forward([names[i] for i in sorted(set(chosen))], keep)
        run.forward({"input_ids": ids, "use_cache": False})
        norm, unembedding = model.get_submodule(layout.final_norm), model.get_submodule(str(layout.unembed))
        with torch.no_grad():
            return torch.stack([unembedding(norm(outputs[names[i]])) for i in chosen])


def _layer_indices(layers: Sequence[int] | None, count: int) -> list[int]:
    if layers is None:
        return list(range(count))
    if isinstance(layers, int) or not all(isinstance(i, int) for i in layers) or not len(layers):
        raise TypeError(f"`layers` must be a non-empty list of layer indices; got {layers!r}")
    bad = [i for i in layers if not -count <= i < count]
    if bad:
        raise ValueError(f"`layers` {bad} out of range: the model has {count} decoder layers (0 to {count - 1}, or "
                         "negative from the end)")  # fmt: skip
    return [i % count for i in layers]


def top_tokens(lens: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most probable tokens of every lens entry and their probabilities, each ``(..., k)``.

    Example:
        >>> ids, probs = top_tokens(torch.tensor([[0.0, 2.0, 1.0]]), k=2)
        >>> ids.tolist(), [round(p, 3) for p in probs[0].tolist()]
        ([[1, 2]], [0.665, 0.245])
    """
    probs = lens.detach().float().softmax(-1)
    values, indices = probs.topk(k, dim=-1)
    return indices, values
