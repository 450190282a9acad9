"""Logit lens and direct logit attribution against hand computations, in float64, on tiny random HF models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution.lens import direct_logit_attribution, logit_lens, plot_direct_logit_attribution, plot_logit_lens
from tests.attribution.models import tiny_llama
from tests.support import hook_state

IDS = torch.tensor([[3, 17, 5, 42, 8, 1, 29], [11, 2, 40, 7, 33, 19, 4]])


def _randomise(model: nn.Module) -> nn.Module:
    """Random values for every parameter (HF initialises biases to 0 and norm weights to 1, which hides bugs)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.3)
    return model


def llama() -> nn.Module:
    return _randomise(tiny_llama(num_hidden_layers=3).double())


def gpt2(unembedding_bias: bool = True) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=3, n_head=4, n_positions=16, bos_token_id=0,
                                     eos_token_id=0, tie_word_embeddings=False)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    if unembedding_bias:
        model.lm_head = nn.Linear(32, 50, bias=True)
    return _randomise(model.double())


MODELS = {"llama": llama, "gpt2": gpt2}


def _captured(model: nn.Module, ids: torch.Tensor, names: list[str], inputs: bool) -> dict[str, torch.Tensor]:
    """The inputs (or outputs) of named modules, by raw hooks (the test's own, independent of the library)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)
        if inputs:
            handles.append(module.register_forward_pre_hook(lambda m, a, k, n=name: seen.__setitem__(n, (a or
                           tuple(k.values()))[0]), with_kwargs=True))  # fmt: skip
        else:
            handles.append(module.register_forward_hook(lambda m, a, o, n=name: seen.__setitem__(n, o)))
    with torch.no_grad():
        seen["logits"] = model(ids).logits
    for h in handles:
        h.remove()
    return seen


def _layout(kind: str, layers: int) -> dict[str, list[str] | str]:
    if kind == "llama":
        return {"layers": [f"model.layers.{i}" for i in range(layers)], "o": [f"model.layers.{i}.self_attn.o_proj"
                for i in range(layers)], "norm": "model.norm", "head": "lm_head"}  # fmt: skip
    return {"layers": [f"transformer.h.{i}" for i in range(layers)], "o": [f"transformer.h.{i}.attn.c_proj"
            for i in range(layers)], "norm": "transformer.ln_f", "head": "lm_head"}  # fmt: skip


# -- logit lens ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MODELS)
def test_lens_last_layer_is_the_logits_exactly(kind):
    model = MODELS[kind]()
    lens = logit_lens(model, IDS)
    assert lens.shape == (3, 2, 7, 50)
    assert torch.equal(lens[-1], model(IDS).logits)


@pytest.mark.parametrize("kind", MODELS)
def test_lens_entries_are_the_norm_and_unembedding_of_each_layer_output(kind):
    model = MODELS[kind]()
    layout = _layout(kind, 3)
    outputs = _captured(model, IDS, layout["layers"], inputs=False)
    norm, head = model.get_submodule(layout["norm"]), model.get_submodule(layout["head"])
    lens = logit_lens(model, IDS, layers=[-2, 0])  # entries in the order asked
    with torch.no_grad():
        for entry, layer in zip(lens, [1, 0], strict=True):
            assert torch.equal(entry, head(norm(outputs[layout["layers"][layer]])))


def test_lens_of_one_sequence_gets_a_batch_axis():
    model = llama()
    assert torch.equal(logit_lens(model, IDS[1]), logit_lens(model, IDS[1:]))


# -- direct logit attribution ---------------------------------------------------------------------------------------
def _reference_logit(model, kind, ids, direction, position):
    """The logit along ``direction`` computed by hand from the final norm's input, in float64."""
    layout = _layout(kind, 3)
    x = _captured(model, ids, [layout["norm"]], inputs=True)[layout["norm"]][:, position]
    norm, head = model.get_submodule(layout["norm"]), model.get_submodule(layout["head"])
    if kind == "llama":
        y = norm.weight * x / torch.sqrt((x**2).mean(-1, keepdim=True) + norm.variance_epsilon)
    else:
        centred = x - x.mean(-1, keepdim=True)
        y = norm.weight * centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + norm.eps) + norm.bias
    logits = y @ head.weight.T + (head.bias if head.bias is not None else 0)
    return (logits * direction).sum(-1), x


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("position", [-1, 3])
def test_dla_adds_up_to_the_logit_difference(kind, position):
    model = MODELS[kind]()
    dla = direct_logit_attribution(model, IDS, (7, 12), positions=position)
    direction = torch.zeros(50, dtype=torch.float64)
    direction[7], direction[12] = 1, -1
    expected, _ = _reference_logit(model, kind, IDS, direction, position)
    assert dla.values.shape == (1 + 3 * (4 + 1), 2) and dla.constant.shape == (2,)
    torch.testing.assert_close(dla.values.sum(0) + dla.constant, expected, rtol=0, atol=1e-8)
    if kind == "gpt2":  # LayerNorm in float64: the model's own logits too
        torch.testing.assert_close(dla.logit, expected, rtol=0, atol=1e-8)


