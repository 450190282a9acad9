"""Attribution of each generated token to the input token embeddings, many targets per backward pass.

For generated token ``i`` the target is its log-probability at position ``P - 1 + i`` of the teacher-forced
``prompt + generated``, as in captum's ``LLMGradientAttribution``; the attribution is to the output of
``model.get_input_embeddings()``, summed over the hidden size. One teacher-forced forward serves every target, and
``target_batch`` targets share one backward pass (see :mod:`attribution.generation._gradients`). With
``method="attnlrp"`` the backward passes carry AttnLRP's rules (:class:`attribution.AttnLRP`, put on the same run by
``attribution._transformer_rules.register_rules``) and the target is the generated token's logit, LRP's conserved
quantity, as :class:`attribution.AttnLRP` explains it. The perturbation methods (``"feature_ablation"``,
``"shapley_sampling"``, ``"kernel_shap"``, ``"lime"``) run the perturbation family on the prompt's tokens with captum
``LLMAttribution``'s target (``_perturbation.py``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import nn

from .._inputs import token_ids
from .._run import eager_module, kept_state
from .._transformer_rules import register_rules, sites
from ..models import LMLayout, logit_softcap
from ._gradients import TeacherForced, batched_backward, hidden_gradients
from ._perturbation import PERTURBATION_METHODS, perturbation_scores
from .result import GenerationAttribution

Method = Literal[
    "saliency",
    "input_x_gradient",
    "integrated_gradients",
    "attnlrp",
    "feature_ablation",
    "shapley_sampling",
    "kernel_shap",
    "lime",
]
METHODS = ("saliency", "input_x_gradient", "integrated_gradients", "attnlrp", *PERTURBATION_METHODS)


def attribute_generation(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    generated: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    method: Method = "input_x_gradient",
    target_batch: int = 8,
    steps: int = 50,
    baseline_token: int = 0,
    per_dimension: bool = False,
    layout: LMLayout | None = None,
    samples: int | None = None,
    seed: int = 0,
) -> GenerationAttribution:
    """Attribute every generated token's log-probability to the prompt's and the earlier generated tokens.

    Args:
        model: a HuggingFace causal LM (``get_input_embeddings``, ``get_output_embeddings``, ``generate``).
        input_ids: the prompt, ``(P,)`` or ``(1, P)``; ``(B, P)`` attributes B prompts (a leading B on the results).
        generated: the continuation's ids, ``(N,)`` (or ``(B, N)``); else ``max_new_tokens`` for greedy generation
            (``model.generate(..., do_sample=False)``).
        max_new_tokens: how many tokens to generate when ``generated`` is not given.
        method: ``"saliency"`` (the signed gradient), ``"input_x_gradient"`` (gradient x embedding) or
            ``"integrated_gradients"`` (Gauss-Legendre, ``steps`` points, from the embedding of ``baseline_token`` at
            the prompt's positions; the generated tokens are held at their embeddings, so their columns are 0), or
            ``"attnlrp"`` (AttnLRP's relevance of each token for the generated token's logit: the same numbers as
            ``AttnLRP(model)(prompt + generated[:i], target=generated[i])`` step by step; Llama, Qwen2, Mistral and
            GPT-2 layouts); or a perturbation method on the prompt's tokens, each replaced by ``baseline_token`` when
            left out, with captum ``LLMAttribution``'s target (generated token ``i``'s log-probability given the
            perturbed prompt and ``generated[:i]``): ``"feature_ablation"`` (one token at a time),
            ``"shapley_sampling"`` (``samples`` permutations, default 25), ``"kernel_shap"`` (``samples``
            coalitions, default shap's ``"auto"``) or ``"lime"`` (``samples`` draws, default 50); the generated
            tokens' columns are 0.
        target_batch: how many targets share one backward pass (and the largest forward batch); the results do not
            depend on it, the memory does.
        steps: integration points of ``"integrated_gradients"``.
        baseline_token: the token whose embedding is the baseline of ``"integrated_gradients"``, and the token
            that replaces a left-out prompt token in the perturbation methods (captum's ``TextTokenInput`` default).
        per_dimension: also keep the attribution per hidden dimension (``.per_dimension``; gradient methods).
        layout: with ``method="attnlrp"``, the model's :func:`attribution.models.lm_layout` where its modules are not
            found by name (the same keywords in every family).
        samples: permutations, coalitions or draws of the sampling perturbation methods (``None``: their default).
        seed: the seed of those samples (``"shapley_sampling"`` draws captum's permutations after
            ``torch.manual_seed(seed)``).

    Returns:
        A :class:`GenerationAttribution`: ``.scores`` ``(N, P + N)``, row ``i`` zero from column ``P + i`` on.
        ``scores[:, :P]`` equals captum's ``LLMGradientAttribution(...).attribute(...).token_attr`` with
        ``LayerGradientXActivation`` (``multiply_by_inputs=False`` for saliency) or ``LayerIntegratedGradients`` on
        the embedding layer. For ``"attnlrp"`` row ``i`` sums to about generated token ``i``'s logit. For
        ``"feature_ablation"`` and ``"shapley_sampling"`` ``scores[:, :P]`` equals captum's
        ``LLMAttribution(FeatureAblation | ShapleyValueSampling, tokenizer).attribute(...).token_attr``; for every
        perturbation method the rows sum to its attribution of the whole continuation (captum's ``seq_attr``).

    Raises:
        ValueError: ids outside the vocabulary, an empty continuation, both or neither of ``generated`` and
            ``max_new_tokens``, an unknown method, a model without input or output embeddings, ``per_dimension``
            with a perturbation method.

    Example:
        >>> import torch, transformers
        >>> from attribution import attribute_generation
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> result = attribute_generation(model, torch.tensor([1, 5, 7]), generated=torch.tensor([9, 2, 11, 4]))
        >>> result.scores.shape, result.prompt_len, bool(result.scores[0, 3:].eq(0).all())
        (torch.Size([4, 7]), 3, True)
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {list(METHODS)}; got {method!r}")
    if isinstance(target_batch, bool) or not isinstance(target_batch, int) or target_batch < 1:
        raise ValueError(f"`target_batch` must be a positive int; got {target_batch!r}")
    if method == "integrated_gradients" and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"`steps` must be a positive int; got {steps!r}")
    eager_module(model)  # TorchScript refused with hooks' error, before the structure is read
    if per_dimension and method in PERTURBATION_METHODS:
        raise ValueError(f"`per_dimension` needs a gradient method; {method!r} perturbs tokens, not their embeddings")
    prompts = token_ids(model, input_ids)
    embedding, unembedding = _embeddings(model)
    continuations = _continuations(model, prompts, generated, max_new_tokens)
    vocab = int(embedding.num_embeddings)
    if isinstance(baseline_token, bool) or not isinstance(baseline_token, int) or not 0 <= baseline_token < vocab:
        raise ValueError(f"`baseline_token` must be a token id in [0, {vocab}); got {baseline_token!r}")
    softcap = logit_softcap(model)
    if method in PERTURBATION_METHODS:  # every prompt at once; no hidden dimension
        scores = list(perturbation_scores(model, prompts, continuations, method, baseline_token, samples, seed))
        rows = []
    else:
        rows = [
            _one(model, embedding, unembedding, softcap, p, g, method, target_batch, steps, baseline_token, layout)
            for p, g in zip(prompts, continuations, strict=True)
        ]
        scores = [r.sum(-1) for r in rows]
    batched = input_ids.dim() == 2 and len(input_ids) > 1
    pick = (lambda ts: torch.stack(ts)) if batched else (lambda ts: ts[0])
    return GenerationAttribution(
        scores=pick(scores),
        generated=pick(list(continuations)),
        tokens=pick([torch.cat([p, g]) for p, g in zip(prompts, continuations, strict=True)]),
        prompt_len=prompts.shape[1],
        method=method,
        per_dimension=pick(rows) if per_dimension else None,
    )


def _embeddings(model: nn.Module) -> tuple[nn.Embedding, nn.Module]:
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    unembedding = get_out() if callable(get_out) else None
    if not isinstance(embedding, nn.Embedding) or unembedding is None:
        raise ValueError(
            "attribute_generation needs a causal LM whose model.get_input_embeddings() is an nn.Embedding and whose "
            f"model.get_output_embeddings() is its unembedding; got {type(embedding).__name__} and "
            f"{type(unembedding).__name__} (a base model without its LM head cannot score tokens)"
        )
    return embedding, unembedding


def _continuations(
    model: nn.Module, prompts: torch.Tensor, generated: torch.Tensor | None, max_new_tokens: int | None
) -> torch.Tensor:
    """``(B, N)`` the given continuations, or the greedy ones."""
    if (generated is None) == (max_new_tokens is None):
        raise ValueError("pass exactly one of `generated` (the continuation's token ids) and `max_new_tokens`")
    if generated is not None:
        if isinstance(generated, torch.Tensor) and generated.numel() == 0:
            raise ValueError("`generated` is empty: there is no generated token to attribute")
        ids = token_ids(model, generated, "generated")
        if len(ids) not in (1, len(prompts)):
            raise ValueError(f"`generated` has {len(ids)} rows for {len(prompts)} prompts: pass (N,) or (B, N)")
        return ids.expand(len(prompts), -1).to(prompts.device)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be a positive int; got {max_new_tokens!r}")
    rows = [_greedy(model, p, max_new_tokens) for p in prompts]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(
            f"the greedy continuations have different lengths {[len(r) for r in rows]} (some stopped at the end of "
            "sequence token): attribute the prompts one at a time, or pass `generated`"
        )
    return torch.stack(rows)


def _greedy(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    generate = getattr(model, "generate", None)
    if not callable(generate):
        raise ValueError("the model has no generate(): pass the continuation as `generated`")
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    eos = getattr(config, "eos_token_id", None)
    pad = pad if pad is not None else eos if isinstance(eos, int) else eos[0] if eos else 0
    with kept_state(model), torch.no_grad():
        out = generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=max_new_tokens,
                       do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad)  # fmt: skip
    new = out[0, len(prompt) :]
    if not len(new):
        raise ValueError("the model generated no token: pass the continuation as `generated`")
    return new


def _one(
    model: nn.Module,
    embedding: nn.Embedding,
    unembedding: nn.Module,
    softcap: float | None,
    prompt: torch.Tensor,
    generated: torch.Tensor,
    method: str,
    target_batch: int,
    steps: int,
    baseline_token: int,
    layout: LMLayout | None,
) -> torch.Tensor:
    """``(N, P + N, d)`` the attribution of one continuation, per hidden dimension."""
    P, N = len(prompt), len(generated)
    ids = torch.cat([prompt, generated])[None]
    positions = torch.arange(P - 1, P + N - 1, device=ids.device)
    ends = None
    if method == "integrated_gradients":
        base_ids = ids.clone()
        base_ids[:, :P] = baseline_token
        with kept_state(model), torch.no_grad():
            ends = embedding(base_ids), embedding(ids)
    with TeacherForced(model, embedding, unembedding) as run:
        if method == "attnlrp":
            register_rules(run.run.group, sites(model, layout))
        if ends is not None:
            out = _integrated(run, ids, *ends, generated, positions, target_batch, steps, softcap)
        else:
            x, leaf, hidden = run.forward(ids)
            log_prob = method != "attnlrp"  # AttnLRP explains the logit, LRP's conserved quantity
            grads = hidden_gradients(unembedding, hidden[:, positions], generated, softcap, log_prob)  # (1, N, d)
            out = torch.cat([
                batched_backward(hidden, leaf, grads[:, rows].transpose(0, 1), positions[rows],
                                 retain=rows.stop < N)[:, 0]
                for rows in _groups(N, target_batch)
            ])  # fmt: skip
            if method in ("input_x_gradient", "attnlrp"):
                out = out * x.detach()
    mask = torch.arange(P + N, device=out.device)[None, :] < (P + torch.arange(N, device=out.device))[:, None]
    return (out * mask[..., None]).detach()


def _groups(n: int, size: int) -> list[slice]:
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


def _integrated(
    run: TeacherForced,
    ids: torch.Tensor,
    baseline: torch.Tensor,
    x: torch.Tensor,
    generated: torch.Tensor,
    positions: torch.Tensor,
    target_batch: int,
    steps: int,
    softcap: float | None,
) -> torch.Tensor:
    """Integrated gradients from ``baseline`` to ``x`` (both ``(1, T, d)``), Gauss-Legendre points as in captum."""
    points, weights = np.polynomial.legendre.leggauss(steps)
    alphas = (0.5 * (points + 1)).tolist()
    scales = (0.5 * weights).tolist()
    total = torch.zeros_like(x).expand(len(generated), -1, -1)
    N = len(generated)
    for chunk in _groups(steps, target_batch):
        a = torch.tensor(alphas[chunk], dtype=baseline.dtype, device=baseline.device)[:, None, None]
        run.transform = lambda out, a=a: baseline + a * (out - baseline)
        _, leaf, hidden = run.forward(ids.expand(len(a), -1))
        grads = hidden_gradients(run.unembedding, hidden[:, positions], generated, softcap)  # (k, N, d)
        w = torch.tensor(scales[chunk], dtype=baseline.dtype, device=baseline.device)[None, :, None, None]
        part = torch.cat([
            (batched_backward(hidden, leaf, grads[:, rows].transpose(0, 1), positions[rows], retain=rows.stop < N)
             * w).sum(1)
            for rows in _groups(N, target_batch)
        ])  # fmt: skip
        total = total + part
    return total * (x - baseline)
