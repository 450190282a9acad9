"""Influence: per-example gradients against vmap(grad), TracIn and Arnoldi against captum 0.9's TracInCP and Arnoldi.

Run from the repository root: python -m benchmarks.influence_speed [--rounds 5] [--rst docs/methods/influence_speed.inc]

Times are the CPU time of the process on one torch thread (``time.process_time``, so that other jobs on a shared
machine disturb them less), the minimum over interleaved rounds after one warm-up. Memory is the peak of the tensor
storages a call creates (``benchmarks._timing.memory``: the model's parameters and the inputs are not counted).

* Per-example gradients: a small pre-norm transformer (embedding, 2 blocks of LayerNorm, causal attention and MLP
  made of ``nn.Linear``, a head), float32, a batch of 16 sequences of 64 and of 256 tokens, width 64, vocabulary 256, a
  next-token loss summed over positions. ``torch.func.vmap(grad(...))`` over ``functional_call`` is the reference
  (same numbers to float32 rounding, checked before timing). A wider model (width 256, vocabulary 8,192: 5.8M
  parameters, so that the per-example gradients rather than the activations fill the memory) at 64 tokens.
  Projected: ``RandomProjection(width, structured=True)`` (8 x 8 or 16 x 16 per matrix; the smallest parameters have
  ``width`` numbers), ours computed from each linear layer's and the embedding's factors, against vmap's gradients
  projected afterwards with the same matrices.
* TracIn: an MLP (32-64-64-10) with 3 checkpoints, 20 test and 200 training examples, scores ``(20, 200)``, against
  captum's ``TracInCP`` with the same checkpoints (``sample_wise_grads_per_batch=False``, its exact per-example
  path, and ``True``, its hook-based path with a summed loss), training batches of 50. Same scores checked first.
* Arnoldi: the same MLP in float64 (6,922 parameters), 200 training examples in batches of 50, 20 test examples;
  ``InfluenceFunction(method="arnoldi", arnoldi_dim=50, projection_dim=20)`` against captum's
  ``ArnoldiInfluenceFunction`` with the same Krylov space (its ``arnoldi_dim=51``: it discards its last product),
  seed and damping (its ``hessian_reg`` is ours times n, added to the summed loss's Hessian; its scores are ours
  divided by n). The fit (Arnoldi iteration: 50 Hessian-vector products over the training set) and the scores
  ``(20, 200)`` are timed apart. Same scores checked first (1e-9 relative).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset

from attribution.influence import InfluenceFunction, RandomProjection, TracIn, per_example_gradients
from benchmarks._timing import interleaved, memory, setup, table

BATCH, LENGTH, WIDTH, VOCAB = 16, 64, 64, 256
WIDE = (256, 8192)
"""The wider model's width and vocabulary: its per-example gradients (5.8M numbers per example), not its
activations, take most of the memory."""


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / h.shape[-1] ** 0.5
        mask = torch.ones(h.shape[-2], h.shape[-2], dtype=torch.bool).triu(1)
        h = h + self.out(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v)
        return h + self.down(torch.relu(self.up(self.ln2(h))))


class TinyLM(nn.Module):
    def __init__(self, width: int = WIDTH, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy per sequence."""
    flat = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
    return flat.sum(-1)


