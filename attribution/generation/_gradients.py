"""The gradients of many generated tokens' log-probabilities from one teacher-forced forward.

One forward of ``prompt + generated`` keeps the graph from the input embeddings (a leaf) to the unembedding's input
(the final hidden states). The gradient of generated token ``i``'s log-probability at the hidden state of position
``P - 1 + i`` is known in closed form for a linear unembedding, ``W[token] - softmax(logits) @ W`` (else from a small
graph over the unembedding alone); the backward passes then start at the hidden states, ``target_batch`` targets at a
time through ``torch.autograd.grad(..., is_grads_batched=True)``, so that the unembedding's vocabulary-sized matrix
is never in a backward pass and ``N`` targets cost ``ceil(N / target_batch)`` backward passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._run import HookedRun, hook_site
from ..models import linear


def hidden_gradients(
    unembedding: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, softcap: float | None, log_prob: bool = True
) -> torch.Tensor:
    """``(k, N, d)`` the gradient of ``log_softmax(unembedding(h))[token]`` at each ``h`` of ``hidden`` ``(k, N, d)``.

    ``softcap``: Gemma 2's ``final_logit_softcapping`` (logits ``c * tanh(logits / c)``), or ``None``.
    ``log_prob=False``: the gradient of the (soft-capped) logit ``unembedding(h)[token]`` itself (AttnLRP's target).

    Example:
        >>> head = nn.Linear(4, 6)
        >>> h, tokens = torch.randn(1, 3, 4), torch.tensor([0, 5, 2])
        >>> x = h.clone().requires_grad_()
        >>> lp = head(x).log_softmax(-1)[0, torch.arange(3), tokens]
        >>> bool(torch.allclose(hidden_gradients(head, h, tokens, None), torch.autograd.grad(lp.sum(), x)[0]))
        True
        >>> bool(torch.equal(hidden_gradients(head, h, tokens, None, log_prob=False)[0], head.weight[tokens]))
        True
    """
    h = hidden.detach()
    if isinstance(unembedding, nn.Linear) and softcap is None:
        with torch.no_grad():
            W, b = linear(unembedding, device=h.device)  # real also where accelerate offloaded the head
            if not log_prob:
                return W[tokens].to(h.dtype).expand(len(h), -1, -1)
            probs = torch.nn.functional.linear(h, W, b).softmax(-1)
            return W[tokens] - probs @ W
    with torch.enable_grad():
        x = h.requires_grad_(True)
        logits = unembedding(x)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        scores = logits.log_softmax(-1) if log_prob else logits
        picked = scores.gather(-1, tokens.expand(len(x), -1)[..., None])
        return torch.autograd.grad(picked.sum(), x)[0]


class TeacherForced:
    """Guarded forwards of token ids whose embedding output (or a function of it) is the graph's leaf.

    A context manager around :class:`attribution._run.HookedRun` (the model's state restored on exit, one hook
    group): in the body the parameters do not require grad, the embedding's output passes through
    :attr:`transform` and becomes a leaf, and the unembedding's input (the final hidden states) is kept with its graph.
    """

    def __init__(self, model: nn.Module, embedding: nn.Module, unembedding: nn.Module) -> None:
        self.model, self.embedding, self.unembedding = model, embedding, unembedding
        self.transform: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.run = HookedRun(model, "attribute_generation", with_grad=True)
        self.seen: dict[str, torch.Tensor] = {}

    def __enter__(self) -> TeacherForced:
        self.run.__enter__()
        try:
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.run.group.forward(self.embedding, self._at_embedding)
            hook_site(self.run.group, self.unembedding, "input", None, self._at_unembedding)
        except BaseException:
            self.run.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.run.__exit__(*exc)

    def _at_embedding(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        self.seen["embedded"] = output
        self.seen["leaf"] = self.run.leaf(output if self.transform is None else self.transform(output))
        return self.seen["leaf"]

    def _at_unembedding(self, tensor: torch.Tensor, name: str, call: int) -> None:
        self.seen.setdefault("hidden", tensor)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(embedded, leaf, hidden)``: the embedding's output, the leaf the model ran from, the last hidden states."""
        self.seen = {}
        self.run.forward({"input_ids": ids, "use_cache": False})
        return self.seen["embedded"], self.seen["leaf"], self.seen["hidden"]


def batched_backward(
    hidden: torch.Tensor, leaf: torch.Tensor, grads: torch.Tensor, positions: torch.Tensor, *, retain: bool
) -> torch.Tensor:
    """``(n, k, T, d)``: for each of ``n`` targets, in one backward pass, the gradient at ``leaf`` ``(k, T, d)``.

    Target ``j`` enters ``hidden`` ``(k, T, d)`` as ``grads[j]`` ``(k, d)`` at position ``positions[j]``.
    """
    seeds = hidden.new_zeros(len(grads), *hidden.shape)
    seeds[torch.arange(len(grads)), :, positions] = grads.to(hidden.dtype)
    return torch.autograd.grad(hidden, leaf, seeds, retain_graph=retain, is_grads_batched=True)[0]
