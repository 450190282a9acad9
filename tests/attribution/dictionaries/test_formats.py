"""load_dictionary on folders built here in each peer's documented layout, and hookscope's own format read back."""

from __future__ import annotations

import json

import pytest
import torch

from attribution import SAE, Transcoder, load_dictionary

st = pytest.importorskip("safetensors.torch")


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


D, N, K = 5, 12, 3
X = rand(4, D, seed=99)


def peer_topk(pre, k):
    """The peers' TopK (SAELens, sparsify, dictionary_learning): top k of relu(pre) per row."""
    values, idx = pre.relu().topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, values)


# -- SAELens -----------------------------------------------------------------------------------------------------
def saelens_folder(tmp_path, architecture, **cfg):
    w = {"W_enc": rand(D, N, seed=1), "b_enc": rand(N, seed=2), "W_dec": rand(N, D, seed=3), "b_dec": rand(D, seed=4)}
    if architecture == "jumprelu":
        w["threshold"] = rand(N, seed=5)  # both signs: SAELens computes relu(pre) * (pre > t)
    st.save_file(w, str(tmp_path / "sae_weights.safetensors"))
    config = {"d_in": D, "d_sae": N, "architecture": architecture, "apply_b_dec_to_input": True, **cfg}
    config.setdefault("normalize_activations", "none")
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    return w


@pytest.mark.parametrize(("architecture", "cfg"), [("standard", {}), ("topk", {"k": K}), ("jumprelu", {})])
@pytest.mark.parametrize("apply_b_dec", [True, False])
def test_saelens_folders_give_saelens_encode_and_decode(tmp_path, architecture, cfg, apply_b_dec):
    w = saelens_folder(tmp_path, architecture, **cfg, apply_b_dec_to_input=apply_b_dec)
    pre = (X - w["b_dec"] * apply_b_dec) @ w["W_enc"] + w["b_enc"]
    expected = {
        "standard": pre.relu(),
        "topk": peer_topk(pre, K),
        "jumprelu": pre.relu() * (pre > w.get("threshold", 0)),
    }[architecture]
    sae = load_dictionary(tmp_path)
    assert isinstance(sae, SAE) and sae.W_enc.dtype == torch.float64
    torch.testing.assert_close(sae.encode(X), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae.decode(expected), expected @ w["W_dec"] + w["b_dec"], rtol=0, atol=1e-12)


def test_saelens_skip_transcoder_applies_w_skip_transposed(tmp_path):
    w = {
        "W_enc": rand(D, N, seed=1), "b_enc": rand(N, seed=2), "W_dec": rand(N, 3, seed=3), "b_dec": rand(3, seed=4),
        "W_skip": rand(3, D, seed=6),
    }  # fmt: skip
    st.save_file(w, str(tmp_path / "sae_weights.safetensors"))
    cfg = {"d_in": D, "d_sae": N, "d_out": 3, "architecture": "skip_transcoder", "apply_b_dec_to_input": False}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    tc = load_dictionary(tmp_path)
    assert isinstance(tc, Transcoder) and tc.skip
    f = (X @ w["W_enc"] + w["b_enc"]).relu()
    torch.testing.assert_close(tc(X), f @ w["W_dec"] + w["b_dec"] + X @ w["W_skip"].T, rtol=0, atol=1e-12)


