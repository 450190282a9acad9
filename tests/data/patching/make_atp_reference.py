"""Generate ``atp_reference.pt``: TransformerLens 4.3's attribution-patching node scores on the reference model.

One-off, kept for provenance; run from the repository root with transformer-lens installed:
``python -m tests.data.patching.make_atp_reference``. TransformerLens' ``attribution_patch`` runs on its own
``TransformerBridge``; ``TransformerBridge.boot_native`` builds the reference transformer's architecture, which is
loaded with the weights of ``tiny_model_state.pt`` (its logits agree with ``TinyGPT``'s to ~1e-6). Its node scores are
``(a_clean - a_corrupt) . d metric / d a`` on the corrupted run, per example, averaged over the batch, for
``hook_embed`` (the token embedding), ``blocks.{l}.attn.hook_z`` (each head's output before the output projection,
per position) and ``blocks.{l}.hook_mlp_out``. ``metric_fn`` gets one example's logits, so it uses one answer pair
for all examples: ``logits[0, -1, A] - logits[0, -1, B]`` with ``(A, B) = answer_tokens[0]``.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import torch

from tests.attribution.models import tiny_gpt

HERE = Path(__file__).parent


def transformer_lens_scores() -> dict:
    """TransformerLens' node scores on the reference model, as tensors (see the module docstring)."""
    from transformer_lens import TransformerBridge  # here, so that collecting this file needs no TransformerLens
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    model, ref = tiny_gpt()
    config = json.loads((HERE / "tiny_config.json").read_text())["config"]
    bridge = TransformerBridge.boot_native(dict(config))
    loaded = bridge.load_state_dict(model.state_dict(), strict=False)
    assert not loaded.unexpected_keys, loaded.unexpected_keys  # listed missing keys are aliases (see the benchmark)
    bridge.eval()
    clean, corrupted = ref["clean_tokens"], ref["corrupted_tokens"]
    with torch.no_grad():
        gap = (bridge(clean) - model(clean)).abs().max().item()
    assert gap < 1e-5, gap
    a, b = (int(t) for t in ref["answer_tokens"][0])
    scores = attribution_patch(bridge, clean, corrupted, lambda logits: logits[0, -1, a] - logits[0, -1, b]).node_scores
    n_layers, n_heads, seq = config["n_layers"], config["n_heads"], clean.shape[1]
    embed = torch.zeros(seq)
    heads = torch.zeros(n_layers, seq, n_heads)
    mlp = torch.zeros(n_layers, seq)
    for node, score in scores.items():
        if node.kind == "embed":
            embed[node.position] = score
        elif node.kind == "attn_head_out":
            heads[node.layer, node.position, node.head] = score
        else:
            mlp[node.layer, node.position] = score
    assert len(scores) == seq * (1 + n_layers * (n_heads + 1))
    return {
        "answer": torch.tensor([a, b]),
        "embed": embed,
        "attn_head_out": heads,
        "mlp_out": mlp,
        "transformer_lens": version("transformer-lens"),
        "torch": str(torch.__version__),
        "logit_gap": gap,
    }


def main() -> None:
    scores = transformer_lens_scores()
    torch.save(scores, HERE / "atp_reference.pt")
    print(f"wrote {HERE / 'atp_reference.pt'}; bridge vs TinyGPT logits {scores['logit_gap']:.1e}")


if __name__ == "__main__":
    main()
