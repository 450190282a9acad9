"""Sparse dictionaries: training throughput, splice overhead and activation caching, against their floors.

Run from the repository root: python -m benchmarks.dictionaries_speed [--rounds 3] [--threads 2] [--write-inc]

1. Training: a TopK SAE (576 -> 4608, k = 32, SmolLM2's width at 8 x) on 16384 cached activations (random, the
   cost does not depend on the values), batch 1024, 8 steps: ``train_dictionary(None, activations, ...)`` against a
   minimal hand-written PyTorch loop of the same algorithm (topk encode, decode, MSE, AuxK on the features dead
   for one batch, the decoder gradient's parallel part removed, Adam, rows renormalised; no order, store or
   checkpoint), in activations per second. With 8 steps of 1024, features are dead after 1024 tokens in both, so
   AuxK runs at every step in both. The floor decodes densely (``f @ W_dec``, autograd's dense backward) as the
   plainest loop does; ``train_dictionary`` trains TopK on sparse codes (``attribution/dictionaries/_sparse.py``), so
   it is expected below the floor. Goal: at most 1.15 x the floor's time per step.
2. Splice: a random-weight 4-layer Llama (width 576, SmolLM2's MLP shape), 8 x 128 tokens, one forward spliced with
   that SAE at layer 2's MLP (``error=True``) against the plain forward plus the dictionary's own encode and decode
   of the same activations (the floor). Goal: at most 1.1 x.
3. Caching: recording layer 2's MLP output into the dataset store (``train_dictionary``'s recording: the forward
   stops after the site, shards written and fsynced) against plain full forwards of the same batches, tokens/s.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from attribution import SAE, splice
from attribution.dictionaries._activations import record_shards
from attribution.dictionaries.train import train_dictionary
from benchmarks._timing import interleaved, setup, table

WIDTH, FEATURES, K, BATCH, ROWS, STEPS = 576, 4608, 32, 1024, 16384, 8


def floor_loop(sae: SAE, x: torch.Tensor, steps: int) -> None:
    """The floor: the plainest loop of the same algorithm (TopK, AuxK on features dead for a batch, Adam, unit rows)."""
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    last_fired = torch.zeros(FEATURES, dtype=torch.long)
    for step in range(steps):
        batch = x[order[step * BATCH : (step + 1) * BATCH]]
        pre = (batch - sae.b_dec) @ sae.W_enc + sae.b_enc
        values, indices = pre.relu().topk(K, dim=-1)
        f = torch.zeros_like(pre).scatter(-1, indices, values)
        error = batch - (f @ sae.W_dec + sae.b_dec)
        loss = error.pow(2).sum(-1).mean()
        last_fired[(f > 0).any(0)] = (step + 1) * BATCH
        dead = (step + 1) * BATCH - last_fired >= BATCH
        if dead.any():  # AuxK: the error predicted from the top d_in / 2 dead pre-activations
            masked = torch.where(dead, pre.relu(), torch.zeros_like(pre))
            values, indices = masked.topk(min(WIDTH // 2, int(dead.sum())), dim=-1)
            aux = torch.zeros_like(pre).scatter(-1, indices, values) @ sae.W_dec
            e = error.detach()
            loss = loss + ((e - aux).pow(2).sum(-1).mean() / (e - e.mean(0)).pow(2).sum(-1).mean()) / 32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            rows = sae.W_dec / sae.W_dec.norm(dim=-1, keepdim=True)
            sae.W_dec.grad -= (sae.W_dec.grad * rows).sum(-1, keepdim=True) * rows
            opt.step()
            sae.W_dec.div_(sae.W_dec.norm(dim=-1, keepdim=True))


def training(rounds: int) -> list[list[str]]:
    x = torch.randn(ROWS, WIDTH)
    folders: list[Path] = []

    def ours() -> None:
        folders.append(Path(tempfile.mkdtemp()))
        sae = SAE(WIDTH, FEATURES, k=K)
        train_dictionary(None, x, None, sae, out=folders[-1], tokens=STEPS * BATCH, batch_size=BATCH, lr=1e-4,
                         checkpoint_every=STEPS, progress=False)  # fmt: skip

    times = interleaved({"floor": lambda: floor_loop(SAE(WIDTH, FEATURES, k=K), x, STEPS), "ours": ours}, rounds)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    rate = {name: STEPS * BATCH / t for name, t in times.items()}
    return [
        ["training, floor (hand loop)", f"{times['floor'] / STEPS * 1e3:.0f} ms/step", f"{rate['floor']:.0f}/s",
         "1.00x"],
        ["training, train_dictionary", f"{times['ours'] / STEPS * 1e3:.0f} ms/step", f"{rate['ours']:.0f}/s",
         f"{times['ours'] / times['floor']:.2f}x"],
    ]  # fmt: skip


def llama() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=WIDTH, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def splicing(rounds: int) -> list[list[str]]:
    model, sae = llama(), SAE(WIDTH, FEATURES, k=K)
    ids = torch.randint(0, 2048, (8, 128))
    site = "model.layers.2.mlp"
    with torch.no_grad():
        x = model.model.layers[2].mlp(torch.randn(8, 128, WIDTH))

    def plain() -> None:
        with torch.no_grad():
            model(ids)

    def floor() -> None:
        with torch.no_grad():
            model(ids)
            sae.decode(sae.encode(x))

    def spliced() -> None:
        with torch.no_grad(), splice(model, {site: sae}):
            model(ids)

    times = interleaved({"plain": plain, "floor": floor, "spliced": spliced}, rounds)
    return [
        ["forward, plain", f"{times['plain'] * 1e3:.0f} ms", f"{8 * 128 / times['plain']:.0f} tok/s", "-"],
        ["forward + SAE matmuls (floor)", f"{times['floor'] * 1e3:.0f} ms", f"{8 * 128 / times['floor']:.0f} tok/s",
         "1.00x"],
        ["forward, spliced (error=True)", f"{times['spliced'] * 1e3:.0f} ms", f"{8 * 128 / times['spliced']:.0f} tok/s",
         f"{times['spliced'] / times['floor']:.2f}x"],
    ]  # fmt: skip


def caching(rounds: int) -> list[list[str]]:
    model = llama()
    data = torch.randint(0, 2048, (64, 128))
    folders: list[Path] = []

    def plain() -> None:
        with torch.no_grad():
            for batch in data.split(16):
                model(batch)

    def recorded() -> None:
        folders.append(Path(tempfile.mkdtemp()))
        record_shards(model, data, "model.layers.2.mlp", folders[-1], both=False, batch_size=16, progress=False)

    times = interleaved({"plain": plain, "recorded": recorded}, rounds)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    tokens = data.numel()
    return [
        ["plain forwards (whole model)", f"{times['plain']:.2f} s", f"{tokens / times['plain']:.0f} tok/s", "1.00x"],
        ["recorded into shards (to layer 2)", f"{times['recorded']:.2f} s", f"{tokens / times['recorded']:.0f} tok/s",
         f"{times['recorded'] / times['plain']:.2f}x"],
    ]  # fmt: skip


def main(rounds: int, threads: int, write_inc: bool) -> None:
    setup(threads)
    start = time.perf_counter()
    rows = training(rounds) + splicing(rounds) + caching(rounds)
    text = table(["what", "time", "throughput", "ratio to floor"], rows)
    header = f"torch {torch.__version__}, {threads} threads, median of {rounds} rounds (interleaved), CPU"
    print(header)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s)")
    if write_inc:
        inc = Path(__file__).resolve().parents[1] / "docs" / "methods" / "dictionaries_speed.inc"
        body = "\n".join("   " + line for line in [header, *text.splitlines()])
        inc.write_text(".. code-block:: text\n\n" + body + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write-inc", action="store_true", help="write docs/methods/dictionaries_speed.inc")
    args = parser.parse_args()
    main(args.rounds, args.threads, args.write_inc)
