"""Activation-patching sweep time: ours vs a plain-hooks loop vs TransformerLens 4.3, one process.

Run from the repository root: python -m benchmarks.patching_speed [--rounds 5] [--layers 4]
Setting of issue 5: the reference's pre-LN transformer (tests/attribution/models.py) at 4 layers, d_model 256,
8 heads of 32, d_mlp 1024, vocab 512, exact GELU, seeded random weights; batch 8, seq 32; residual stream (input
of ``layers[l]``) by layer x position = 128 cells; metric = mean logit difference at the last position between two
answer tokens; 1 thread; no autograd. Every timed call includes its clean run (plain loop: cache with raw hooks;
ours: inside the sweep; TransformerLens: ``run_with_cache``). The floor is the least an exact sweep can compute: per
cell, the blocks from the site on, from cached block inputs, written out by hand. TransformerLens runs its native model
(``TransformerBridge.boot_native``) loaded with the same weights; it is left out if not installed.
The results of all methods are checked against each other first (that run doubles as the warm-up).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from torch import nn

from attribution import activation_patching
from benchmarks._timing import interleaved, setup, table
from tests.attribution.models import TinyGPT

CONFIG: dict[str, Any] = {
    "n_layers": 4,
    "d_model": 256,
    "n_heads": 8,
    "d_head": 32,
    "d_mlp": 1024,
    "n_ctx": 32,
    "d_vocab": 512,
    "act_fn": "gelu",
    "normalization_type": "LN",
    "eps": 1e-5,
    "seed": 0,
}
BATCH, SEQ = 8, 32
CORRUPTED_POSITIONS = (2, 9, 17)
PLAIN, FLOOR, OURS, OURS_NO_REUSE, OURS_8, TL = (
    "plain hooks loop",
    "floor: by hand, blocks before the site skipped",
    "hookscope activation_patching",
    "hookscope, reuse=False",
    "hookscope, cells_per_forward=8",
    "TransformerLens get_act_patch_resid_pre",
)


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clean tokens, corrupted tokens (a few positions changed in every example), answer pairs ``(batch, 2)``."""
    vocab = CONFIG["d_vocab"]
    clean = torch.randint(0, vocab, (BATCH, SEQ))
    corrupted = clean.clone()
    for p in CORRUPTED_POSITIONS:
        corrupted[:, p] = (clean[:, p] + torch.randint(1, vocab, (BATCH,))) % vocab
    answers = torch.randint(0, vocab, (BATCH, 2))
    return clean, corrupted, answers


