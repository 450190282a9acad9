"""Attribution patching: a by-hand AtP with plain hooks, TransformerLens' node scores, exactness where the model is
linear in the site, rank agreement with exact patching, integrated gradients, and the model left as found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import activation_patching, attribution_patching
from attribution.patching._sweep import cell_sums
from tests.attribution.models import tiny_gpt, tiny_llama
from tests.support import DATA, hook_state


@pytest.fixture(scope="module")
def gpt64():
    """The reference transformer in float64 (formulas are compared there), with a mean logit-difference metric."""
    model, ref = tiny_gpt()
    model = model.double()
    answers = ref["answer_tokens"]
    rows = torch.arange(len(answers))

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:
        return logits[rows, -1, answers[:, 0]] - logits[rows, -1, answers[:, 1]]

    logit_diff.answers = answers
    return model, ref["clean_tokens"], ref["corrupted_tokens"], logit_diff


def mean_of(per_example):
    return lambda out: per_example(out).mean()


def by_hand(model, source, target, module, metric, *, input_site=False, element=None, heads=None):
    """AtP with raw PyTorch hooks, one layer: record ``a_source``; run ``target`` with the site replaced by a leaf;
    ``metric(target) + sum (a_source - a_target) * grad`` per (position[, head]), summed over the batch."""
    pick = (lambda v: v) if element is None else (lambda v: v[element])
    cache = {}

    def keep(*args):
        cache["a"] = pick(args[1][0] if input_site else args[2]).detach().clone()

    handle = module.register_forward_pre_hook(keep) if input_site else module.register_forward_hook(keep)
    with torch.no_grad():
        run(model, source)
    handle.remove()

    def swap_input(module, args):
        cache["leaf"] = args[0].detach().requires_grad_(True)
        return (cache["leaf"] * 1, *args[1:])

    def swap_output(module, args, output):
        cache["leaf"] = pick(output).detach().requires_grad_(True)
        return (cache["leaf"] * 1, *output[1:]) if element is not None else cache["leaf"] * 1

    handle = module.register_forward_pre_hook(swap_input) if input_site else module.register_forward_hook(swap_output)
    try:
        value = metric(run(model, target))
        (grad,) = torch.autograd.grad(value, cache["leaf"])
    finally:
        handle.remove()
    product = (cache["a"] - cache["leaf"].detach()) * grad  # (batch, positions, d)
    if heads:
        b, t, d = product.shape
        return value.item() + product.view(b, t, heads, d // heads).sum((0, 3))
    return value.item() + product.sum((0, 2))


def run(model, inputs):
    """``model(**inputs)`` for keyword inputs, else ``model(inputs)``."""
    return model(**inputs) if isinstance(inputs, dict) or hasattr(inputs, "keys") else model(inputs)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks from 0, tied values sharing their mean rank (cells a patch does not change are tied)."""
    _, inverse, counts = torch.unique(x.flatten(), return_inverse=True, return_counts=True)
    ends = counts.cumsum(0)
    return ((ends - counts + ends - 1) / 2).double()[inverse]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation: Pearson's of the ranks."""
    return float(torch.corrcoef(torch.stack([ranks(a), ranks(b)]))[0, 1])


# -- parity ------------------------------------------------------------------------------------------------------
def test_equals_a_by_hand_atp_with_plain_hooks(gpt64):
    model, clean, corrupted, logit_diff = gpt64
    metric = mean_of(logit_diff)
    cases = [
        ("layers.?", {"site": "input"}, lambda i: model.layers[i], {"input_site": True}),
        ("layers.*.mlp", {}, lambda i: model.layers[i].mlp, {}),
        ("layers.*.attn", {"element": 0}, lambda i: model.layers[i].attn, {"element": 0}),
        ("layers.*.attn.o", {"site": "input", "heads": 4}, lambda i: model.layers[i].attn.o, {"input_site": True}),
    ]
    for layers, kwargs, module, hand_kwargs in cases:
        ours = attribution_patching(model, clean, corrupted, layers, metric, **kwargs)
        heads = kwargs.get("heads")
        expected = torch.stack([by_hand(model, clean, corrupted, module(i), metric, heads=heads, **hand_kwargs)
                                for i in range(2)])  # fmt: skip
        torch.testing.assert_close(ours, expected.float(), rtol=0, atol=1e-5)
        assert (ours - expected.float()).abs().max() < 1e-6  # float64 model: only the float32 result rounds


