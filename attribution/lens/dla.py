"""Direct logit attribution: what each head, each MLP and the embeddings write along a direction in vocabulary space.

The final norm's input is a sum of the residual stream's writers: the stream entering layer 0, every head's share of
every attention output projection, every MLP's output, and the projections' biases. With the norm's scale frozen at
its value in this run (the RMS, or LayerNorm's standard deviation, of that input), the norm is linear, and so is the
logit: each writer's value is ``gamma * centre(c) / scale`` dotted with ``W_U^T direction``, and the values plus the
constant (biases, the norm's shift, the unembedding's bias) add up to the logit. Elhage et al., *A Mathematical
Framework for Transformer Circuits* (2021); Wang et al., *Interpretability in the Wild* (2022, section 3.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._run import HookedRun, hook_site
from ..models import LMLayout, NormAffine, linear, norm_affine
from ._inputs import direction_matrix, token_ids, vocab_size
from ._layout import layout_of


@dataclass
class DirectLogitAttribution:
    """The direct effect of each writer of the residual stream on a logit (difference), and the constant."""

    names: list[str]
    """``["embed", "a0.h0", ..., "m0", "a1.h0", ..., "m{L-1}"]`` (or ``["embed", "a0", "m0", ...]`` for layers)."""
    values: torch.Tensor
    """``(len(names), B)`` float64, or ``(len(names), B, len(positions))`` for a list of positions."""
    constant: torch.Tensor
    """``(B,)`` (or ``(B, len(positions))``): attention output biases, the norm's shift and the unembedding's bias."""
    logit: torch.Tensor
    """The model's own logits at the positions along the direction (``values.sum(0) + constant`` up to rounding)."""
    heads: int
    """Query heads per layer (0 for ``components="layers"``)."""

    def grid(self) -> torch.Tensor:
        """``(layers, heads, ...)`` the heads' values (``components="heads"`` only), for a layers x heads heatmap."""
        if not self.heads:
            raise ValueError("grid() needs per-head values: call direct_logit_attribution(..., components='heads')")
        rows = [i for i, n in enumerate(self.names) if ".h" in n]
        return self.values[rows].reshape(-1, self.heads, *self.values.shape[1:])


def direct_logit_attribution(
    model: nn.Module,
    input_ids: torch.Tensor,
    direction: Any,
    *,
    components: Literal["heads", "layers"] = "heads",
    positions: int | Sequence[int] = -1,
    layout: LMLayout | None = None,
) -> DirectLogitAttribution:
    """Each head's (or layer's) and each MLP's direct contribution to a logit or a logit difference.

    Args:
        model: a HuggingFace causal LM (Llama, Qwen2/3, Mistral, Gemma, Phi, GPT-2, GPT-NeoX; GQA included).
        input_ids: ``(B, T)`` or ``(T,)`` token ids.
        direction: an int token id, a pair ``(a, b)`` (logit of ``a`` minus logit of ``b``) or a float tensor of size
            vocab; per example: an integer tensor ``(B,)``, a pair of them, or a float tensor ``(B, vocab)``.
        components: ``"heads"`` (every head of every layer) or ``"layers"`` (each attention layer as one writer).
        positions: the position read (an int, negative from the end) or a list of them.
        layout: the model's modules, where they cannot be found by name (see :func:`attribution.lens.lm_layout`).

    Returns:
        A :class:`DirectLogitAttribution`; ``values.sum(0) + constant`` is the logit (difference) computed from the
        final norm's input.

    Raises:
        ValueError: token ids or a direction outside the vocabulary, a direction of the wrong size, a position out of
            range, a part that cannot be found, or a model whose final norm input is not the sum of those writers.

    Example:
        >>> import torch, transformers
        >>> from attribution.lens import direct_logit_attribution
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> dla = direct_logit_attribution(model, torch.tensor([[1, 5, 7, 2]]), (3, 4))
        >>> dla.names[:3], dla.values.shape, dla.grid().shape
        (['embed', 'a0.h0', 'a0.h1'], torch.Size([11, 1]), torch.Size([2, 4, 1]))
        >>> bool(torch.allclose(dla.values.sum(0) + dla.constant, dla.logit, atol=1e-5))
        True
    """
    if components not in ("heads", "layers"):
        raise ValueError(f"`components` must be 'heads' or 'layers'; got {components!r}")
    layout = layout_of(model, layout)
    ids = token_ids(model, input_ids)
    if any(layer.sandwich for layer in layout.layers):
        raise ValueError(
            "the model passes each attention and MLP output through a norm before the residual stream "
            "(Gemma 2/3): they are not linear writers of it, so direct logit attribution does not apply"
        )
    where = _positions(positions, ids.shape[1])
    directions = direction_matrix(direction, vocab_size(model), len(ids)).cpu()
    W_U, b_U = _affine(model.get_submodule(str(layout.unembed)), str(layout.unembed), "unembedding")
    if W_U.shape[0] != directions.shape[1]:
        raise ValueError(f"`direction` has size {directions.shape[1]}, the unembedding {W_U.shape[0]} outputs")
    seen = _run(model, ids, layout, where)
    u = directions @ W_U.double()  # (B, d): the direction read back into the residual stream
    names, writers, biases = _writers(model, layout, seen, components)
    residual = seen["norm"].double()
    norm = norm_affine(model.get_submodule(layout.final_norm), residual)
    _check_sum(writers.sum(0) + biases, residual)
    scale = norm.scale(residual)
    values = torch.einsum("nbpd,bd->nbp", _frozen(norm, writers, scale), u)
    constant = torch.einsum("bpd,bd->bp", _frozen(norm, biases, scale), u)
    if norm.shift is not None:
        constant = constant + (u @ norm.shift.double())[:, None]
    if b_U is not None:
        constant = constant + (directions @ b_U.double())[:, None]
    logit = torch.einsum("bpv,bv->bp", seen["logits"].double(), directions)
    squeeze = (lambda t: t[..., 0]) if isinstance(positions, int) else (lambda t: t)
    return DirectLogitAttribution(
        names, squeeze(values), squeeze(constant), squeeze(logit), layout.n_heads if components == "heads" else 0
    )