def logit_diff(answers: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    rows = torch.arange(answers.shape[0])

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[:, -1]
        return (last[rows, answers[:, 0]] - last[rows, answers[:, 1]]).mean()

    return metric


def plain_loop(
    model: TinyGPT, clean: torch.Tensor, corrupted: torch.Tensor, metric: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Raw PyTorch hooks, no library code: cache the clean inputs of the blocks, then one hook per cell."""
    layers: list[nn.Module] = list(model.layers)
    with torch.no_grad():
        cache: list[torch.Tensor] = []
        handles = [layer.register_forward_pre_hook(lambda m, args: cache.append(args[0].clone())) for layer in layers]
        model(clean)
        for h in handles:
            h.remove()
        out = torch.empty(len(layers), corrupted.shape[1])
        for i, (layer, source) in enumerate(zip(layers, cache, strict=True)):
            for p in range(corrupted.shape[1]):

                def hook(m: nn.Module, args: tuple[Any, ...], p: int = p, source: torch.Tensor = source) -> Any:
                    x = args[0].clone()
                    x[:, p] = source[:, p]
                    return (x, *args[1:])

                handle = layer.register_forward_pre_hook(hook)
                try:
                    out[i, p] = metric(model(corrupted))
                finally:
                    handle.remove()
    return out


def skipping_loop(
    model: TinyGPT, clean: torch.Tensor, corrupted: torch.Tensor, metric: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The least work an exact sweep can do: per cell, only the blocks from the site on, written out by hand."""
    layers: list[nn.Module] = list(model.layers)

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        return model.tok_embed(tokens) + model.pos(torch.arange(tokens.shape[1]))

    with torch.no_grad():
        source, target = [embed(clean)], [embed(corrupted)]
        for layer in layers[:-1]:
            source.append(layer(source[-1]))
            target.append(layer(target[-1]))
        out = torch.empty(len(layers), corrupted.shape[1])
        for i in range(len(layers)):
            for p in range(corrupted.shape[1]):
                x = target[i].clone()
                x[:, p] = source[i][:, p]
                for layer in layers[i:]:
                    x = layer(x)
                out[i, p] = metric(model.head(model.ln_out(x)))
    return out


def transformer_lens(model: TinyGPT) -> Callable[..., torch.Tensor] | None:
    """TransformerLens' sweep on its native model with ``model``'s weights, or None if it is not installed."""
    try:
        from transformer_lens import TransformerBridge
        from transformer_lens.patching import get_act_patch_resid_pre
    except ImportError:
        return None
    bridge = TransformerBridge.boot_native(dict(CONFIG))
    loaded = bridge.load_state_dict(model.state_dict(), strict=False)
    # the bridge lists aliases (mlp.in/out of fc_in/fc_out) and a head.bias its NativeModel lacks as missing;
    # every parameter of ours must have gone in, which the output check below confirms
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    bridge.eval()
    tokens = torch.randint(0, CONFIG["d_vocab"], (BATCH, SEQ))
    with torch.no_grad():
        diff = (bridge(tokens) - model(tokens)).abs().max().item()
    print(
        f"TransformerLens {version('transformer_lens')} native model vs ours, same weights: "
        f"max |logit difference| = {diff:.2e}"
    )
    assert diff < 1e-4, diff

    def sweep(clean: torch.Tensor, corrupted: torch.Tensor, metric: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        with torch.no_grad(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):  # its tqdm bar
            _, clean_cache = bridge.run_with_cache(clean)
            return get_act_patch_resid_pre(bridge, corrupted, clean_cache, metric)

    return sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed repetitions per method (median reported)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (the issue's setting: 4)")
    args = parser.parse_args()
    CONFIG["n_layers"] = args.layers
    setup(1)
    model = TinyGPT(CONFIG).eval()
    clean, corrupted, answers = inputs()
    metric = logit_diff(answers)
    names = [f"layers.{i}" for i in range(CONFIG["n_layers"])]

    variants: dict[str, Callable[[], Any]] = {
        PLAIN: lambda: plain_loop(model, clean, corrupted, metric),
        FLOOR: lambda: skipping_loop(model, clean, corrupted, metric),
        OURS: lambda: activation_patching(model, clean, corrupted, names, metric, site="input", progress=False),
        OURS_NO_REUSE: lambda: activation_patching(
            model, clean, corrupted, names, metric, site="input", progress=False, reuse=False
        ),
        OURS_8: lambda: activation_patching(
            model, clean, corrupted, names, metric, site="input", progress=False, cells_per_forward=8
        ),
    }
    tl = transformer_lens(model)
    if tl is None:
        print("transformer_lens is not installed: its row is left out")
    else:
        variants[TL] = lambda: tl(clean, corrupted, metric)

    results = {name: fn() for name, fn in variants.items()}  # also the warm-up
    reference = results[PLAIN]
    with torch.no_grad():
        span = (metric(model(clean)) - metric(model(corrupted))).item()
    print(f"clean - corrupted metric: {span:.4f}; result range [{reference.min():.4f}, {reference.max():.4f}]")
    assert torch.equal(results[OURS], results[OURS_NO_REUSE]), "replay must not change a single bit"
    for name, result in results.items():
        if name != PLAIN:
            diff = (result.float() - reference).abs().max().item()
            print(f"max |{name} - {PLAIN}| = {diff:.2e}")
            assert result.shape == reference.shape and diff < 1e-4, (name, result.shape, diff)

    times = interleaved(variants, repeats=args.rounds, warmup=0)
    cells = reference.numel()
    rows = [
        [
            name,
            f"{seconds:.3f}",
            f"{seconds / times[PLAIN]:.3f}",
            f"{seconds / times[TL]:.3f}" if TL in times else "-",
            f"{1000 * seconds / cells:.2f}",
        ]
        for name, seconds in times.items()
    ]
    print()
    print(
        f"{CONFIG['n_layers']} layers, d_model {CONFIG['d_model']}, {CONFIG['n_heads']} heads, batch {BATCH}, "
        f"seq {SEQ}: {cells} cells, 1 thread, no_grad; median of {args.rounds}"
    )
    print(table(["method", "s", "x plain", "x TL", "ms/cell"], rows))


if __name__ == "__main__":
    main()
