"""Survey: every gradient CAM at candidate layers of modern vision models (random weights), for docs/which-layer.rst.

Prints, per model and layer, the warnings each CAM gives and how large its raw map is next to its largest
weight x activation term. Run from the repository root: ``python docs/_tools/which_layer.py``.
"""

from __future__ import annotations

import sys
import warnings

import timm
import torch

from attribution import GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM

MODELS = {
    "vit_tiny_patch16_224": ({"img_size": 64}, ["blocks.11", "blocks.10", "blocks.11.norm1", "blocks.10.mlp"], None),
    "deit_tiny_distilled_patch16_224": (
        {"img_size": 64},
        ["blocks.11", "blocks.10", "blocks.11.norm1", "blocks.10.mlp"],
        None,
    ),
    "cait_xxs24_224": ({"img_size": 64}, ["blocks.23", "blocks.23.norm1", "blocks.22.mlp"], None),
    "swin_tiny_patch4_window7_224": (
        {},
        ["layers.3", "layers.3.blocks.1.norm1", "layers.3.blocks.0.mlp", "layers.2"],
        "b h w c -> b c h w",
    ),
    "convnext_atto": ({}, ["stages.3", "stages.2", "stages.3.blocks.1"], None),
    "coatnet_0_rw_224": ({}, ["stages.3", "stages.2", "stages.3.blocks.1.norm1", "stages.2.blocks.0"], None),
    "maxvit_tiny_tf_224": ({"img_size": 64}, ["stages.3", "stages.2", "stages.3.blocks.1.grid.attn.proj"], None),
    "efficientformer_l1": ({}, ["stages.3", "stages.2", "stages.3.blocks.4.mlp", "norm"], None),
}
METHODS = (GradCAM, GradCAMPlusPlus, XGradCAM, HiResCAM, LayerCAM)


def survey(name: str) -> None:
    kwargs, layers, reshape = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, **kwargs).eval()
    size = kwargs.get("img_size", 224)
    x = torch.randn(2, 3, size, size)
    modules = dict(model.named_modules())
    for layer in layers:
        if layer not in modules:
            print(f"{name} {layer}: no such module", flush=True)
            continue
        for method in METHODS:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                try:
                    raw = method(model, layer, reshape=reshape)(x, 1, upsample=False, normalize=False)
                    result = f"max {float(raw.max()):.2e}"
                except Exception as exc:
                    result = f"{type(exc).__name__}: {str(exc)[:90]}"
            notes = sorted({str(w.message)[:70] for w in seen if issubclass(w.category, UserWarning)})
            print(f"{name} | {layer} | {method.__name__} | {result} | {notes}", flush=True)


if __name__ == "__main__":
    for model_name in sys.argv[1:] or MODELS:
        survey(model_name)
