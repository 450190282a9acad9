"""LXT 2.1's ViT rules (``lxt.efficient.models.vit_torch.cp_LRP``) on a saved torchvision ViT, run as a subprocess.

Usage: python _lxt_vit_reference.py case.pt out.pt. LXT patches torch's GELU, LayerNorm and MultiheadAttention
classes for the whole process; LXT's BERT module (of an older transformers) is replaced by an empty one, as in
``_lxt_reference.py``. The relevance is gradient times input at ``conv_proj``'s output, summed over channels.
"""

from __future__ import annotations

import sys
import types

import torch


def main(case: str, out: str) -> None:
    fake = types.ModuleType("lxt.efficient.models.bert")
    fake.modeling_bert = types.ModuleType("modeling_bert_absent")  # type: ignore[attr-defined]
    fake.attnLRP = {}  # type: ignore[attr-defined]
    sys.modules["lxt.efficient.models.bert"] = fake
    from lxt.efficient import monkey_patch
    from lxt.efficient.models.vit_torch import cp_LRP
    from torchvision.models import vision_transformer

    monkey_patch(vision_transformer, cp_LRP)
    saved = torch.load(case, weights_only=False)
    model, images, targets = saved["model"].eval(), saved["images"], saved["targets"]
    kept: list[torch.Tensor] = []

    def leaf(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        kept.append(output.detach().requires_grad_(True))
        return kept[0]

    model.conv_proj.register_forward_hook(leaf)
    logits = model(images)
    (grad,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), kept[0])
    torch.save({"relevance": (kept[0] * grad).sum(1).detach()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
