"""A causal language model's continuation as the target: the log-probability of each of its tokens after the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Continuation:
    """Explain each token of a continuation: its log-probability after the (perturbed) prompt, teacher-forced.

    As captum's ``LLMAttribution`` defines the target of a generated sequence: with ``prompt`` the perturbed token
    ids and ``g`` the continuation, score ``i`` is ``log p(g_i | prompt, g_0 .. g_{i-1})``, read from one forward of
    ``prompt + g[:-1]`` (the last ``N`` positions' logits). Only the prompt is perturbed. Passed as ``target=`` to a
    perturbation method on token ids ``(batch, P)``, it gives attributions ``(batch, N, P)``: one row per token of
    the continuation (their sum is the attribution of the whole continuation's log-probability, captum's
    ``seq_attr``; each row is captum's ``token_attr``).

    Args:
        tokens: the continuation's ids, ``(N,)`` for every prompt or ``(batch, N)``.

    Example:
        >>> import torch, transformers
        >>> from attribution import FeatureAblation
        >>> from attribution.perturbation import Continuation
        >>> config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> FeatureAblation(model, baseline=0)(torch.tensor([[3, 8, 5, 9]]), Continuation(torch.tensor([7, 2]))).shape
        torch.Size([1, 2, 4])
    """

    tokens: torch.Tensor
    """The continuation's token ids, ``(N,)`` or ``(batch, N)``."""

    def rows(self, batch: int, device: torch.device, vocabulary: int | None) -> torch.Tensor:
        """The tokens as ``(batch, N)`` long ids on ``device``, checked."""
        tokens = self.tokens
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise TypeError(f"`Continuation.tokens` must be integer token ids; got {_describe(tokens)}")
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.shape[1] == 0 or len(tokens) not in (1, batch):
            raise ValueError(
                f"`Continuation.tokens` must be (N,) or (batch, N) with N >= 1 for {batch} prompt(s); got "
                f"{tuple(self.tokens.shape)}"
            )
        if vocabulary is not None and (int(tokens.min()) < 0 or int(tokens.max()) >= vocabulary):
            raise ValueError(f"`Continuation.tokens` must be ids in [0, {vocabulary}); got {tokens.tolist()}")
        return tokens.long().to(device).expand(batch, -1)


def continuation_scores(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """The ``(batch * N, k)`` log-probabilities of the tokens ``(batch, N)`` from ``(batch * k, >= N, V)`` logits.

    Row ``b * k + j`` of the logits is item ``b`` under perturbation ``j``; its last ``N`` positions predict the
    tokens. The result's row ``b * N + i`` is token ``i`` of item ``b`` (the items' outputs side by side).

    Example:
        >>> logits = torch.zeros(2, 3, 4)   # one item, two perturbations, uniform over 4 tokens
        >>> continuation_scores(logits, torch.tensor([[1, 2]]), 2).exp()
        tensor([[0.2500, 0.2500],
                [0.2500, 0.2500]])
    """
    batch, n = tokens.shape
    chosen = tokens.to(logits.device).repeat_interleave(k, 0)[:, :, None]
    scores = torch.log_softmax(logits[:, -n:], dim=-1).gather(2, chosen)[..., 0]  # (batch * k, N)
    return scores.detach().reshape(batch, k, n).transpose(1, 2).reshape(batch * n, k)


def _describe(value: object) -> str:
    return f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
