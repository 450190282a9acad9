"""Per-example gradients by hooks equal a loop of single-example ``torch.autograd.grad`` (float64, 1e-10 relative)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.influence import per_example_gradients
from attribution.influence._rules import conv, embedding, linear
from tests.attribution.models import tiny_llama
from tests.support import hook_state

CE = nn.CrossEntropyLoss(reduction="none")


class GroupedCNN(nn.Module):
    """Convolutions with groups, dilation, stride, "same"/reflect and circular padding, a LayerNorm and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)
        self.c2 = nn.Conv2d(6, 4, 3, padding="same", padding_mode="reflect", bias=False)
        self.c3 = nn.Conv1d(4, 3, 2, stride=2, dilation=2, padding=1, padding_mode="circular")
        self.norm = nn.LayerNorm(3)
        self.fc = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x))
        h = self.c2(h).mean(2)
        h = self.c3(h).transpose(1, 2)
        return self.fc(self.norm(h)).mean(1)


def loop_gradients(model, batches, loss_of) -> list[dict[str, torch.Tensor]]:
    """The slow reference: one ``torch.autograd.grad`` per example."""
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad], strict=True)
    out = []
    for batch in batches:
        grads = torch.autograd.grad(loss_of(batch).sum(), params, allow_unused=True)
        out.append({n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, params, grads, strict=True)})
    return out


def classifier_loop(model, x, y):
    """The loop reference for a classifier with cross-entropy."""
    return loop_gradients(model, [(x[i : i + 1], y[i : i + 1]) for i in range(len(y))], lambda b: CE(model(b[0]), b[1]))


def assert_matches_loop(grads, reference, rtol=1e-10):
    assert set(grads) == set(reference[0])
    for name, g in grads.items():
        expected = torch.stack([r[name] for r in reference])
        scale = expected.abs().max().clamp_min(1e-300)
        assert (g - expected).abs().max() <= rtol * scale, name


def cnn_setting():
    torch.manual_seed(0)
    model = GroupedCNN().double().eval()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    x = torch.randn(3, 4, 7, 5, dtype=torch.float64)  # non-square
    y = torch.tensor([0, 3, 4])
    return model, x, y


def test_cnn_with_groups_dilation_stride_and_padding_modes_equals_the_loop():
    model, x, y = cnn_setting()
    grads = per_example_gradients(model, (x, y), CE)
    reference = classifier_loop(model, x, y)
    assert_matches_loop(grads, reference)
    assert grads["c1.weight"].shape == (3, 6, 2, 3, 2)


def lm_loss(outputs, batch):
    """Next-token cross-entropy per sequence, padding positions (label -100) left out."""
    logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
    return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)


def lm_reference(model, ids, mask):
    batches = [{"input_ids": ids[i : i + 1], "labels": ids[i : i + 1]} for i in range(3)]
    return loop_gradients(model, batches, lambda b: lm_loss(model(input_ids=b["input_ids"]), b))


@pytest.mark.slow
def test_tiny_llama_with_tied_embeddings_and_padding_idx_equals_the_loop():
    model = tiny_llama(tie_word_embeddings=True, pad_token_id=0).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.model.embed_tokens.padding_idx == 0
    ids = torch.randint(1, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    ids[0, 2] = ids[2, 4] = 0  # the padding token, used as a token
    mask = torch.ones_like(ids)
    grads = per_example_gradients(model, {"input_ids": ids, "labels": ids}, lm_loss)
    assert_matches_loop(grads, lm_reference(model, ids, mask))
    embed = grads["model.embed_tokens.weight"]
    assert "lm_head.weight" not in grads  # tied: one parameter, named as named_parameters() names it
    assert embed[:, 0].abs().max() > 0  # the padding row gets the unembedding's use only
    # a tied parameter chosen through one of its modules still gets the sum of all its uses
    lone = per_example_gradients(model, {"input_ids": ids, "labels": ids}, lm_loss, modules="model.embed_tokens")
    assert list(lone) == ["model.embed_tokens.weight"] and torch.equal(lone["model.embed_tokens.weight"], embed)
    untied = tiny_llama(tie_word_embeddings=False, pad_token_id=0).double()
    rows = per_example_gradients(untied, {"input_ids": ids, "labels": ids}, lm_loss, modules="model.embed_tokens")
    assert torch.equal(rows["model.embed_tokens.weight"][:, 0], torch.zeros_like(embed[:, 0]))
    assert rows["model.embed_tokens.weight"][:, 1:].abs().sum(-1).gt(0).any()


@pytest.mark.slow
def test_tiny_gpt2_with_conv1d_broadcast_position_embedding_and_tied_head_equals_the_loop():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, 40, (3, 6), generator=torch.Generator().manual_seed(2))
    grads = per_example_gradients(model, {"input_ids": ids, "labels": ids}, lm_loss)
    assert_matches_loop(grads, lm_reference(model, ids, torch.ones_like(ids)))
    assert grads["transformer.h.0.attn.c_attn.weight"].shape == (3, 16, 48)  # Conv1D: (in, out)
    wpe = grads["transformer.wpe.weight"]
    assert not torch.equal(wpe[0], wpe[1])  # each example its own share of the batch-wide call


