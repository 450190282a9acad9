"""Attribution of 32 generated tokens on SmolLM2-135M-Instruct: ours vs captum's LLMGradientAttribution, one process.

Run from the repository root: python -m benchmarks.generation_speed [--tokens 32] [--rounds 3] [--threads 2]
Setting of issue 23: SmolLM2-135M-Instruct (float32, offline GGUF weights, see examples/_smollm2.py), a question in
its chat template, its greedy answer's first 32 tokens (generated once, untimed); gradient x embedding (captum
``LayerGradientXActivation`` on ``model.get_input_embeddings()`` inside ``LLMGradientAttribution``, target = the
generated tokens) against ``attribute_generation(method="input_x_gradient")`` at several ``target_batch``. Checked
first: the same numbers (that run doubles as the warm-up). Counted: calls of ``torch.autograd.grad`` (each one
backward pass; ours batch ``target_batch`` targets with ``is_grads_batched``) and forward calls of the model. Memory:
the peak of tensor storages created during the call (benchmarks._timing.memory, forward and backward).
"""

from __future__ import annotations

import argparse
import time
from importlib.metadata import version

import torch

from attribution import attribute_generation
from benchmarks._timing import interleaved, memory, setup, table

QUESTION = "Explain in a few sentences why the sky is blue during the day and red at sunset."


class Counter:
    """Calls of ``torch.autograd.grad`` and forwards of the model while active."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.grads, self.forwards = model, 0, 0

    def __enter__(self) -> Counter:
        self.original = torch.autograd.grad

        def counting(*args, **kwargs):
            self.grads += 1
            return self.original(*args, **kwargs)

        torch.autograd.grad = counting
        self.handle = self.model.register_forward_pre_hook(lambda m, a: setattr(self, "forwards", self.forwards + 1))
        return self

    def __exit__(self, *exc: object) -> None:
        torch.autograd.grad = self.original
        self.handle.remove()


def main(tokens: int, rounds: int, threads: int) -> None:
    from captum.attr import LayerGradientXActivation, LLMGradientAttribution, TextTokenInput

    from examples._smollm2 import load_smollm2

    setup(threads)
    model, tokenizer = load_smollm2()
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    prompt = TextTokenInput(text, tokenizer)
    ids = prompt.inp_tensor[0]
    generated = attribute_generation(model, ids, max_new_tokens=tokens).generated
    if len(generated) != tokens:
        raise SystemExit(f"the answer stopped after {len(generated)} tokens: {tokenizer.decode(generated)!r}")
    print(f"SmolLM2-135M-Instruct, prompt {len(ids)} tokens, {len(generated)} generated: "
          f"{tokenizer.decode(generated)!r}")  # fmt: skip
    captum = LLMGradientAttribution(LayerGradientXActivation(model, model.get_input_embeddings()), tokenizer)

    variants = {"captum LLMGradientAttribution": lambda: captum.attribute(prompt, target=generated).token_attr}
    for batch in (8, 16, 32):
        variants[f"ours, target_batch={batch}"] = lambda b=batch: attribute_generation(
            model, ids, generated=generated, target_batch=b
        ).scores[:, : len(ids)]

    rows, reference = [], None
    counts = {}
    for name, fn in variants.items():  # the check run, also the warm-up
        with Counter(model) as counter:
            start = time.perf_counter()
            scores = fn()
            first = time.perf_counter() - start
        counts[name] = (counter.grads, counter.forwards, first)
        reference = scores if reference is None else reference
        difference = float((scores - reference).abs().max() / reference.abs().max())
        counts[name] += (difference,)
    times = interleaved(variants, rounds, warmup=0)
    base = times["captum LLMGradientAttribution"]
    for name, fn in variants.items():
        peak, _ = memory(fn)
        grads, forwards, _, difference = counts[name]
        rows.append([name, f"{times[name]:.2f}", f"{base / times[name]:.2f}x", grads, forwards, f"{peak:.0f}",
                     f"{difference:.1e}"])  # fmt: skip
    print(f"torch {torch.__version__}, captum {version('captum')}, transformers {version('transformers')}, "
          f"{threads} threads, median of {rounds} rounds (interleaved)")  # fmt: skip
    header = ["method", "time (s)", "speed-up", "backward passes", "forwards", "peak MiB", "max diff / max |captum|"]
    print(table(header, rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    main(args.tokens, args.rounds, args.threads)