@pytest.mark.parametrize("kind", MODELS)
def test_dla_per_head_values_are_o_proj_weight_slices(kind):
    model = MODELS[kind]()
    layout = _layout(kind, 3)
    seen = _captured(model, IDS, [*layout["o"], layout["norm"]], inputs=True)
    head = model.get_submodule(layout["head"])
    norm = model.get_submodule(layout["norm"])
    tokens = torch.tensor([9, 30])  # one direction per example: token 9 for the first, 30 for the second
    dla = direct_logit_attribution(model, IDS, tokens, positions=-2)
    x = seen[layout["norm"]][:, -2]
    centred = x if kind == "llama" else x - x.mean(-1, keepdim=True)
    eps = norm.variance_epsilon if kind == "llama" else norm.eps
    scale = torch.sqrt((centred**2).mean(-1) + eps)
    d_head = 8
    for layer in range(3):
        o = model.get_submodule(layout["o"][layer])
        W_O = o.weight if kind == "llama" else o.weight.T  # (d_model, H * d_head)
        for h in range(4):
            for b in range(2):
                z = seen[layout["o"][layer]][b, -2, h * d_head : (h + 1) * d_head]
                write = W_O[:, h * d_head : (h + 1) * d_head] @ z
                if kind == "gpt2":
                    write = write - write.mean()
                value = (norm.weight * write / scale[b]) @ head.weight[tokens[b]]
                index = dla.names.index(f"a{layer}.h{h}")
                torch.testing.assert_close(dla.values[index, b], value, rtol=0, atol=1e-10)


def test_dla_names_and_layers_mode():
    model = llama()
    heads = direct_logit_attribution(model, IDS, 5)
    layers = direct_logit_attribution(model, IDS, 5, components="layers")
    assert heads.names[:6] == ["embed", "a0.h0", "a0.h1", "a0.h2", "a0.h3", "m0"]
    assert heads.names[-1] == "m2" and len(heads.names) == 16
    assert layers.names == ["embed", "a0", "m0", "a1", "m1", "a2", "m2"]
    torch.testing.assert_close(layers.constant, heads.constant, rtol=0, atol=0)
    for layer in range(3):
        rows = [heads.names.index(f"a{layer}.h{h}") for h in range(4)]
        torch.testing.assert_close(layers.values[layers.names.index(f"a{layer}")], heads.values[rows].sum(0))
        torch.testing.assert_close(layers.values[layers.names.index(f"m{layer}")],
                                   heads.values[heads.names.index(f"m{layer}")], rtol=0, atol=1e-15)  # fmt: skip
    assert heads.grid().shape == (3, 4, 2)


def test_dla_direction_forms_agree():
    model = gpt2()
    vector = torch.zeros(50, dtype=torch.float64)
    vector[4], vector[20] = 1.0, -1.0
    pair = direct_logit_attribution(model, IDS, (4, 20), positions=[1, -1])
    by_vector = direct_logit_attribution(model, IDS, vector, positions=[1, -1])
    one = direct_logit_attribution(model, IDS, 4, positions=[1, -1])
    other = direct_logit_attribution(model, IDS, 20, positions=[1, -1])
    assert pair.values.shape == (16, 2, 2)
    torch.testing.assert_close(pair.values, by_vector.values, rtol=0, atol=1e-12)
    torch.testing.assert_close(pair.values, one.values - other.values, rtol=0, atol=1e-12)
    torch.testing.assert_close(pair.constant, one.constant - other.constant, rtol=0, atol=1e-12)


