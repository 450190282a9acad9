"""Small models for the attribution tests (the reference data's architectures, written here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.support import DATA


class SmallVGG(nn.Module):
    """VGG-like CNN of the Grad-CAM reference data: an in-place ReLU right after the target layer ``features.6``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(inplace=True), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def small_vgg() -> SmallVGG:
    model = SmallVGG()
    model.load_state_dict(torch.load(DATA / "gradcam" / "small_vgg_state.pt", weights_only=True))
    return model.eval()


def gradcam_reference() -> dict:
    return torch.load(DATA / "gradcam" / "gradcam_reference.pt", weights_only=True)


class _Attention(nn.Module):
    """Causal multi-head attention returning ``(output, pattern)``; heads are concatenated before ``o``."""

    def __init__(self, d_model: int, n_heads: int, d_head: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_head
        self.q = nn.Linear(d_model, n_heads * d_head)
        self.k = nn.Linear(d_model, n_heads * d_head)
        self.v = nn.Linear(d_model, n_heads * d_head)
        self.o = nn.Linear(n_heads * d_head, d_model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.n_heads, self.d_head).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / self.d_head**0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        pattern = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        heads = (pattern @ v).transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)
        return self.o(heads), pattern


class _MLP(nn.Module):
    def __init__(self, d_model: int, d_mlp: int) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(d_model, d_mlp), nn.Linear(d_mlp, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(torch.nn.functional.gelu(self.fc_in(x)))


class _Block(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c["d_model"], eps=c["eps"])
        self.attn = _Attention(c["d_model"], c["n_heads"], c["d_head"])
        self.ln2 = nn.LayerNorm(c["d_model"], eps=c["eps"])
        self.mlp = _MLP(c["d_model"], c["d_mlp"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Pre-LN decoder-only transformer of the patching reference data (same function and state_dict keys)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(c["d_vocab"], c["d_model"])
        self.pos = nn.Embedding(c["n_ctx"], c["d_model"])
        self.layers = nn.ModuleList(_Block(c) for _ in range(c["n_layers"]))
        self.ln_out = nn.LayerNorm(c["d_model"], eps=c["eps"])
        self.head = nn.Linear(c["d_model"], c["d_vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.head(self.ln_out(x))


def tiny_gpt() -> tuple[TinyGPT, dict]:
    """The reference transformer with its weights, and the reference results."""
    import json

    config = json.loads((DATA / "patching" / "tiny_config.json").read_text())["config"]
    model = TinyGPT(config)
    model.load_state_dict(torch.load(DATA / "patching" / "tiny_model_state.pt", weights_only=True))
    return model.eval(), torch.load(DATA / "patching" / "patching_reference.pt", weights_only=True)


def tiny_llama(**config: Any) -> nn.Module:
    """A tiny HuggingFace Llama (2 layers, 4 heads, 2 key-value heads) with seed-0 random weights, in eval mode.

    ``config`` overrides ``LlamaConfig`` settings; the test is skipped where transformers is not installed.
    """
    transformers = pytest.importorskip("transformers")
    settings = {
        "vocab_size": 50,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
    }
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config})).eval()


def sweep_setting() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 ``Linear-Tanh-Linear`` with three 6-wide sites, and two inputs of 3 examples x 4 positions."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    return model, torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)


def last_position_sum(out: torch.Tensor) -> torch.Tensor:
    """A scalar metric: the sum of the last position's output."""
    return out[:, -1].sum()


def last_position_per_item(out: torch.Tensor) -> torch.Tensor:
    """A ``(batch,)`` metric: each example's sum of the last position's output."""
    return out[:, -1].sum(-1)


def lm64(kind: str = "llama") -> nn.Module:
    """A tiny float64 HuggingFace LM with eager attention: ``"llama"`` (2 layers, 4 query heads sharing 2 key/value
    heads, seed 0), ``"qwen2"`` (the same shape, seed 1) or ``"gpt2"`` (2 layers, 4 heads, seed 2); vocabulary 40,
    width 16. The models of the AttnLRP, RelP and generation-AttnLRP known-answer tests."""
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        torch.manual_seed(2)
        config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=16)
        config._attn_implementation = "eager"
        return transformers.GPT2LMHeadModel(config).double().eval()
    seed, config_class, model_class = {
        "llama": (0, transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (1, transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="eager",
    )  # fmt: skip
    return model_class(config).double().eval()


class ScalarPolynomials(nn.Module):
    """A batch of scalars ``(batch,)`` to two logits ``(x^2, -x^3)``: gradients ``2x`` and ``-3x^2`` by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Identity()  # a layer whose output is 1-D, for the layer variants

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.scale(x)
        return torch.stack([x * x, -(x**3)], 1)


class ScalarReLUs(nn.Module):
    """A batch of scalars to the logits ``(2 relu(x), -3 relu(-x))``, through one ``nn.ReLU`` of two units."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(torch.stack([x, -x], 1)) * torch.tensor([2.0, -3.0], dtype=x.dtype)


def scalars() -> torch.Tensor:
    """1-D inputs: three items of one number each (a fresh tensor: peer libraries set ``requires_grad`` on theirs)."""
    return torch.tensor([1.5, -2.0, -0.5], dtype=torch.float64)


SCALAR_TARGETS = [0, 1, 1]