def saelens_runner_topk_folder(tmp_path, norms, architecture="topk"):
    """A TopK folder as SAELens 6's training runner writes it: ``rescale_acts_by_decoder_norm`` set in cfg.json.

    ``norms`` are the decoder rows' norms: all 1 (what the runner's save leaves after folding them into the weights
    it writes) or of other sizes (a checkpoint saved before that fold, or by an older SAELens).
    """
    w_dec = rand(N, D, seed=3)
    w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True) * norms[:, None]
    w = {"W_enc": rand(D, N, seed=1), "b_enc": rand(N, seed=2), "W_dec": w_dec, "b_dec": rand(D, seed=4)}
    if architecture == "batchtopk":  # a BatchTopK training checkpoint: one threshold for the scaled pre-activations
        w["topk_threshold"] = torch.tensor(0.3, dtype=torch.float64)
    st.save_file(w, str(tmp_path / "sae_weights.safetensors"))
    cfg = {
        "d_in": D, "d_sae": N, "dtype": "float64", "device": "cpu", "apply_b_dec_to_input": True,
        "normalize_activations": "none", "reshape_activations": "none",
        "metadata": {"sae_lens_version": "6.18.0", "hook_name": "blocks.0.hook_resid_post"},
        "architecture": architecture, "k": K, "rescale_acts_by_decoder_norm": True,
    }  # fmt: skip
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    return w


