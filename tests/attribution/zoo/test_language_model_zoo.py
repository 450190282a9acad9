"""Patching and attribution patching on the HuggingFace language-model families users run (random weights, tiny).

Each family must give a meaningful result: finite effects of the right shape, and the invariant that patching a
layer's whole clean output into the corrupted run from the last layer on recovers the clean metric exactly
(normalised effect 1), while attribution patching's estimate is finite and of the same shape.
"""

from __future__ import annotations

import pytest
import torch

from attribution import activation_patching, attribution_patching

transformers = pytest.importorskip("transformers")
SIZES = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}

FAMILIES = {
    "llama": ("LlamaConfig", {**SIZES, "intermediate_size": 64, "num_key_value_heads": 2}, "model.layers"),
    "qwen2": ("Qwen2Config", {**SIZES, "intermediate_size": 64, "num_key_value_heads": 2}, "model.layers"),
    "mistral": ("MistralConfig", {**SIZES, "intermediate_size": 64, "num_key_value_heads": 2}, "model.layers"),
    "gemma": ("GemmaConfig", {**SIZES, "intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8},
              "model.layers"),
    "phi": ("PhiConfig", {**SIZES, "intermediate_size": 64}, "model.layers"),
    "gpt2": ("GPT2Config", {"vocab_size": 40, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16},
             "transformer.h"),
    "gpt_neox": ("GPTNeoXConfig", {**SIZES, "intermediate_size": 64}, "gpt_neox.layers"),
    "gptj": ("GPTJConfig", {"vocab_size": 40, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 16,
                            "rotary_dim": 4}, "transformer.h"),
    "falcon": ("FalconConfig", {**SIZES, "new_decoder_architecture": False}, "transformer.h"),
    "mamba": ("MambaConfig", {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "state_size": 4},
              "backbone.layers"),
}  # fmt: skip


def _model(family: str) -> torch.nn.Module:
    name, config, _ = FAMILIES[family]
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**config)).eval()


def _metric(output) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output.last_hidden_state
    return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patching_and_attribution_patching_are_meaningful(family):
    model = _model(family)
    layers = f"{FAMILIES[family][2]}.*"
    element = 0 if family == "falcon" else None  # Falcon's layers return tuples: the documented error says so
    generator = torch.Generator().manual_seed(1)
    clean, corrupted = (torch.randint(0, 40, (2, 6), generator=generator) for _ in range(2))
    if element is not None:
        with pytest.raises(TypeError, match=r"is a tuple, not a tensor.*pass element=i"):
            activation_patching(model, clean, corrupted, layers, _metric, progress=False)
    effects = activation_patching(model, clean, corrupted, layers, _metric, element=element, progress=False)
    assert effects.shape == (2, 6) and bool(torch.isfinite(effects).all())
    whole = activation_patching(model, clean, corrupted, layers, _metric, positions=False, normalize=True,
                                element=element, progress=False)  # fmt: skip
    assert float(whole[-1]) == pytest.approx(1.0, abs=1e-5)  # the last layer's whole clean output: the clean metric
    estimate = attribution_patching(model, clean, corrupted, layers, _metric, element=element)
    assert estimate.shape == (2, 6) and bool(torch.isfinite(torch.as_tensor(estimate)).all())


@pytest.mark.slow
def test_t5_encoder_layers_patch_exactly():
    config = transformers.T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    encoder = transformers.T5EncoderModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    clean, corrupted = (torch.randint(0, 40, (2, 6), generator=generator) for _ in range(2))
    whole = activation_patching(encoder, clean, corrupted, "encoder.block.*", _metric, positions=False,
                                normalize=True, element=0, progress=False)  # fmt: skip
    assert float(whole[-1]) == pytest.approx(1.0, abs=1e-5)
