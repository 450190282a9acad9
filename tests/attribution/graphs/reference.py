"""The frozen model of a prompt written out from the weights, for the attribution graph's known answers.

Tiny float64 Llama (GQA) and GPT-2 forwards re-implemented by hand: the attention probabilities are the clean run's
(``output_attentions=True``), the norm scales are computed from the clean residual stream of this same forward, the
token vectors and each layer's neuron activations are separate leaves. The pinned edge ``s -> t`` is then
``a_s * J[t, s]`` with ``J`` the Jacobian of the targets with respect to the leaves.

With ``basis={layer: dictionary}`` that layer's MLP writes ``features @ W_dec + b_dec (+ h @ W_skip) + error`` from
two leaves (the features and the error, ``MLP output - reconstruction`` at the clean point), and its targets are the
features, encoded by hand from the weights: an SAE from the MLP's output (the MLP live), a transcoder from the MLP's
input. An error's column is ``error . J[t, error]``.
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

    def __init__(
        self, model: nn.Module, ids: torch.Tensor, kind: str, rules: str | None = None, basis: dict | None = None
    ) -> None:
        self.model, self.ids, self.kind, self.rules = model, ids, kind, rules
        self.basis = basis or {}
        self.clean_features: dict[int, torch.Tensor] | None = None  # layer -> the encoder's clean pre-activations
        self.errors: dict[int, torch.Tensor] | None = None  # layer -> (T, d): MLP output - reconstruction, clean
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
        self.errors = {}
        for layer, d in self.basis.items():
            written = targets[layer] @ d.W_dec + d.b_dec + self._skip(self.mlp_inputs[layer], d)
            self.errors[layer] = (self.mlp_outputs[layer] - written).detach()
        self.clean_features = dict(self.feature_pre)

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

    def _skip(self, h: torch.Tensor, d: nn.Module) -> torch.Tensor | float:
        return h @ d.W_skip if getattr(d, "W_skip", None) is not None else 0.0

    def _encode(self, h: torch.Tensor, y: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A dictionary's pre-activations and features: an SAE reads the MLP's output, a transcoder its input."""
        d = self.basis[layer]
        if type(d).__name__ == "SAE":
            pre = (y - d.b_dec if d.subtract_b_dec else y) @ d.W_enc + d.b_enc
        else:
            pre = h @ d.W_enc + d.b_enc
        if d.activation == "relu":
            f = pre.clamp_min(0)
        elif d.activation == "jumprelu":
            f = torch.where(pre > d.threshold, pre, torch.zeros_like(pre))
        else:  # topk: the k largest positive pre-activations per position
            keep = pre.clamp_min(0).argsort(-1, descending=True)[..., : d.k]
            f = torch.zeros_like(pre).scatter(-1, keep, pre.gather(-1, keep).clamp_min(0))
        if self.rules == "relp" and self.clean_features is not None:  # the identity rule f / pre at the clean point
            clean = self.clean_features[layer]
            ratio = torch.where(clean != 0, self.activations[layer] / clean, torch.zeros_like(clean))
            return pre, ratio.detach() * pre
        return pre, f

    def _unembed(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.model.lm_head.weight.T

    # -- the forward ------------------------------------------------------------------------------------------------
    def forward(self, x0: torch.Tensor, held: list[torch.Tensor] | None, factors: list[torch.Tensor] | None = None):
        """Targets per layer, logits, each norm's input, the pre-activations; ``held``: the neurons the MLPs write.

        ``factors``: per layer ``(T, width)``, multiplies the neurons (live, not held) before they are written.
        At a layer of ``self.basis`` the target is the features and ``held[layer]`` is ``(features, error)``; without
        ``held`` the layer writes its live features and its clean error (the replacement model; the clean run before
        the errors are known writes the MLP's output), ``factors[layer]`` ``(T, features + 1)`` multiplying both.
        """
        x, targets, inputs, pre_all = x0, [], [], []
        self.mlp_inputs, self.mlp_outputs, self.feature_pre = {}, {}, {}
        for layer in range(len(self.patterns)):
            inputs.append(x)
            x = x + self._attention(self._norm(x, 2 * layer), layer)
            inputs.append(x)
            h = self._norm(x, 2 * layer + 1)
            pre = self._pre(h, layer)
            pre_all.append(pre)
            a = self._activation(pre, layer)
            if layer in self.basis:
                d, y = self.basis[layer], self._write(a, layer)
                self.mlp_inputs[layer], self.mlp_outputs[layer] = h, y
                self.feature_pre[layer], f = self._encode(h, y, layer)
                targets.append(f)
                if held is None and self.errors is None:
                    x = x + y
                    continue
                features, error = held[layer] if held is not None else (f, self.errors[layer])
                if factors is not None:
                    features, error = features * factors[layer][:, :-1], error * factors[layer][:, -1:]
                x = x + features @ d.W_dec + d.b_dec + self._skip(h, d) + error
                continue
            targets.append(a)
            written = a if held is None else held[layer]
            x = x + self._write(written if factors is None else written * factors[layer], layer)
        inputs.append(x)
        return targets, self._unembed(self._norm(x, len(inputs) - 1)), inputs, pre_all

    def expected(self, nodes, logit_tokens: torch.Tensor, foils: torch.Tensor) -> torch.Tensor:
        """The dense ``(n, n)`` pinned adjacency for the graph's nodes (neurons, features, errors, tokens, logits)."""
        layers = len(self.patterns)
        leaves, owner = [], []  # the flat leaves after the tokens: per layer its units, then its error if any
        for layer in range(layers):
            leaves.append(self.activations[layer].detach())
            owner.append((layer, "units"))
            if layer in self.basis:
                leaves.append(self.errors[layer])
                owner.append((layer, "error"))

        def targets(x0: torch.Tensor, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            mine: dict[int, list[torch.Tensor]] = {}
            for (layer, _), leaf in zip(owner, flat, strict=True):
                mine.setdefault(layer, []).append(leaf)
            held = [tuple(mine[i]) if i in self.basis else mine[i][0] for i in range(layers)]
            found, logits, _, _ = self.forward(x0, held)
            z = logits[-1]
            pairs = zip(logit_tokens, foils, strict=True)
            values = torch.stack([z[t] - (z[f] if f >= 0 else z.mean()) for t, f in pairs])
            return (*found, values)

        jac = torch.autograd.functional.jacobian(targets, (self.x0.detach(), *leaves), vectorize=True)
        full = []  # one row per target (every unit, then the logits), one column per source (tokens, units, errors)
        for block in jac:
            rows = block[0].shape[: block[0].dim() - 2].numel()
            columns = [(block[0] * self.x0).sum(-1).reshape(rows, -1)]
            for (_, what), b, leaf in zip(owner, block[1:], leaves, strict=True):
                product = b * leaf
                columns.append((product.sum(-1) if what == "error" else product).reshape(rows, -1))
            full.append(torch.cat(columns, 1))
        full_matrix = torch.cat(full)
        t = len(self.ids)
        row_start, column_start, error_start, row, column = {}, {}, {}, 0, t
        for layer in range(layers):
            width = self.activations[layer].shape[-1]
            row_start[layer], column_start[layer] = row, column
            row, column = row + t * width, column + t * width
            if layer in self.basis:
                error_start[layer], column = column, column + t
        out = torch.zeros(len(nodes), len(nodes), dtype=torch.float64)
        logit_rank = 0
        target_rows, source_columns = {}, {}
        for i in range(len(nodes)):
            node = nodes[i]
            if node.kind in ("neuron", "feature"):
                width = self.activations[node.layer].shape[-1]
                target_rows[i] = row_start[node.layer] + node.position * width + node.index
                source_columns[i] = column_start[node.layer] + node.position * width + node.index
            elif node.kind == "error":
                source_columns[i] = error_start[node.layer] + node.position
            elif node.kind == "token":
                source_columns[i] = node.position
            else:
                target_rows[i] = row + logit_rank
                logit_rank += 1
        r = torch.tensor(list(target_rows.values()))
        c = torch.tensor(list(source_columns.values()))
        chosen = full_matrix[r[:, None], c[None]]
        out[torch.tensor(list(target_rows))[:, None], torch.tensor(list(source_columns))[None]] = chosen
        return out.detach()

    def total_effect(self, chosen: list[tuple[int, int, int]], logit_tokens: torch.Tensor) -> torch.Tensor:
        """d(logit values) / d(eps) when the chosen neurons (features, errors: index -1) are multiplied by ``1 + eps``,
        all neurons and features live, errors held."""
        layers = len(self.patterns)
        t = len(self.ids)

        def values(eps: torch.Tensor) -> torch.Tensor:
            widths = [self.activations[i].shape[-1] + (i in self.basis) for i in range(layers)]
            factors = [torch.ones(t, widths[i], dtype=torch.float64) for i in range(layers)]
            for layer, position, index in chosen:
                factors[layer] = factors[layer].index_put((torch.tensor(position), torch.tensor(index)), 1 + eps)
            _, logits, _, _ = self.forward(self.x0.detach(), None, factors)
            return logits[-1][logit_tokens] - logits[-1].mean()

        return torch.autograd.functional.jacobian(values, torch.zeros((), dtype=torch.float64)).detach()