def test_module_called_twice_sums_its_calls_and_frozen_parameters_are_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    model[2].bias.requires_grad_(False)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(torch.cat([self.inner[0](x), x[:, :0]], 1) + x)

    twice = Twice()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    grads = per_example_gradients(twice, (x, y), CE)
    assert "inner.2.bias" not in grads
    reference = classifier_loop(twice, x, y)
    assert_matches_loop(grads, reference)


def test_rules_against_formulas_written_out():
    g = torch.Generator().manual_seed(0)
    a, delta = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 5, generator=g).double()
    w = linear(a, delta, bias=True)
    expected = torch.stack([sum(torch.outer(delta[b, t], a[b, t]) for t in range(3)) for b in range(2)])
    torch.testing.assert_close(w["weight"], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w["bias"], delta.sum(1))
    idx = torch.tensor([[1, 1, 3], [0, 2, 2]])
    e = embedding(idx, delta, num_embeddings=4, padding_idx=2)["weight"]
    torch.testing.assert_close(e[0, 1], delta[0, 0] + delta[0, 1])
    assert torch.equal(e[1, 2], torch.zeros(5, dtype=torch.float64)) and torch.equal(e[1, 0], delta[1, 0])
    x, d = torch.randn(1, 2, 5, generator=g).double(), torch.randn(1, 2, 2, generator=g).double()  # 1-D conv
    c = conv(x, d, kernel_size=(2,), stride=(2,), padding=(0,), dilation=(1,), groups=2, bias=False)["weight"]
    assert c.shape == (1, 2, 1, 2)
    assert c[0, 1, 0, 1].item() == pytest.approx(float(d[0, 1, 0] * x[0, 1, 1] + d[0, 1, 1] * x[0, 1, 3]))


def test_model_is_left_as_found():
    model, x, y = cnn_setting()
    model.train()
    model.c2.weight.requires_grad_(False)
    model.fc.weight.grad = sentinel = torch.ones_like(model.fc.weight)
    before, hooks_before = {k: v.clone() for k, v in model.state_dict().items()}, hook_state(model)
    grads = per_example_gradients(model, (x, y), CE)
    assert "c2.weight" not in grads
    assert model.training and all(m.training for m in model.modules())
    assert not model.c2.weight.requires_grad and model.fc.weight.requires_grad
    assert model.fc.weight.grad is sentinel and model.c1.weight.grad is None
    assert hook_state(model) == hooks_before
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_mean_reduced_loss_is_refused_saying_why():
    model, x, y = cnn_setting()
    with pytest.raises(ValueError, match=r"reduction='mean'.*one loss per example"):
        per_example_gradients(model, (x, y), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="one number for the whole batch"):
        per_example_gradients(model, (x, y), lambda out, batch: CE(out, batch[1]).mean())
    assert hook_state(model) == hook_state(cnn_setting()[0])


