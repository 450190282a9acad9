"""splice: the error term's exact semantics, features and error as sites of the model, the model left as found."""

from __future__ import annotations

import pytest
import torch

from attribution import SAE, Patch, Transcoder, activation_patching, attribution_patching, patch, record, splice
from tests.attribution.models import lm64
from tests.support import hook_state

SITE = "model.layers.0.mlp"
FEATURES, ERROR = f"{SITE}.dictionary.features", f"{SITE}.dictionary.error"


@pytest.fixture(scope="module")
def model():
    return lm64("llama")


def tokens(seed):
    return torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(seed))


def sae64(kind="topk", seed=0):
    torch.manual_seed(seed)
    sae = SAE(16, 48, activation=kind, k=6).double()
    with torch.no_grad():
        sae.b_dec.normal_()
        sae.b_enc.normal_(std=0.1)
    return sae


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def replaced(model, ids, fn, module=SITE):
    """A hand re-run: the module's output replaced by fn(module, input, output) through a plain PyTorch hook."""
    handle = model.get_submodule(module).register_forward_hook(lambda m, args, out: fn(args[0], out))
    try:
        return logits(model, ids)
    finally:
        handle.remove()


def snapshot(model):
    return (
        hook_state(model),
        [name for name, _ in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        dict(model.get_submodule(SITE).__dict__),
    )


def assert_as_found(model, before):
    hooks, names, state, attributes = before
    assert hook_state(model) == hooks and [n for n, _ in model.named_modules()] == names
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.get_submodule(SITE).__dict__.keys() == attributes.keys()
    assert model.get_submodule(SITE)._modules == attributes["_modules"]


@pytest.mark.parametrize("kind", ["relu", "topk", "jumprelu", "batchtopk"])
def test_error_term_leaves_the_logits_bitwise_unchanged(model, kind):
    ids = tokens(0)
    with splice(model, {SITE: sae64(kind)}):
        spliced = logits(model, ids)
    assert torch.equal(spliced, logits(model, ids))


def test_error_false_equals_a_hand_rerun_with_the_reconstruction(model):
    ids, sae = tokens(1), sae64()
    with splice(model, {SITE: sae}, error=False):
        spliced = logits(model, ids)
    hand = replaced(model, ids, lambda _, out: sae(out))
    torch.testing.assert_close(spliced, hand, rtol=0, atol=1e-12)
    assert not torch.allclose(spliced, logits(model, ids), atol=1e-3)  # the reconstruction is not the activation


def test_transcoder_predicts_the_mlp_output_from_its_input(model):
    ids = tokens(2)
    torch.manual_seed(3)
    tc = Transcoder(16, 16, 40, activation="relu", skip=True).double()
    with torch.no_grad():
        tc.W_skip.normal_(std=0.1)
    with splice(model, {SITE: tc}, error=False):
        spliced = logits(model, ids)
    torch.testing.assert_close(spliced, replaced(model, ids, lambda inp, _: tc(inp)), rtol=0, atol=1e-12)
    with splice(model, {SITE: tc}):
        assert torch.equal(logits(model, ids), logits(model, ids))


def test_recorded_features_and_error_are_encode_and_x_minus_reconstruction(model):
    ids, sae = tokens(4), sae64()
    with splice(model, {SITE: sae}), record(model, [SITE, FEATURES, ERROR]) as acts, torch.no_grad():
        model(ids)
    x = acts[SITE]
    assert torch.equal(acts[FEATURES], sae.encode(x)) and acts[FEATURES].shape == (2, 5, 48)
    torch.testing.assert_close(acts[ERROR], x - sae(x), rtol=0, atol=0)


def test_patched_features_give_the_patched_reconstruction_plus_the_unpatched_error(model):
    ids, sae = tokens(5), sae64()
    with splice(model, {SITE: sae}), record(model, FEATURES) as acts, torch.no_grad():
        model(ids)
    f = acts[FEATURES].clone()
    f[:, 2, :] = 0.5  # every feature of position 2 set by hand
    with splice(model, {SITE: sae}), patch(model, {FEATURES: Patch(f, index=(slice(None), 2))}):
        spliced = logits(model, ids)
    hand = replaced(model, ids, lambda _, x: sae.decode(f) + (x - sae(x)))
    torch.testing.assert_close(spliced, hand, rtol=0, atol=1e-12)
    new_error = torch.ones(2, 5, 16, dtype=torch.float64)
    with splice(model, {SITE: sae}), patch(model, {ERROR: new_error}):
        spliced = logits(model, ids)
    torch.testing.assert_close(spliced, replaced(model, ids, lambda _, x: sae(x) + new_error), rtol=0, atol=1e-12)


def test_attribution_patching_on_features_is_the_hand_gradient_times_delta(model):
    clean, corrupted, sae = tokens(6), tokens(7), sae64()

    def metric(out):
        return out.logits[:, -1, 3].sum() - out.logits[:, -1, 5].sum()

    with splice(model, {SITE: sae}):
        estimate = attribution_patching(model, clean, corrupted, FEATURES, metric, progress=False)
    with torch.no_grad(), splice(model, {SITE: sae}), record(model, FEATURES) as acts:
        model(clean)
    f_clean = acts[FEATURES]
    leaf = {}

    def through_features(_, x):  # the splice written out: x + decode(f) - decode(f), f a leaf
        f = sae.encode(x).detach().requires_grad_(True)
        leaf["f"] = f
        return x.detach() + (sae.decode(f) - sae.decode(f).detach())

    handle = model.get_submodule(SITE).register_forward_hook(lambda m, a, out: through_features(a[0], out))
    try:
        value = metric(model(corrupted))
        (grad,) = torch.autograd.grad(value, [leaf["f"]])
    finally:
        handle.remove()
    hand = value.detach() + ((f_clean - leaf["f"].detach()) * grad).sum(dim=(0, 2))
    assert estimate.shape == (1, 5)
    torch.testing.assert_close(estimate[0].double(), hand, rtol=1e-6, atol=1e-6)  # the result is float32
    assert all(p.grad is None for p in sae.parameters())


def test_activation_patching_takes_features_as_layers(model):
    clean, corrupted, sae = tokens(8), tokens(9), sae64()

    def metric(out):
        return out.logits[:, -1, 3].sum()

    with splice(model, {SITE: sae}):
        exact = activation_patching(model, clean, corrupted, [FEATURES, ERROR], metric, progress=False)
        with torch.no_grad(), record(model, [FEATURES, ERROR]) as acts:
            model(clean)
        with patch(model, {FEATURES: Patch(acts[FEATURES], index=(slice(None), 3))}), torch.no_grad():
            by_hand = metric(model(corrupted))
    assert exact.shape == (2, 5)
    torch.testing.assert_close(exact[0, 3].double(), by_hand, rtol=1e-6, atol=1e-6)


def test_the_model_is_left_exactly_as_found_also_when_the_body_raises(model):
    before = snapshot(model)
    with splice(model, {SITE: sae64()}):
        assert isinstance(model.get_submodule(FEATURES), torch.nn.Identity)
        logits(model, tokens(0))
    assert_as_found(model, before)
    with pytest.raises(RuntimeError, match="inside"), splice(model, {SITE: sae64()}):
        raise RuntimeError("inside")
    assert_as_found(model, before)
    assert not hasattr(model.get_submodule(SITE), "dictionary")


def test_bad_sites_are_refused_with_what_came(model):
    with pytest.raises(ValueError, match=r"d_in=8, but the site's activation has shape \(2, 5, 16\) \(width 16\)"):
        with splice(model, {SITE: SAE(8, 16).double()}):
            logits(model, tokens(0))
    with (
        pytest.raises(TypeError, match="it is a tuple: pass element="),
        splice(model, {"model.layers.0.self_attn": sae64()}),
    ):
        logits(model, tokens(0))
    with splice(model, {"model.layers.0.self_attn": sae64()}, element=0):
        assert torch.equal(logits(model, tokens(0)), logits(model, tokens(0)))
    with pytest.raises(ValueError, match="already has a 'dictionary'"), splice(model, {SITE: sae64()}):
        with splice(model, {SITE: sae64()}):
            pass
    with pytest.raises(KeyError, match="did you mean"), splice(model, {"model.layers.0.mpl": sae64()}):
        pass
    with pytest.raises(TypeError, match="must be an SAE or a Transcoder"), splice(model, {SITE: torch.nn.Linear(2, 2)}):
        pass
    assert not hasattr(model.get_submodule(SITE), "dictionary")


def test_a_float32_dictionary_on_a_float64_model_keeps_the_model_dtype(model):
    ids = tokens(0)
    with splice(model, {SITE: SAE(16, 32, k=4)}):
        out = logits(model, ids)
    assert out.dtype == torch.float64 and torch.equal(out, logits(model, ids))


def embedding_gradient(model, ids, hook=None):
    """Logits and d(logits . w)/d(embedding weight) of one run with autograd on, ``hook`` replacing the output."""
    handle = model.get_submodule(SITE).register_forward_hook(hook) if hook is not None else None
    try:
        out = model(ids).logits
        w = torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)
        (grad,) = torch.autograd.grad((out * w).sum(), model.model.embed_tokens.weight)
    finally:
        if handle is not None:
            handle.remove()
    return out.detach(), grad


