"""LXT 2.1's AttnLRP on a saved model, run as a subprocess by test_attnlrp.py (LXT patches transformers globally).

Usage: python _lxt_reference.py {llama,qwen2,gpt2} case.pt out.pt. Two shims make LXT 2.1 run on this transformers:
it imports a BERT module of an older release (replaced by an empty one: no BERT is used), and it replaces the
attention registry by a plain dict, which the models then ask for ``get_interface`` (given back here).
"""

from __future__ import annotations

import sys
import types

import torch


class Registry(dict):
    """The attention registry LXT rebuilt as a dict, with the ``get_interface`` the models call."""

    def get_interface(self, key: str, default: object) -> object:
        return self.get(key, default)


def main(kind: str, case: str, out: str) -> None:
    fake = types.ModuleType("lxt.efficient.models.bert")
    fake.modeling_bert = types.ModuleType("modeling_bert_absent")  # type: ignore[attr-defined]
    fake.attnLRP = {}  # type: ignore[attr-defined]
    sys.modules["lxt.efficient.models.bert"] = fake

    import transformers
    from lxt.efficient import monkey_patch

    family = {
        "llama": transformers.models.llama.modeling_llama,
        "qwen2": transformers.models.qwen2.modeling_qwen2,
        "gpt2": transformers.models.gpt2.modeling_gpt2,
    }[kind]
    monkey_patch(family)
    family.ALL_ATTENTION_FUNCTIONS = Registry(family.ALL_ATTENTION_FUNCTIONS)
    saved = torch.load(case, weights_only=False)
    model, ids, targets, position = saved["model"].eval(), saved["ids"], saved["targets"], saved["position"]
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, use_cache=False).logits[:, position]
    logits.gather(1, targets[:, None]).sum().backward()
    torch.save({"relevance": (embeds * embeds.grad).detach()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