def test_unsupported_module_is_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\).*modules="):
        per_example_gradients(model, (x, y), CE)
    grads = per_example_gradients(model, (x, y), CE, modules=["0", "2"])  # left out: fine
    assert list(grads) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_non_finite_loss_names_the_examples():
    model, x, y = cnn_setting()
    x[1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"not finite for examples \[1\]"):
        per_example_gradients(model, (x, y), CE)


class OffsetRMSNorm(nn.Module):
    """Gemma's convention: the gain is ``1 + weight`` (optionally all in float32, as HuggingFace's Gemma does)."""

    def __init__(self, width: int, upcast: bool = False) -> None:
        super().__init__()
        self.weight, self.eps, self.upcast = nn.Parameter(torch.randn(width) * 0.1), 1e-6, upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = (x.float(), self.weight.float()) if self.upcast else (x, self.weight)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + w)).type_as(x)


class NormsModel(nn.Module):
    """An embedding with padding_idx, torch's RMSNorm, a Gemma-style RMSNorm and a LayerNorm over two axes."""

    def __init__(self, upcast: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=3)
        self.rms = nn.RMSNorm(6)
        self.offset = OffsetRMSNorm(6, upcast)
        self.ln = nn.LayerNorm((5, 6))
        self.head = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.offset(torch.tanh(self.rms(self.embed(ids))))
        return self.head(self.ln(h)).sum(1)


@pytest.mark.parametrize("upcast", [False, True])
def test_norm_gains_and_padding_idx_equal_the_loop(upcast):
    torch.manual_seed(0)
    model = NormsModel(upcast).double()
    with torch.no_grad():
        model.rms.weight.normal_()
        model.ln.weight.normal_()
        model.ln.bias.normal_()
    ids = torch.tensor([[1, 3, 3, 7, 10], [3, 0, 2, 2, 9], [4, 4, 4, 3, 1]])
    y = torch.tensor([0, 3, 1])
    grads = per_example_gradients(model, (ids, y), CE)
    reference = classifier_loop(model, ids, y)
    # upcast: the loop's own gain gradient is summed over positions in float32 (the module multiplies in float32),
    # ours in float64, so they agree to float32 rounding only
    assert_matches_loop(grads, reference, rtol=1e-6 if upcast else 1e-10)
    assert torch.equal(grads["embed.weight"][:, 3], torch.zeros(3, 6, dtype=torch.float64))
    assert grads["ln.weight"].shape == (3, 5, 6)


class InPlaceResidual(nn.Module):
    """ResNet's pattern: an in-place ReLU on a conv's output and an in-place residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.conv1(x))
        out = self.conv2(h)
        out += h
        return self.fc(self.relu(out).mean((2, 3)))


def test_in_place_relu_and_residual_equal_the_loop():
    torch.manual_seed(0)
    model = InPlaceResidual().double()
    x, y = torch.randn(3, 2, 5, 4, dtype=torch.float64), torch.tensor([2, 0, 1])
    grads = per_example_gradients(model, (x, y), CE)
    reference = classifier_loop(model, x, y)
    assert_matches_loop(grads, reference)


class TiedByHand(nn.Module):
    """Logits as ``hidden @ embed.weight.T``: a use of the embedding that no module call contains."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).to(self.mix.weight.dtype) * self.mix.weight.shape[0] / self.mix.weight.detach().numel()
        return (self.mix(h) @ self.embed.weight.T).sum(1)


def test_a_parameter_used_outside_its_module_is_named_not_missed():
    ids, y = torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 6])
    with pytest.raises(ValueError, match=r"outside their modules' calls: 'embed.weight' \(by T\)"):
        per_example_gradients(TiedByHand(), (ids, y), CE)
    # reading mix.weight's dtype, shape or a detached copy outside its call carries no gradient: not a use
    assert list(per_example_gradients(TiedByHand(), (ids, y), CE, modules="mix")) == ["mix.weight", "mix.bias"]
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    attention.in_proj_weight.requires_grad_(False)
    attention.in_proj_bias.requires_grad_(False)  # only out_proj, whose weight the parent reads itself
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"'out_proj.weight'.*nn.MultiheadAttention"):
        per_example_gradients(attention, ((x, x, x), y), lambda out, batch: out[0].sum((1, 2)))