def _positions(positions: int | Sequence[int], length: int) -> list[int]:
    chosen = [positions] if isinstance(positions, int) else list(positions)
    if not chosen or not all(isinstance(p, int) and -length <= p < length for p in chosen):
        raise ValueError(f"`positions` must be an int or a non-empty list of ints in [-{length}, {length}) (the "
                         f"sequence has {length} tokens); got {positions!r}")  # fmt: skip
    return [p % length for p in chosen]


def _run(model: nn.Module, ids: torch.Tensor, layout: LMLayout, where: list[int]) -> dict[str, Any]:
    """The tensors of one forward at the chosen positions: layer 0's input, heads, MLPs, norm input and logits."""
    seen: dict[str, Any] = {}

    def keep(key: str) -> Any:
        def fn(tensor: torch.Tensor, name: str, call: int) -> None:
            seen[name if key == "site" else key] = tensor[:, where].detach().cpu()  # layers may be on several devices

        return fn

    with HookedRun(model, "direct_logit_attribution") as run:
        hook_site(run.group, layout.layers[0].module, "input", None, keep("embed"))
        hook_site(run.group, [layer.attention.out_proj for layer in layout.layers], "input", None, keep("site"))
        hook_site(run.group, [layer.mlp for layer in layout.layers], "output", None, keep("site"))
        hook_site(run.group, layout.final_norm, "input", None, keep("norm"))
        hook_site(run.group, str(layout.unembed), "output", None, keep("logits"))
        run.forward({"input_ids": ids, "use_cache": False})
    return seen


def _writers(
    model: nn.Module, layout: LMLayout, seen: dict[str, Any], components: str
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Names, ``(n, B, P, d)`` writers and ``(B, P, d)`` the sum of the attention output biases, in float64."""
    names, writers = ["embed"], [seen["embed"].double()]
    biases = torch.zeros_like(writers[0])
    for layer, (attention, mlp) in enumerate((one.attention.out_proj, one.mlp) for one in layout.layers):
        W_O, b_O = _affine(model.get_submodule(attention), attention, "attention output projection")
        heads = per_head(seen[attention].double(), W_O.double(), layout.n_heads)  # (H, B, P, d)
        if components == "heads":
            names += [f"a{layer}.h{h}" for h in range(layout.n_heads)]
            writers += list(heads)
        else:
            names.append(f"a{layer}")
            writers.append(heads.sum(0))
        if b_O is not None:
            biases = biases + b_O.double()
        names.append(f"m{layer}")
        writers.append(seen[mlp].double())
    return names, torch.stack(writers), biases


def per_head(z: torch.Tensor, W_O: torch.Tensor, heads: int) -> torch.Tensor:
    """``(H, ..., d)`` each head's write: its slice of the projection's input times its slice of ``W_O`` (no bias).

    ``z`` is ``(..., H * d_head)``, the heads side by side; ``W_O`` is ``(d, H * d_head)`` as in ``nn.Linear``.

    Example:
        >>> z, W_O = torch.randn(3, 8), torch.randn(5, 8)
        >>> bool(torch.allclose(per_head(z, W_O, 2).sum(0), z @ W_O.T, atol=1e-5))
        True
    """
    if z.shape[-1] % heads or z.shape[-1] != W_O.shape[1]:
        raise ValueError(
            f"the attention output projection takes {W_O.shape[1]} inputs and got {z.shape[-1]}, which do not split "
            f"into {heads} heads: pass the number of query heads as `layout=lm_layout(model, n_heads=H)`"
        )
    d_head = z.shape[-1] // heads
    z_heads = z.unflatten(-1, (heads, d_head)).movedim(-2, 0)  # (H, ..., d_head)
    W_heads = W_O.unflatten(1, (heads, d_head)).permute(1, 2, 0)  # (H, d_head, d)
    return torch.einsum("h...k,hkd->h...d", z_heads, W_heads)


def _affine(module: nn.Module, name: str, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W, b)`` with ``W`` as ``(out, in)`` of an ``nn.Linear`` or a HuggingFace ``Conv1D`` (GPT-2), on the CPU."""
    if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
        return linear(module, device=torch.device("cpu"))
    raise ValueError(f"the {what} {name!r} is a {type(module).__name__}: direct logit attribution reads the weight of "
                     "an nn.Linear or a Conv1D")  # fmt: skip


def _frozen(norm: NormAffine, c: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return NormAffine(norm.gain.double(), None, norm.eps, norm.centred).frozen(c, scale)


def _check_sum(total: torch.Tensor, residual: torch.Tensor) -> None:
    """The writers must add up to the final norm's input (else the model adds something else to the stream)."""
    error = float((total - residual).abs().max())
    size = float(residual.abs().max())
    if error > 1e-3 * max(size, 1.0):
        raise ValueError(
            f"the final norm's input is not the sum of layer 0's input, the attention output projections and the MLP "
            f"outputs (off by {error:.3g} of {size:.3g}): this model adds something else to its residual stream "
            "(norms after attention, as in Gemma 2, or a scaled residual), so direct logit attribution does not apply"
        )