def test_dla_embed_is_the_stream_entering_layer_zero():
    model = gpt2(unembedding_bias=False)
    dla = direct_logit_attribution(model, IDS, 3)
    # with every writer but the embeddings switched off, the logit is the embeddings' value plus the constant
    seen = _captured(model, IDS, ["transformer.h.0"], inputs=True)
    x = seen["transformer.h.0"][:, -1]
    assert x.shape == (2, 32)
    norm = model.transformer.ln_f
    _, full = _reference_logit(model, "gpt2", IDS, torch.nn.functional.one_hot(torch.tensor(3), 50).double(), -1)
    centred_full = full - full.mean(-1, keepdim=True)
    scale = torch.sqrt((centred_full**2).mean(-1, keepdim=True) + norm.eps)
    expected = (norm.weight * (x - x.mean(-1, keepdim=True)) / scale) @ model.lm_head.weight[3]
    torch.testing.assert_close(dla.values[0], expected, rtol=0, atol=1e-10)


# -- bad input -----------------------------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors():
    model = llama()
    with pytest.raises(ValueError, match=r"`input_ids` holds token ids outside the vocabulary \[0, 50\)"):
        logit_lens(model, torch.tensor([[1, 50]]))
    with pytest.raises(TypeError, match="`input_ids` must be an integer tensor"):
        logit_lens(model, torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"`layers`.*3 decoder layers"):
        logit_lens(model, IDS, layers=[3])
    with pytest.raises(ValueError, match="`direction` as a vector must have size vocab=50"):
        direct_logit_attribution(model, IDS, torch.randn(49, dtype=torch.float64))
    with pytest.raises(ValueError, match="`direction` holds token ids outside"):
        direct_logit_attribution(model, IDS, (3, 60))
    with pytest.raises(ValueError, match="`positions`"):
        direct_logit_attribution(model, IDS, 3, positions=7)
    with pytest.raises(ValueError, match="`components`"):
        direct_logit_attribution(model, IDS, 3, components="mlps")


def test_a_model_without_a_known_norm_names_what_was_looked_for():
    model = llama()
    model.model.final = model.model.norm  # the norm under a name the search does not know
    del model.model.norm
    message = r"could not find the final norm beside 'model.layers' \(looked for norm, ln_f.*`final_norm=.*`layout="
    with pytest.raises(ValueError, match=message + r"attribution.lens.lm_layout\(model, ...\)`"):
        logit_lens(model, IDS)


def test_a_model_without_known_layers_names_what_was_looked_for():
    from tests.attribution.models import tiny_gpt

    with pytest.raises(ValueError, match=r"could not find the decoder layers \(looked for model.layers, .*`layers="):
        direct_logit_attribution(tiny_gpt()[0], IDS, 3)


def test_gemma2_like_extra_writers_are_refused():
    model = llama()
    scaled = model.model.layers[1]
    original = scaled.forward

    def forward(*args, **kwargs):  # the layer adds twice its input: the stream is no longer the sum of writers
        return original(*args, **kwargs) + (args[0] if args else kwargs["hidden_states"])

    scaled.forward = forward
    with pytest.raises(ValueError, match="not the sum of layer 0's input"):
        direct_logit_attribution(model, IDS, 3)


# -- the model as found ----------------------------------------------------------------------------------------------
def test_calls_leave_the_model_as_found():
    model = llama().train()
    model.model.layers[0].mlp.requires_grad_(False)
    before = hook_state(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        lens = logit_lens(model, IDS)
        dla = direct_logit_attribution(model, IDS, (1, 2))
    assert hook_state(model) == before
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(m.training for m in model.modules())
    assert not torch.is_grad_enabled() or True
    assert torch.equal(lens, logit_lens(model.eval(), IDS)) and dla.values.isfinite().all()


def test_plots_draw(tmp_path):
    model = llama()
    lens = logit_lens(model, IDS)
    ax = plot_logit_lens(lens, decode=lambda i: f"t{i}", tokens=[f"t{i}" for i in IDS[0].tolist()])
    assert len(ax.texts) == 3 * 7
    ax = plot_direct_logit_attribution(direct_logit_attribution(model, IDS, (1, 2)), example=1)
    assert ax.images[0].get_array().shape == (3, 4)


@pytest.mark.parametrize("error", [ZeroDivisionError, KeyboardInterrupt])
def test_an_error_inside_leaves_no_hook(error):
    model = llama()

    def fail(module, args, output):
        raise error

    model.model.layers[2].register_forward_hook(fail)
    with_hook = hook_state(model)
    for call in (lambda: logit_lens(model, IDS), lambda: direct_logit_attribution(model, IDS, 3)):
        with pytest.raises(error):
            call()
        assert hook_state(model) == with_hook