def test_noising_per_example_and_normalised_follow_the_same_formula(gpt64):
    model, clean, corrupted, logit_diff = gpt64
    metric = mean_of(logit_diff)
    module = model.layers[1]
    noised = attribution_patching(model, clean, corrupted, "layers.1", metric, site="input", direction="noise")
    expected = by_hand(model, corrupted, clean, module, metric, input_site=True)
    torch.testing.assert_close(noised[0], expected.float(), rtol=0, atol=1e-6)

    per_example = attribution_patching(model, clean, corrupted, "layers.1", logit_diff, site="input", per_example=True)
    assert per_example.shape == (1, 8, 4)
    for b, (right, wrong) in enumerate(logit_diff.answers.tolist()):  # each example alone: items do not interact

        def one_metric(logits, r=right, w=wrong):
            return logits[0, -1, r] - logits[0, -1, w]

        one = by_hand(model, clean[b : b + 1], corrupted[b : b + 1], module, one_metric, input_site=True)
        torch.testing.assert_close(per_example[0, :, b], one.float(), rtol=0, atol=1e-6)

    normalized = attribution_patching(model, clean, corrupted, "layers.1", metric, site="input", normalize=True)
    with torch.no_grad():
        m_clean, m_corrupted = metric(model(clean)).item(), metric(model(corrupted)).item()
    raw = attribution_patching(model, clean, corrupted, "layers.1", metric, site="input")
    torch.testing.assert_close(normalized, (raw - m_corrupted) / (m_clean - m_corrupted), rtol=0, atol=1e-5)


def transformer_lens_metric(answer: torch.Tensor):
    a, b = (int(t) for t in answer)
    return lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()


def check_transformer_lens(reference: dict) -> None:
    """Our estimates minus the corrupted metric are TransformerLens' node scores (mean over the batch of per-example
    ``(a_clean - a_corrupt) . grad``): embedding, per-head outputs by position, MLP outputs."""
    model, ref = tiny_gpt()
    clean, corrupted = ref["clean_tokens"], ref["corrupted_tokens"]
    metric = transformer_lens_metric(reference["answer"])
    with torch.no_grad():
        base = metric(model(corrupted)).item()
    heads = {"site": "input", "heads": 4}
    ours = {
        "embed": attribution_patching(model, clean, corrupted, "tok_embed", metric)[0],
        "attn_head_out": attribution_patching(model, clean, corrupted, "layers.*.attn.o", metric, **heads),
        "mlp_out": attribution_patching(model, clean, corrupted, "layers.*.mlp", metric),
    }
    for key, value in ours.items():
        # float32 on both sides; scores are below 0.2, differences seen: ~1e-8
        torch.testing.assert_close(value - base, reference[key], rtol=0, atol=1e-6, msg=key)


def test_equals_transformer_lens_node_scores_stored():
    check_transformer_lens(torch.load(DATA / "patching" / "atp_reference.pt", weights_only=True))


@pytest.mark.slow
@pytest.mark.peers
def test_equals_transformer_lens_node_scores_live():
    pytest.importorskip("transformer_lens")
    from tests.data.patching.make_atp_reference import transformer_lens_scores

    check_transformer_lens(transformer_lens_scores())


# -- how good the estimate is ------------------------------------------------------------------------------------
def test_exact_where_the_model_is_linear_in_the_site(gpt64):
    model, clean, corrupted, logit_diff = gpt64
    metric = mean_of(logit_diff)
    # the logits are linear in the input of the unembedding: the first-order estimate is the patched metric
    estimate = attribution_patching(model, clean, corrupted, "head", metric, site="input")
    exact = activation_patching(model, clean, corrupted, "head", metric, site="input", progress=False)
    torch.testing.assert_close(estimate, exact, rtol=0, atol=1e-6)
    # one step earlier, a LayerNorm sits in between: no longer exact
    before_norm = attribution_patching(model, clean, corrupted, "ln_out", metric, site="input")
    exact = activation_patching(model, clean, corrupted, "ln_out", metric, site="input", progress=False)
    assert (before_norm - exact).abs().max() > 1e-3


