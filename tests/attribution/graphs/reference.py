"""The frozen model of a prompt written out from the weights, for the attribution graph's known answers.

Tiny float64 Llama (GQA) and GPT-2 forwards re-implemented by hand: the attention probabilities are the clean run's
(``output_attentions=True``), the norm scales are computed from the clean residual stream of this same forward, the
token vectors and each layer's neuron activations are separate leaves. The pinned edge ``s -> t`` is then
``a_s * J[t, s]`` with ``J`` the Jacobian of the targets with respect to the leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

RELP_EPS = 1e-10  # the identity rule's act(x) / (x + eps)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class Reference:
    """The frozen model of ``ids`` in ``model`` (``"llama"`` or ``"gpt2"``), its targets as functions of leaves."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, kind: str, rules: str | None = None) -> None:
        self.model, self.ids, self.kind, self.rules = model, ids, kind, rules
        with torch.no_grad():
            out = model(ids[None], output_attentions=True, use_cache=False)
        self.hf_logits = out.logits[0]
        self.patterns = [p[0] for p in out.attentions]  # (heads, T, T) per layer
        self.x0 = self._embed()
        self.scales: list[torch.Tensor] | None = None
        self.clean: list[tuple[torch.Tensor, ...]] | None = None
        with torch.no_grad():
            targets, logits, inputs, pre = self.forward(self.x0, None)
        self.clean_logits = logits
        self.activations = targets
        self.scales = [self._scale(x, i) for i, x in enumerate(inputs)]
        self.clean = pre

    # -- pieces --------------------------------------------------------------------------------------------------
    def _embed(self) -> torch.Tensor:
        if self.kind == "gpt2":
            t = self.model.transformer
            return t.wte.weight[self.ids] + t.wpe.weight[: len(self.ids)]
        return self.model.model.embed_tokens.weight[self.ids]

    def _norms(self) -> list[nn.Module]:
        if self.kind == "gpt2":
            t = self.model.transformer
            return [n for block in t.h for n in (block.ln_1, block.ln_2)] + [t.ln_f]
        m = self.model.model
        return [n for layer in m.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [m.norm]

    def _scale(self, x: torch.Tensor, i: int) -> torch.Tensor:
        norm = self._norms()[i]
        if self.kind == "gpt2":
            return (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        return (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()

    def _norm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        norm = self._norms()[i]
        scale = self._scale(x, i) if self.scales is None else self.scales[i]
        if self.kind == "gpt2":
            return (x - x.mean(-1, keepdim=True)) / scale * norm.weight + norm.bias
        return x / scale * norm.weight

    def _attention(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        pattern = self.patterns[layer]
        heads = pattern.shape[0]
        if self.kind == "gpt2":
            attn = self.model.transformer.h[layer].attn
            d = h.shape[-1]
            v = (h @ attn.c_attn.weight[:, 2 * d :] + attn.c_attn.bias[2 * d :]).view(len(h), heads, -1)
            z = torch.einsum("hqk,khe->qhe", pattern, v).flatten(1)
            return z @ attn.c_proj.weight + attn.c_proj.bias
        attn = self.model.model.layers[layer].self_attn
        v = (h @ attn.v_proj.weight.T).view(len(h), -1, attn.head_dim)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)  # query head h reads key/value head h // group
        z = torch.einsum("hqk,khe->qhe", pattern, v).flatten(1)
        return z @ attn.o_proj.weight.T

    def _pre(self, h: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """The MLP's pre-activations: (fc,) for GPT-2, (gate, up) for Llama."""
        if self.kind == "gpt2":
            mlp = self.model.transformer.h[layer].mlp
            return (h @ mlp.c_fc.weight + mlp.c_fc.bias,)
        mlp = self.model.model.layers[layer].mlp
        return h @ mlp.gate_proj.weight.T, h @ mlp.up_proj.weight.T

    def _activation(self, pre: tuple[torch.Tensor, ...], layer: int) -> torch.Tensor:
        """The neurons from the pre-activations; with RelP's rules, the surrogate whose gradient is the rules'."""
        act: Callable[[torch.Tensor], torch.Tensor] = _gelu_new if self.kind == "gpt2" else nn.functional.silu
        if self.rules != "relp" or self.clean is None:
            return act(pre[0]) * (pre[1] if len(pre) > 1 else 1)
        clean = self.clean[layer]
        ratio = act(clean[0]) / (clean[0] + RELP_EPS)  # the identity rule: act(x) / x at the clean point
        if len(pre) == 1:
            return ratio * pre[0]
        return 0.5 * (ratio * pre[0] * clean[1] + act(clean[0]) * pre[1])  # the half rule on act(gate) * up

    def _write(self, a: torch.Tensor, layer: int) -> torch.Tensor:
        if self.kind == "gpt2":
            mlp = self.model.transformer.h[layer].mlp
            return a @ mlp.c_proj.weight + mlp.c_proj.bias
        return a @ self.model.model.layers[layer].mlp.down_proj.weight.T

    def _unembed(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.model.lm_head.weight.T

    # -- the forward ------------------------------------------------------------------------------------------------
    def forward(self, x0: torch.Tensor, held: list[torch.Tensor] | None, factors: list[torch.Tensor] | None = None):
        """Targets per layer, logits, each norm's input, the pre-activations; ``held``: the neurons the MLPs write.

        ``factors``: per layer ``(T, width)``, multiplies the neurons (live, not held) before they are written.
        """
        x, targets, inputs, pre_all = x0, [], [], []
        for layer in range(len(self.patterns)):
            inputs.append(x)
            x = x + self._attention(self._norm(x, 2 * layer), layer)
            inputs.append(x)
            pre = self._pre(self._norm(x, 2 * layer + 1), layer)
            pre_all.append(pre)
            a = self._activation(pre, layer)
            targets.append(a)
            written = a if held is None else held[layer]
            x = x + self._write(written if factors is None else written * factors[layer], layer)
        inputs.append(x)
        return targets, self._unembed(self._norm(x, len(inputs) - 1)), inputs, pre_all

    def expected(self, nodes, logit_tokens: torch.Tensor, foils: torch.Tensor) -> torch.Tensor:
        """The dense ``(n, n)`` pinned adjacency for the graph's ``nodes`` (neuron, token and logit nodes)."""
        layers = len(self.patterns)
        held = [a.detach() for a in self.activations]

        def targets(x0: torch.Tensor, *neurons: torch.Tensor) -> tuple[torch.Tensor, ...]:
            found, logits, _, _ = self.forward(x0, list(neurons))
            z = logits[-1]
            pairs = zip(logit_tokens, foils, strict=True)
            values = torch.stack([z[t] - (z[f] if f >= 0 else z.mean()) for t, f in pairs])
            return (*found, values)

        jac = torch.autograd.functional.jacobian(targets, (self.x0.detach(), *held), vectorize=True)
        full = []  # one row per target (every neuron, then the logits), one column per source (tokens, neurons)
        for block in jac:
            rows = block[0].shape[: block[0].dim() - 2].numel()
            tokens = (block[0] * self.x0).sum(-1).reshape(rows, -1)
            neurons = [(b * h).reshape(rows, -1) for b, h in zip(block[1:], held, strict=True)]
            full.append(torch.cat([tokens, *neurons], 1))
        full_matrix = torch.cat(full)
        t, w = held[0].shape
        kind = nodes.kind
        position, index, layer = nodes.position, nodes.index, nodes.layer
        neuron = torch.tensor([k == "neuron" for k in kind])
        logit = torch.tensor([k == "logit" for k in kind])
        logit_rank = torch.cumsum(logit.long(), 0) - 1
        row = torch.where(logit, layers * t * w + logit_rank, layer.clamp_min(0) * t * w + position * w + index)
        column = torch.where(neuron, t + layer.clamp_min(0) * t * w + position * w + index, position)
        source = ~logit
        out = torch.zeros(len(kind), len(kind), dtype=torch.float64)
        targets_ = (neuron | logit).nonzero().flatten()
        sources = source.nonzero().flatten()
        out[targets_[:, None], sources[None]] = full_matrix[row[targets_][:, None], column[sources][None]]
        return out.detach()

    def total_effect(self, chosen: list[tuple[int, int, int]], logit_tokens: torch.Tensor) -> torch.Tensor:
        """d(logit values) / d(eps) when the chosen neurons are multiplied by ``1 + eps``, all neurons live."""
        layers = len(self.patterns)
        t, w = self.activations[0].shape

        def values(eps: torch.Tensor) -> torch.Tensor:
            factors = [torch.ones(t, w, dtype=torch.float64) for _ in range(layers)]
            for layer, position, index in chosen:
                factors[layer] = factors[layer].index_put((torch.tensor(position), torch.tensor(index)), 1 + eps)
            _, logits, _, _ = self.forward(self.x0.detach(), None, factors)
            return logits[-1][logit_tokens] - logits[-1].mean()

        return torch.autograd.functional.jacobian(values, torch.zeros((), dtype=torch.float64)).detach()
