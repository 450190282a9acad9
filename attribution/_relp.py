"""RelP's backward (Jafari et al. 2025): the rules that turn attribution patching into relevance patching.

RelP (`Jafari et al. 2025 <https://arxiv.org/abs/2508.21258>`_) keeps attribution patching's
``(a_source - a_target) . g`` and replaces the gradient ``g`` by LRP's propagation coefficients: the backward pass
of the same forward, with these rules (as in the authors' code, whose default gives the paper's IOI numbers):

* LayerNorm and RMSNorm: the LN-rule, the normalising scale ``1 / std`` (``1 / rms``) held constant;
* the MLP's activation: the identity rule, gradient ``act(x) / x``;
* the gated MLP's product ``act(gate) * up``: the half rule, half of the gradient to each factor;
* linear layers, residual additions and attention (softmax included): their gradient (LRP-0).

The attention is left to its gradient as the authors' default does (their optional "AH-rule" holds the attention
probabilities constant; AttnLRP's uniform rule on ``q``, ``k`` and ``v`` is not part of RelP). The rules are
AttnLRP's functions in :mod:`attribution._transformer_rules`, put as forward hooks that keep every value and change only
the gradient flowing back.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, get_args

from torch import nn

from ._transformer_rules import Sites, sites
from .models import LMLayout

Rules = Literal["gradient", "relp"]
"""``"gradient"``: attribution patching's plain backward; ``"relp"``: RelP's rules."""


def relp_sites(model: nn.Module, rules: Any, layout: LMLayout | None = None) -> Sites | None:
    """Where RelP's rules go in ``model`` (``None`` for ``rules="gradient"``); raises on a bad value or model.

    Example:
        >>> import torch
        >>> relp_sites(torch.nn.Linear(2, 2), "gradient") is None
        True
    """
    if rules not in get_args(Rules):
        raise ValueError(
            f"`rules` must be one of {list(get_args(Rules))} ('gradient': attribution patching, 'relp': relevance "
            f"patching); got {rules!r}"
        )
    if rules == "gradient":
        return None
    try:
        found = sites(model, layout)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"`rules='relp'` needs a HuggingFace decoder language model: it puts its rules on the RMSNorm/LayerNorm "
            f"modules, the MLP activation modules (`act_fn` beside gate_proj/up_proj/down_proj, or GPT-2's `act`) and "
            f"the gated MLP's down_proj, found beside an attention with q_proj/k_proj/v_proj (or GPT-2's c_attn), "
            f"from get_input_embeddings(). In {type(model).__name__}: {exc}"
        ) from None
    return replace(found, scaled={}, attention_inputs={})  # RelP leaves attention to its gradient