def vmap_gradients(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: torch.func's per-example gradients."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return lm_loss(functional_call(model, p, (x[None],)), x[None]).sum()

    return vmap(grad(one), in_dims=(None, 0))(params, ids)  # type: ignore[no-any-return]


def gradients_rows(rounds: int, length: int, width: int = WIDTH, vocab: int = VOCAB) -> list[list[str]]:
    model = TinyLM(width, vocab).eval()
    ids = torch.randint(0, vocab, (BATCH, length))
    loss = lambda o, b: lm_loss(o, b[1])  # noqa: E731
    projection = RandomProjection(width, structured=True)  # the smallest parameters have `width` numbers
    for projected in (None, projection):
        ours = per_example_gradients(model, (ids, ids), loss, projection=projected)
        theirs = vmap_gradients(model, ids)
        if projected is not None:
            theirs = {k: projected(k, g) for k, g in theirs.items()}
        worst = max(float((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()) for k in ours)
        assert worst < 1e-4, worst
    variants = {
        "per_example_gradients": lambda: per_example_gradients(model, (ids, ids), loss),
        "vmap(grad)": lambda: vmap_gradients(model, ids),
        f"per_example_gradients, structured projection to {width}": lambda: per_example_gradients(
            model, (ids, ids), loss, projection=projection
        ),
        "vmap(grad), then the same projection": lambda: {
            k: projection(k, g) for k, g in vmap_gradients(model, ids).items()
        },
    }
    times = interleaved(variants, rounds, statistic=min, clock=time.process_time)
    peaks = {name: memory(fn)[0] for name, fn in variants.items()}
    rows = []
    for name, t in times.items():  # each against vmap's same numbers
        base = times["vmap(grad), then the same projection" if "projection" in name else "vmap(grad)"]
        model_name = f"{length} tokens" + (f", width {width}, vocabulary {vocab}" if width != WIDTH else "")
        rows.append([f"{name}, {model_name}", f"{t * 1e3:.0f} ms", f"{t / base:.2f}x", f"{peaks[name]:.0f} MiB"])
    return rows


def tracin_rows(rounds: int) -> list[list[str]]:
    from captum.influence import TracInCP

    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    x, y = torch.randn(220, 32), torch.randint(0, 10, (220,))
    folder = Path(tempfile.mkdtemp())
    paths, rates = [], [0.1, 0.05, 0.02]
    for i in range(3):
        for p in model.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
        paths.append(str(folder / f"{i}.pt"))
        torch.save(model.state_dict(), paths[-1])
    rate_of = dict(zip(paths, rates, strict=True))

    def load(net: nn.Module, path: str) -> float:
        net.load_state_dict(torch.load(path, weights_only=True))
        return rate_of[path]

    ce, ce_sum = nn.CrossEntropyLoss(reduction="none"), nn.CrossEntropyLoss(reduction="sum")
    train, test = TensorDataset(x[20:], y[20:]), (x[:20], y[:20])
    loader = torch.utils.data.DataLoader(train, batch_size=50)
    exact = TracInCP(model, train, paths, load, loss_fn=ce, batch_size=50)
    fast = TracInCP(model, train, paths, load, loss_fn=ce_sum, batch_size=50, sample_wise_grads_per_batch=True)
    ours = TracIn(model, list(zip(paths, rates, strict=True)), ce)
    expected = exact.influence(test)
    assert torch.allclose(ours.scores(test, loader), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    variants = {
        "TracIn": lambda: ours.scores(test, loader),
        "captum TracInCP (exact)": lambda: exact.influence(test),
        "captum TracInCP (sample_wise_grads_per_batch)": lambda: fast.influence(test),
    }
    times = interleaved(variants, rounds, statistic=min, clock=time.process_time)
    base = times["TracIn"]
    return [[name, f"{t * 1e3:.0f} ms", f"{t / base:.2f}x"] for name, t in times.items()]


def arnoldi_rows(rounds: int) -> list[list[str]]:
    from captum.influence._core.arnoldi_influence_function import ArnoldiInfluenceFunction

    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()
    x, y = torch.randn(220, 32, dtype=torch.float64), torch.randint(0, 10, (220,))
    path = str(Path(tempfile.mkdtemp()) / "model.pt")
    torch.save(model.state_dict(), path)
    ce, n, damping = nn.CrossEntropyLoss(reduction="none"), 200, 0.0025  # 0.0025 x 200 = 0.5, exact in float32
    train, test = TensorDataset(x[20:], y[20:]), (x[:20], y[:20])
    loader = torch.utils.data.DataLoader(train, batch_size=50)
    settings = {"damping": damping, "arnoldi_dim": 50, "projection_dim": 20, "progress": False}

    def ours_fit() -> InfluenceFunction:
        return InfluenceFunction(model, ce, method="arnoldi", **settings).fit(loader)  # type: ignore[arg-type]

    def captum_fit() -> ArnoldiInfluenceFunction:
        return ArnoldiInfluenceFunction(
            model, train, path, loss_fn=ce, batch_size=50, projection_dim=20, arnoldi_dim=51, arnoldi_tol=1e-14,
            hessian_reg=damping * n,
        )  # fmt: skip

    ours, theirs = ours_fit(), captum_fit()
    expected = theirs.influence(test) * n
    assert torch.allclose(ours.scores(test, loader), expected, rtol=1e-9, atol=1e-9 * float(expected.abs().max()))
    variants = {
        "arnoldi fit": ours_fit,
        "captum ArnoldiInfluenceFunction fit": captum_fit,
        "arnoldi scores": lambda: ours.scores(test, loader),
        "captum ArnoldiInfluenceFunction scores": lambda: theirs.influence(test),
    }
    times = interleaved(variants, rounds, statistic=min, clock=time.process_time)
    rows = []
    for name, t in times.items():
        base = times["arnoldi fit" if "fit" in name else "arnoldi scores"]
        rows.append([name, f"{t * 1e3:.0f} ms", f"{t / base:.2f}x"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rst", type=Path, default=None, help="write the tables as an rst include")
    args = parser.parse_args()
    setup(threads=1)
    rows = gradients_rows(args.rounds, LENGTH) + gradients_rows(args.rounds, 4 * LENGTH)
    rows += gradients_rows(args.rounds, LENGTH, *WIDE)
    grads = table(["per-example gradients", "CPU time", "vs vmap", "peak tensors"], rows)
    tracin = table(["TracIn (20 x 200, 3 checkpoints)", "CPU time", "vs hookscope"], tracin_rows(args.rounds))
    arnoldi = table(["Arnoldi (6,922 parameters, 20 x 200)", "CPU time", "vs hookscope"], arnoldi_rows(args.rounds))
    print(grads, tracin, arnoldi, sep="\n\n")
    if args.rst is not None:
        tables = (grads, tracin, arnoldi)
        body = "\n\n".join("::\n\n" + "\n".join("   " + line for line in t.splitlines()) for t in tables)
        args.rst.write_text(body + "\n")


if __name__ == "__main__":
    main()