def saelens_rescaled(w, x, activate):
    """SAELens's encode and decode with rescale_acts_by_decoder_norm (its TopKSAE.encode/decode, SAELens 6.18).

    ``hidden_pre * n`` before the activation, ``f / n`` before decoding; ``n`` the decoder's row norms.
    """
    n = w["W_dec"].norm(dim=-1)
    hidden_pre = ((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) * n
    f = activate(hidden_pre)
    return f, (f / n) @ w["W_dec"] + w["b_dec"]


NORMS = {
    "unit": torch.ones(N, dtype=torch.float64),
    "other": torch.tensor([0.2, 3.0, 1.0, 0.5, 7.0, 1.5, 0.05, 2.0, 0.8, 4.0, 1.1, 0.3], dtype=torch.float64),
}


@pytest.mark.parametrize("norms", ["unit", "other"])
def test_saelens_runner_topk_folders_with_rescale_acts_by_decoder_norm_give_saelens_features(tmp_path, norms):
    w = saelens_runner_topk_folder(tmp_path, NORMS[norms])
    features, reconstruction = saelens_rescaled(w, X, lambda h: peer_topk(h, K))
    sae = load_dictionary(tmp_path)
    assert sae.activation == "topk" and sae.k == K and sae.W_enc.dtype == torch.float64
    torch.testing.assert_close(sae.encode(X), features, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae.decode(sae.encode(X)), reconstruction, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae(X), reconstruction, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(N, dtype=torch.float64), rtol=0, atol=1e-12)
    pre = (X - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    chosen, unscaled = features != 0, peer_topk(pre, K) != 0
    assert torch.equal(chosen, unscaled) == (norms == "unit"), "other norms must change which features are chosen"


def test_saelens_batchtopk_checkpoint_with_rescale_acts_by_decoder_norm_thresholds_the_scaled_pre(tmp_path):
    w = saelens_runner_topk_folder(tmp_path, NORMS["other"], architecture="batchtopk")
    threshold = w["topk_threshold"]
    features, reconstruction = saelens_rescaled(w, X, lambda h: h.relu() * (h > threshold))
    sae = load_dictionary(tmp_path)
    assert sae.activation == "batchtopk"
    torch.testing.assert_close(sae.encode(X), features, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae(X), reconstruction, rtol=0, atol=1e-12)
    assert features.count_nonzero() > 0


@pytest.mark.parametrize(("given", "loads"), [(False, True), (None, True), (True, False)])
def test_pre_6_saelens_normalize_activations_booleans_read_as_saelens_migrates_them(tmp_path, given, loads):
    """SAELens before 6 wrote a bool: False is "none" (loads), True is "expected_average_only_in" (refused)."""
    w = saelens_folder(tmp_path, "standard", normalize_activations=given, sae_lens_version="3.5.0")
    if not loads:
        with pytest.raises(ValueError, match="normalize_activations='expected_average_only_in'"):
            load_dictionary(tmp_path)
        return
    expected = ((X - w["b_dec"]) @ w["W_enc"] + w["b_enc"]).relu()
    torch.testing.assert_close(load_dictionary(tmp_path).encode(X), expected, rtol=0, atol=1e-12)


def test_saelens_settings_this_library_does_not_compute_are_refused(tmp_path):
    saelens_folder(tmp_path, "standard", normalize_activations="expected_average_only_in")
    with pytest.raises(ValueError, match="normalize_activations='expected_average_only_in'"):
        load_dictionary(tmp_path)
    saelens_folder(tmp_path, "gated")
    with pytest.raises(ValueError, match="architecture 'gated' is not computed"):
        load_dictionary(tmp_path)


# -- sparsify ----------------------------------------------------------------------------------------------------
def test_sparsify_hookpoint_folder_gives_sparsify_encode(tmp_path):
    folder = tmp_path / "layers.3"
    folder.mkdir()
    w = {"encoder.weight": rand(N, D, seed=1), "encoder.bias": rand(N, seed=2), "W_dec": rand(N, D, seed=3)}
    w["b_dec"] = rand(D, seed=4)
    st.save_file(w, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": D, "num_latents": N, "k": K, "expansion_factor": 32}))
    sae = load_dictionary(folder)
    expected = peer_topk((X - w["b_dec"]) @ w["encoder.weight"].T + w["encoder.bias"], K)
    torch.testing.assert_close(sae.encode(X), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae(X), expected @ w["W_dec"] + w["b_dec"], rtol=0, atol=1e-12)
    with pytest.raises(FileNotFoundError, match=r"sparsify hookpoints: pass one of \['layers.3'\]"):
        load_dictionary(tmp_path)


def test_sparsify_skip_transcoder(tmp_path):
    w = {"encoder.weight": rand(N, D, seed=1), "encoder.bias": rand(N, seed=2), "W_dec": rand(N, D, seed=3)}
    w.update({"b_dec": rand(D, seed=4), "W_skip": rand(D, D, seed=5)})
    st.save_file(w, str(tmp_path / "sae.safetensors"))
    cfg = {"d_in": D, "num_latents": N, "k": K, "transcode": True, "skip_connection": True}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    tc = load_dictionary(tmp_path)
    f = peer_topk(X @ w["encoder.weight"].T + w["encoder.bias"], K)  # a transcoder does not subtract b_dec
    torch.testing.assert_close(tc(X), f @ w["W_dec"] + w["b_dec"] + X @ w["W_skip"].T, rtol=0, atol=1e-12)


# -- dictionary_learning -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["AutoEncoder", "AutoEncoderTopK", "BatchTopKSAE", "JumpReluAutoEncoder"])
def test_dictionary_learning_folders(tmp_path, kind):
    if kind == "JumpReluAutoEncoder":
        state = {"W_enc": rand(D, N, seed=1), "b_enc": rand(N, seed=2), "W_dec": rand(N, D, seed=3)}
        state.update({"b_dec": rand(D, seed=4), "threshold": rand(N, seed=5)})
        pre = X @ state["W_enc"] + state["b_enc"]  # apply_b_dec_to_input is False there
        f = (pre * (pre > state["threshold"])).relu()
        x_hat = f @ state["W_dec"] + state["b_dec"]
    else:
        bias = "bias" if kind == "AutoEncoder" else "b_dec"
        state = {"encoder.weight": rand(N, D, seed=1), "encoder.bias": rand(N, seed=2)}
        state.update({"decoder.weight": rand(D, N, seed=3), bias: rand(D, seed=4)})
        post = ((X - state[bias]) @ state["encoder.weight"].T + state["encoder.bias"]).relu()
        if kind == "AutoEncoderTopK":
            state["k"] = torch.tensor(K)
            post = peer_topk(post, K)
        if kind == "BatchTopKSAE":
            state.update({"k": torch.tensor(K), "threshold": torch.tensor(0.4, dtype=torch.float64)})
            post = post * (post > 0.4)
        f, x_hat = post, post @ state["decoder.weight"].T + state[bias]
    torch.save(state, tmp_path / "ae.pt")
    cfg = {"trainer": {"dict_class": kind, "activation_dim": D, "dict_size": N, "k": K}, "buffer": {}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sae = load_dictionary(tmp_path)
    torch.testing.assert_close(sae.encode(X), f, rtol=0, atol=1e-12)
    torch.testing.assert_close(sae(X), x_hat, rtol=0, atol=1e-12)


# -- circuit-tracer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ["relu", "jumprelu"])
def test_circuit_tracer_layer_files(tmp_path, activation):
    w = {"W_enc": rand(N, D, seed=1), "b_enc": rand(N, seed=2), "W_dec": rand(N, D, seed=3), "b_dec": rand(D, seed=4)}
    w["W_skip"] = rand(D, D, seed=5)
    if activation == "jumprelu":
        w["activation_function.threshold"] = rand(N, seed=6)
    st.save_file(w, str(tmp_path / "layer_2.safetensors"))
    tc = load_dictionary(tmp_path / "layer_2.safetensors")
    pre = X @ w["W_enc"].T + w["b_enc"]  # circuit-tracer: F.linear(x, W_enc, b_enc)
    f = pre.relu() if activation == "relu" else pre * (pre > w["activation_function.threshold"])
    torch.testing.assert_close(tc.encode(X), f, rtol=0, atol=1e-12)
    torch.testing.assert_close(tc(X), f @ w["W_dec"] + w["b_dec"] + X @ w["W_skip"].T, rtol=0, atol=1e-12)
    with pytest.raises(FileNotFoundError, match=r"circuit-tracer layer files: pass one of \['layer_2.safetensors'\]"):
        load_dictionary(tmp_path)


# -- ours --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: SAE(D, N, activation="relu"),
        lambda: SAE(D, N, activation="topk", k=K, subtract_b_dec=False),
        lambda: SAE(D, N, activation="batchtopk", k=K),
        lambda: SAE(D, N, activation="jumprelu").double(),
        lambda: Transcoder(D, 3, N, activation="topk", k=K, skip=True).double(),
    ],
)
def test_save_and_load_round_trip_bitwise(tmp_path, make):
    torch.manual_seed(0)
    original = make()
    with torch.no_grad():
        for t in original.state_dict().values():
            t.add_(torch.randn(t.shape, dtype=t.dtype))
    again = load_dictionary(original.save(tmp_path / "d"))
    assert type(again) is type(original) and repr(again) == repr(original)
    assert original.state_dict().keys() == again.state_dict().keys()
    for key, value in original.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]) and value.dtype == again.state_dict()[key].dtype, key
    x = torch.randn(4, D, dtype=original.W_enc.dtype)
    assert torch.equal(original(x), again(x))


