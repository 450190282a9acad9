"""interchange() against hand-written hooks on tiny HF Llama and GPT-2 (float64), and its bad input."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from attribution.causal import Interchange, LowRankSubspace, RotatedSubspace, Site, interchange
from tests.attribution.models import lm64

LLAMA = {
    "residual": ("model.layers.0", "output", None, 16),
    "attention": ("model.layers.1.self_attn", "output", None, 16),
    "head": ("model.layers.0.self_attn.o_proj", "input", (2,), 4),
    "neurons": ("model.layers.1.mlp.down_proj", "input", None, 24),
}
GPT2 = {
    "residual": ("transformer.h.0", "output", None, 16),
    "attention": ("transformer.h.1.attn", "output", None, 16),
    "head": ("transformer.h.0.attn.c_proj", "input", (1, 3), 8),
    "neurons": ("transformer.h.1.mlp.c_proj", "input", None, 64),
}


@functools.cache
def model_of(kind: str):
    """One tiny model per kind for the tests that leave it as found (the last tests check that they do)."""
    return lm64(kind)


def orthogonal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(seed))


def by_hand(model, base, sources, specs):
    """Raw hooks: record each site's source tensor, then rewrite the base's, one vector at a time (slow)."""
    modules = dict(model.named_modules())
    seen = {}

    def tensor_of(site, args, output):
        value = args[0] if site == "input" else output
        return value[0] if isinstance(value, tuple) else value

    handles = []
    for key, (name, site, *_rest) in specs.items():

        def keep(module, args, output=None, key=key, site=site):
            seen[key] = tensor_of(site, args, output).clone()

        m = modules[name]
        handles.append(m.register_forward_pre_hook(keep) if site == "input" else m.register_forward_hook(keep))
        with torch.no_grad():
            model(sources[key])
        handles.pop().remove()

    def rewrite(current, key):
        _name, _site, heads, positions, n_heads, fn = specs[key]
        new = current.clone()
        d = current.shape[-1] // n_heads if heads else current.shape[-1]
        for b, t in itertools.product(range(current.shape[0]), positions):
            cols = [h * d + i for h in heads for i in range(d)] if heads else list(range(current.shape[-1]))
            new[b, t, cols] = fn(current[b, t, cols], seen[key][b, t, cols])
        return new

    for key, (name, site, *_rest) in specs.items():
        if site == "input":
            hook = lambda m, args, key=key: (rewrite(args[0], key), *args[1:])  # noqa: E731
            handles.append(modules[name].register_forward_pre_hook(hook))
        else:

            def out_hook(m, args, output, key=key):
                if isinstance(output, tuple):
                    return (rewrite(output[0], key), *output[1:])
                return rewrite(output, key)

            handles.append(modules[name].register_forward_hook(out_hook))
    try:
        with torch.no_grad():
            return model(base).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("where", ["residual", "attention", "head", "neurons"])
def test_rotated_subspace_at_chosen_positions_equals_hand_written_hooks(kind, where):
    model = model_of(kind)
    name, site, heads, dim = (LLAMA if kind == "llama" else GPT2)[where]
    r = orthogonal(dim, 3)
    iv = RotatedSubspace(dim, 2).double()
    iv.rotation = r
    base, source = tokens(0), tokens(1)
    out = interchange(
        model,
        base,
        source,
        {Site(name, [1, 3], site=site, element=0 if where == "attention" else None, heads=heads): iv},
    ).logits

    def slow(b, s):  # R^T swap_2(R b, R s), written out
        rb, rs = r @ b, r @ s
        return r.T @ torch.cat([rs[:2], rb[2:]])

    expected = by_hand(model, base, {"x": source}, {"x": (name, site, heads, [1, 3], 4, slow)})
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    assert not torch.allclose(out, model(base).logits, atol=1e-4)  # the intervention did change something


def test_several_sites_in_different_layers_with_their_own_sources():
    model = model_of("llama")
    base, s1, s2 = tokens(0), tokens(1), tokens(2)
    low = LowRankSubspace(24, 3).double()
    low.rotation = orthogonal(24, 5)[:3]
    sites = {
        Site("model.layers.0", [4]): Interchange(),
        Site("model.layers.1.mlp.down_proj", [0, 2], site="input"): low,
    }
    out = interchange(model, base, dict(zip(sites, [s1, s2], strict=True)), sites).logits
    rk = low.rotation.detach()
    specs = {
        "a": ("model.layers.0", "output", None, [4], 4, lambda b, s: s),
        "b": ("model.layers.1.mlp.down_proj", "input", None, [0, 2], 4, lambda b, s: b + rk.T @ (rk @ s - rk @ b)),
    }
    torch.testing.assert_close(out, by_hand(model, base, {"a": s1, "b": s2}, specs), rtol=0, atol=1e-10)


def test_interchange_everywhere_with_the_source_equals_the_source_run_and_the_model_is_left_as_found():
    model = lm64("gpt2").train()
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)
    before = {n: (p.clone(), p.requires_grad) for n, p in model.named_parameters()}
    base, source = tokens(0), tokens(1)
    out = interchange(model, base, source, {Site("transformer.h.1"): Interchange()}).logits
    model.eval()
    torch.testing.assert_close(out, model(source).logits, rtol=0, atol=0)
    assert all(torch.equal(p, before[n][0]) and p.requires_grad == before[n][1] for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_k_zero_leaves_the_base_output():
    model = model_of("llama")
    iv = RotatedSubspace(16, 0).double()
    iv.rotation = orthogonal(16, 4)  # float64-orthogonal (the float32 initial R, widened, is only so to 1e-7)
    out = interchange(model, tokens(0), tokens(1), {Site("model.layers.0", [2]): iv}).logits
    torch.testing.assert_close(out, model(tokens(0)).logits, rtol=0, atol=1e-12)


def test_bad_input_is_named():
    model = lm64("llama")
    base = tokens(0)
    with pytest.raises(ValueError, match="match one module"):
        interchange(model, base, base, {Site("model.layers.*"): Interchange()})
    with pytest.raises(KeyError, match=r"did you mean"):
        interchange(model, base, base, {Site("model.layer.0"): Interchange()})
    with pytest.raises(ValueError, match="build it with dim=16"):
        interchange(model, base, base, {Site("model.layers.0"): RotatedSubspace(8, 2).double()})
    with pytest.raises(
        ValueError, match=r"source for Site\(module='model.layers.0'.*same shapes; got \(2, 5\) and \(2, 4\)"
    ):
        interchange(model, base, tokens(1)[:, :4], {Site("model.layers.0"): Interchange()})
    with pytest.raises(ValueError, match=r"same shapes; got \(2, 5\) and \(1, 5\)"):
        interchange(model, base, tokens(1)[:1], {Site("model.layers.0"): Interchange()})
    with pytest.raises(TypeError, match=r"mixes Site keys with \['input_ids'\]"):
        interchange(
            model, base, {Site("model.layers.0"): base, "input_ids": base}, {Site("model.layers.0"): Interchange()}
        )
    with pytest.raises(ValueError, match="holds heads"):
        interchange(model, base, base, {Site("model.layers.0", heads=[1]): Interchange()})
    with pytest.raises(TypeError, match="must be a Site"):
        interchange(model, base, base, {"model.layers.0": Interchange()})
    with pytest.raises(KeyError, match="no input for"):
        interchange(model, base, {Site("model.layers.0"): base}, {Site("model.layers.1"): Interchange()})
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