def test_with_autograd_the_value_is_still_bitwise_and_gradients_flow_through_the_reconstruction(model):
    ids, sae = tokens(10), sae64()
    with record(model, SITE) as plain_site:
        plain_out, plain_grad = embedding_gradient(model, ids)
    with splice(model, {SITE: sae}), record(model, SITE) as site:  # recorded after the splice's hook
        out, grad = embedding_gradient(model, ids)
    # the error term keeps the value bitwise, also when a graph is recorded (r + (x - r) would not be x)
    assert torch.equal(site[SITE], plain_site[SITE]) and torch.equal(out, plain_out)

    def hand(m, a, x):  # the gradient goes through sae(x), never through the error x - sae(x)
        return x.detach() + (sae(x) - sae(x).detach())

    torch.testing.assert_close(grad, embedding_gradient(model, ids, hand)[1], rtol=1e-9, atol=1e-12)
    assert not torch.allclose(grad, plain_grad, atol=1e-6)
    constant = torch.full((2, 5, 16), 0.25, dtype=torch.float64)
    with splice(model, {SITE: sae}), patch(model, {ERROR: constant}):
        out, grad = embedding_gradient(model, ids)

    def hand_patched(m, a, x):  # reconstruction (differentiable) plus the constant error
        return x.detach() + (sae(x) - sae(x).detach()) + (constant - (x - sae(x)).detach())

    hand_out, hand_grad = embedding_gradient(model, ids, hand_patched)
    torch.testing.assert_close(out, hand_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, hand_grad, rtol=1e-9, atol=1e-12)
