"""Training on the base's cached prefix gives the same intervention as running every base prompt whole (float64)."""

from __future__ import annotations

import pytest
import torch

from attribution.causal import RotatedSubspace, Site, train_intervention
from tests.attribution.models import lm64

SITES = {  # kind -> (module, site, heads, width of the intervened part, embedding)
    "llama": ("model.layers.1", "output", None, 16, "model.embed_tokens"),
    "gpt2": ("transformer.h.0.attn.c_proj", "input", (1, 3), 8, "transformer.wte"),
}


def _train(kind: str, positions: tuple[int, ...], whole: bool) -> tuple[RotatedSubspace, list[int]]:
    """Train on token ids (the prefix cached), or on ``{"input_ids": ...}`` (no cache: every prompt runs whole)."""
    model = lm64(kind)
    name, where, heads, width, embedding = SITES[kind]
    g = torch.Generator().manual_seed(4)
    base, source = torch.randint(0, 40, (10, 7), generator=g), torch.randint(0, 40, (10, 7), generator=g)
    labels = torch.randint(0, 40, (10,), generator=g)
    torch.manual_seed(0)
    intervention = RotatedSubspace(width, 3).double()
    lengths: list[int] = []
    embed = model.get_submodule(embedding)
    handle = embed.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))
    try:
        site = Site(name, positions=positions, site=where, heads=heads)
        inputs = ({"input_ids": base}, {"input_ids": source}) if whole else (base, source)
        train_intervention(model, *inputs, labels, intervention, site, epochs=2, lr=0.05, batch_size=4)
    finally:
        handle.remove()
    return intervention, lengths


@pytest.mark.parametrize(("kind", "positions"), [("llama", (4, 6)), ("gpt2", (-2,))])
def test_training_on_the_cached_prefix_equals_training_on_whole_prompts(kind: str, positions: tuple[int, ...]) -> None:
    cached, lengths = _train(kind, positions, whole=False)
    whole, whole_lengths = _train(kind, positions, whole=True)
    first = min(p % 7 for p in positions)
    assert set(lengths[-6:]) == {7 - first} and set(whole_lengths) == {7}  # each step ran only the suffix
    torch.testing.assert_close(cached.rotation, whole.rotation, rtol=1e-9, atol=1e-10)