def test_damaged_and_partial_files_are_refused_naming_the_file(tmp_path):
    folder = SAE(D, N).save(tmp_path / "ours")
    weights = folder / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"weights\.safetensors does not match the size and checksum"):
        load_dictionary(folder)
    (tmp_path / "peer").mkdir()
    saelens_folder(tmp_path / "peer", "standard")
    file = tmp_path / "peer" / "sae_weights.safetensors"
    file.write_bytes(file.read_bytes()[:-40])  # an interrupted download
    with pytest.raises(ValueError, match=r"sae_weights\.safetensors cannot be read .* damaged or incomplete"):
        load_dictionary(tmp_path / "peer")
    (tmp_path / "dl").mkdir()
    torch.save({"encoder.weight": rand(N, D, seed=1)}, tmp_path / "dl" / "ae.pt")
    (tmp_path / "dl" / "config.json").write_text(json.dumps({"trainer": {"dict_class": "AutoEncoder"}}))
    with pytest.raises(ValueError, match=r"ae\.pt lacks 'encoder\.bias'"):
        load_dictionary(tmp_path / "dl")
    (tmp_path / "dl" / "ae.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ValueError, match=r"ae\.pt cannot be read"):
        load_dictionary(tmp_path / "dl")


def test_a_folder_of_no_format_lists_what_each_format_needs(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"files: \['notes.txt'\].*SAELens: cfg.json \+ sae_weights"):
        load_dictionary(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dictionary(tmp_path / "nowhere")