def test_a_module_called_twice_is_linearised_with_its_calls_held_apart():
    """Patching a module patches all its calls; in this linear model the estimate is exact only if each call's
    gradient holds the other call fixed (a shared backward would add the path through the second call)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            x = x + self.block(x)
            x = x + self.block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Twice().double().eval()
    clean, corrupted = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    metric = lambda out: out[:, -1].sum()  # noqa: E731
    for kwargs in ({"site": "output"}, {"site": "input"}):
        exact = activation_patching(model, clean, corrupted, ["block", "head"], metric, progress=False, **kwargs)
        estimate = attribution_patching(model, clean, corrupted, ["block", "head"], metric, **kwargs)
        torch.testing.assert_close(estimate, exact, rtol=0, atol=1e-6)


def test_rank_agreement_with_exact_patching(gpt64):
    """Near-linear sites rank cells as exact patching does (Spearman, reported in docs/methods/patching.rst)."""
    model, clean, corrupted, logit_diff = gpt64
    metric = mean_of(logit_diff)
    seen = {}
    for layers, kwargs in [
        ("layers.?", {"site": "input"}),
        ("layers.*.mlp", {}),
        ("layers.*.attn", {"element": 0}),
        ("layers.*.attn.o", {"site": "input", "heads": 4}),
    ]:
        estimate = attribution_patching(model, clean, corrupted, layers, metric, **kwargs)
        exact = activation_patching(model, clean, corrupted, layers, metric, progress=False, **kwargs)
        seen[layers] = spearman(estimate, exact)
    assert min(seen.values()) > 0.9, seen  # measured: 0.974, 0.987, 0.990, 0.922


def test_more_integrated_gradient_steps_move_toward_exact(gpt64):
    model, clean, corrupted, logit_diff = gpt64
    metric = mean_of(logit_diff)
    for layers, kwargs in [("layers.*.mlp", {}), ("layers.1", {"site": "input"})]:
        # a whole site per cell: the path integral tends to the exact patching result, the error like 1/k
        exact = activation_patching(model, clean, corrupted, layers, metric, positions=False, progress=False, **kwargs)
        errors = [
            (attribution_patching(model, clean, corrupted, layers, metric, positions=False, ig_steps=k, progress=False,
                                  **kwargs) - exact).abs().max().item()
            for k in (1, 2, 4, 16)
        ]  # fmt: skip
        assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 8, errors
    # per position the others move along too: closer, not exact (max error 0.070 -> 0.022 with 2 steps)
    exact = activation_patching(model, clean, corrupted, "layers.?", metric, site="input", progress=False)
    plain, ig = (
        attribution_patching(model, clean, corrupted, "layers.?", metric, site="input", ig_steps=k, progress=False)
        for k in (1, 2)
    )
    assert (ig - exact).abs().max() < (plain - exact).abs().max() / 2


def test_integrated_gradients_by_hand():
    """k = 3 on a one-layer model: the mean of the gradients at a_t, a_t + d/3, a_t + 2d/3, dotted with d."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    clean, corrupted = torch.randn(1, 2, 3, dtype=torch.float64), torch.randn(1, 2, 3, dtype=torch.float64)
    metric = lambda out: out.sum()  # noqa: E731
    a_s, a_t = model[0](clean).detach(), model[0](corrupted).detach()
    grads = []
    for j in range(3):
        point = (a_t + j / 3 * (a_s - a_t)).requires_grad_(True)
        (g,) = torch.autograd.grad(metric(model[2](model[1](point))), point)
        grads.append(g)
    expected = metric(model(corrupted)).item() + ((a_s - a_t) * torch.stack(grads).mean(0)).sum((0, 2))
    ours = attribution_patching(model, clean, corrupted, "0", metric, ig_steps=3, progress=False)
    torch.testing.assert_close(ours[0], expected.float(), rtol=0, atol=1e-6)


# -- any module, and the model as found ---------------------------------------------------------------------------
def test_graph_starts_at_the_first_site_and_the_model_is_left_as_found(gpt64):
    model, clean, corrupted, logit_diff = gpt64
    with torch.no_grad():
        expected = model(clean)
    frozen, graded = model.layers[0].mlp.fc_in.weight, model.layers[1].mlp.fc_out.weight
    frozen.requires_grad_(False)  # a mix of frozen and trainable parameters, one with a .grad
    graded.grad = torch.ones_like(graded)
    model.layers[0].train()  # a mix of train and eval flags
    flags = {name: m.training for name, m in model.named_modules()}
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    before = hook_state(model)
    seen = []
    handle = model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out.requires_grad))
    try:
        attribution_patching(model, clean, corrupted, "layers.1.mlp", mean_of(logit_diff))
        handle.remove()
        assert seen == [False, False]  # before the site: no graph, in either run
        assert hook_state(model) == before
        assert {name: m.training for name, m in model.named_modules()} == flags
        assert {name: p.requires_grad for name, p in model.named_parameters()} == trainable
        assert torch.equal(graded.grad, torch.ones_like(graded))
        assert all(p.grad is None for p in model.parameters() if p is not graded)
        assert torch.is_grad_enabled()
    finally:
        handle.remove()
        frozen.requires_grad_(True)
        graded.grad = None
        model.eval()
    with torch.no_grad():
        assert torch.equal(model(clean), expected)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_left_as_found_when_the_metric_raises(gpt64, error):
    model, clean, corrupted, logit_diff = gpt64
    before = hook_state(model)
    calls = []

    def metric(logits):
        calls.append(1)
        if len(calls) == 2:  # in the run with autograd
            raise error("stop")
        return logit_diff(logits).mean()

    with torch.no_grad():
        with pytest.raises(error):
            attribution_patching(model, clean, corrupted, "layers.*", metric, site="input")
        assert not torch.is_grad_enabled()
    assert len(calls) == 2
    assert hook_state(model) == before
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())


def test_grad_mode_and_inference_mode_callers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1)).eval()
    clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    metric = lambda out: out.sum()  # noqa: E731
    with torch.no_grad():
        quiet = attribution_patching(model, clean, corrupted, "0", metric)
        assert not torch.is_grad_enabled()
    with torch.inference_mode():
        inferred = attribution_patching(model, clean, corrupted, "0", metric)
        assert torch.is_inference_mode_enabled()
        made_here = clean.clone(), corrupted.clone()  # inference tensors
        inference_inputs = attribution_patching(model, *made_here, "0", metric)
    loud = attribution_patching(model, clean, corrupted, "0", metric)
    assert torch.equal(quiet, loud) and torch.equal(inferred, loud) and torch.equal(inference_inputs, loud)


def test_in_place_relu_after_the_site_and_a_cnn():
    """VGG's in-place ReLU right after the site must not change the activation we differentiate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 25, 2))
    model = model.double().eval()
    clean, corrupted = torch.randn(2, 3, 5, 5, dtype=torch.float64), torch.randn(2, 3, 5, 5, dtype=torch.float64)
    metric = lambda out: out[:, 0].sum()  # noqa: E731
    estimate = attribution_patching(model, clean, corrupted, ["0", "1"], metric)  # positions = channels
    assert estimate.shape == (2, 4)
    # after the ReLU the model is linear: exact; before it, the ReLU's kink makes it approximate
    exact = activation_patching(model, clean, corrupted, ["0", "1"], metric, progress=False)
    torch.testing.assert_close(estimate[1], exact[1], rtol=0, atol=1e-6)
    a_clean, a_corrupted = model[0](clean).detach(), model[0](corrupted).detach()
    relu_grad = (a_corrupted > 0).double()
    w = model[3].weight[0].detach().view(4, 5, 5)
    expected = metric(model(corrupted)).item() + ((a_clean - a_corrupted) * relu_grad * w).sum((0, 2, 3))
    torch.testing.assert_close(estimate[0], expected.float(), rtol=0, atol=1e-6)


def test_an_in_place_change_of_the_site_tensor_later_in_the_forward():
    """The parent changes the tensor it passed to the site module in place afterwards: our copy must not change."""

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.head = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            x = x + 0
            h = self.lin(x)
            x.mul_(2)  # the input of `lin`, changed after `lin` ran
            return self.head(h) + x.sum(-1, keepdim=True)

    torch.manual_seed(0)
    model = Parent().double()
    clean, corrupted = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    metric = lambda out: out.sum()  # noqa: E731
    kwargs = {"site": "input", "positions": False}
    exact = activation_patching(model, clean, corrupted, "lin", metric, progress=False, **kwargs)
    torch.testing.assert_close(attribution_patching(model, clean, corrupted, "lin", metric, **kwargs), exact)


def test_a_huggingface_model_with_a_batch_encoding_and_keyword_sites():
    transformers = pytest.importorskip("transformers")
    model = tiny_llama().double()
    ids = torch.randint(0, 50, (2, 6))
    changed = ids.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 50
    clean = transformers.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})  # as it comes
    corrupted = transformers.BatchEncoding({"input_ids": changed, "attention_mask": torch.ones_like(ids)})
    metric = lambda out: (out.logits[:, -1, 3] - out.logits[:, -1, 4]).mean()  # noqa: E731
    before = hook_state(model)
    heads = attribution_patching(model, clean, corrupted, "model.layers.*.self_attn.o_proj", metric, site="input",
                                 heads=4)  # fmt: skip
    assert heads.shape == (2, 6, 4) and torch.isfinite(heads).all()
    assert torch.equal(heads[:, :2], torch.full_like(heads[:, :2], heads[0, 0, 0].item()))  # before the change: 0
    as_dict = attribution_patching(model, dict(clean), dict(corrupted), "model.layers.*.self_attn.o_proj", metric,
                                   site="input", heads=4)  # fmt: skip
    assert torch.equal(heads, as_dict)
    # self_attn is called with hidden_states= only: its input site is that keyword argument, the input norm's output
    by_keyword = attribution_patching(model, clean, corrupted, "model.layers.*.self_attn", metric, site="input")
    by_name = attribution_patching(model, clean, corrupted, "model.layers.*.self_attn", metric, site="input",
                                   element="hidden_states")  # fmt: skip
    norm_out = attribution_patching(model, clean, corrupted, "model.layers.*.input_layernorm", metric)
    assert torch.equal(by_keyword, by_name)
    torch.testing.assert_close(by_keyword, norm_out, rtol=0, atol=1e-6)
    # the attention's output is a tuple (output, weights): element 0, compared with a by-hand AtP
    attn = attribution_patching(model, clean, corrupted, "model.layers.1.self_attn", metric, element=0)
    expected = by_hand(model, clean, corrupted, model.model.layers[1].self_attn, metric, element=0)
    torch.testing.assert_close(attn[0], expected.float(), rtol=0, atol=1e-6)
    exact = activation_patching(model, clean, corrupted, "lm_head", metric, site="input", progress=False)
    torch.testing.assert_close(
        attribution_patching(model, clean, corrupted, "lm_head", metric, site="input"), exact, rtol=0, atol=1e-6
    )
    assert hook_state(model) == before and all(p.requires_grad for p in model.parameters())


def test_a_compiled_model_runs_eagerly_with_the_same_result():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).eval()
    clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    metric = lambda out: out[:, -1].mean()  # noqa: E731
    expected = attribution_patching(model, clean, corrupted, ["0", "1"], metric)
    compiled = torch.compile(model, backend="eager")
    compiled(clean)  # compiled before our hooks exist
    torch.testing.assert_close(attribution_patching(compiled, clean, corrupted, ["0", "1"], metric), expected)


# -- errors and warnings ------------------------------------------------------------------------------------------
def test_errors_and_the_no_gradient_warning(gpt64):
    model, clean, corrupted, logit_diff = gpt64
    metric = mean_of(logit_diff)
    with pytest.raises(ValueError, match="`ig_steps` must be an int of at least 1"):
        attribution_patching(model, clean, corrupted, "layers.0", metric, ig_steps=0)
    with pytest.raises(ValueError, match="`direction` must be 'denoise' or 'noise'"):
        attribution_patching(model, clean, corrupted, "layers.0", metric, direction="up")
    with pytest.raises(ValueError, match=r"same shapes; got \(4, 8\) and \(4, 7\)"):
        attribution_patching(model, clean, corrupted[:, :7], "layers.0", metric)
    with pytest.raises(ValueError, match="`metric` returned a tensor without a gradient"):
        attribution_patching(model, clean, corrupted, "layers.0", lambda out: out.argmax(-1).double().mean())
    with pytest.raises(TypeError, match="must be floating point"):
        attribution_patching(model, clean, corrupted, "tok_embed", metric, site="input")
    with pytest.raises(ValueError, match=r"must return a scalar tensor; got \(4,\) \(pass per_example=True\?\)"):
        attribution_patching(model, clean, corrupted, "layers.0", logit_diff)
    with pytest.raises(ValueError, match=r"does not depend on any of `layers` \('layers\.0\.attn'\)"):
        attribution_patching(model, clean, corrupted, "layers.0.attn", metric, element=1)  # the unused pattern


def test_a_layer_the_metric_does_not_reach_gets_a_warning():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x):
            self.unused(x)  # computed, never used
            return self.used(x)

    torch.manual_seed(0)
    model = Branchy()
    clean, corrupted = torch.randn(2, 3), torch.randn(2, 3)
    metric = lambda out: out.sum()  # noqa: E731
    with pytest.warns(UserWarning, match="'unused' got no gradient: `metric` does not depend on its output"):
        result = attribution_patching(model, clean, corrupted, ["used", "unused"], metric, positions=False)
    with torch.no_grad():
        assert result[1].item() == metric(model(corrupted)).item() != result[0].item()


def test_cell_sums_keeps_the_cell_axes():
    product = torch.arange(2 * 3 * 4, dtype=torch.float64).view(2, 3, 4)
    torch.testing.assert_close(cell_sums(product, True, None, "", per_example=True), product.sum(-1).T)
    torch.testing.assert_close(cell_sums(product, [2, -3], None, "", per_example=False), product.sum((0, 2))[[2, 0]])
    torch.testing.assert_close(cell_sums(product, False, None, "", per_example=False), product.sum())
    by_head = cell_sums(product, False, 2, "b t (h d) -> b h t d", per_example=False)
    torch.testing.assert_close(by_head, product.view(2, 3, 2, 2).sum((0, 1, 3)))
