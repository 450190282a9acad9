"""Cost of managed hooks: no-op forward hooks on every module of resnet50, ours vs raw PyTorch vs TackleBox.

Run from the repository root: python -m benchmarks.hooks_overhead [--rounds 10]
Setting of issue 2: torchvision resnet50 (weights=None), batch 8, 224x224, 2 threads, eval, no_grad.
A second table repeats the comparison on a 32x32 image, batch 1, where the convolutions cost little and the
per-call cost of the hooks themselves shows. Then: registering and removing a group, registering one name at a
time (1000, 4000 and 8000 of 8000 modules, against plain PyTorch, with the ratio to 1000: linear is 4 and 8), and the
import time of the packages in fresh processes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torchvision

from benchmarks._timing import setup, table
from hooks import HookManager
from hooks.tacklebox import HookManager as CompatManager


def noop(module, args, output):  # the same function everywhere
    return None


def installers(model: torch.nn.Module) -> dict[str, Callable[[], Callable[[], object]]]:
    """Each entry hooks every module of ``model`` with ``noop`` and returns the function that undoes it."""
    modules = list(model.modules())

    def none():
        return lambda: None

    def raw():
        handles = [m.register_forward_hook(noop) for m in modules]
        return lambda: [h.remove() for h in handles]

    def ours():
        mgr = HookManager(model)
        mgr.group("noop").forward(modules, noop)
        return mgr.remove_all

    def compat():
        mgr = CompatManager()
        mgr.register_forward_hook(noop, **{f"m{i}": m for i, m in enumerate(modules)})
        return mgr.cleanup

    result = {"no hooks": none, "raw PyTorch hooks": raw, "hookscope group": ours, "hooks.tacklebox": compat}
    try:
        from tacklebox.hook_management import HookManager as TackleBoxManager
    except ImportError:
        print("TackleBox is not installed (pip install tacklebox): its row is left out")
        return result

    def tacklebox():
        mgr = TackleBoxManager()
        mgr.register_forward_hook(noop, **{f"m{i}": m for i, m in enumerate(modules)})
        return mgr.cleanup

    result["TackleBox"] = tacklebox
    return result


def compare(model: torch.nn.Module, x: torch.Tensor, rounds: int, per_round: int) -> dict[str, float]:
    """Median time of one no_grad forward under each variant; variants take turns in every round."""
    variants = installers(model)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        model(x)
        for _ in range(rounds):
            for name, install in variants.items():
                remove = install()
                model(x)  # warm
                for _ in range(per_round):
                    start = time.perf_counter()
                    model(x)
                    samples[name].append(time.perf_counter() - start)
                remove()
    return {name: statistics.median(v) for name, v in samples.items()}


def report(title: str, results: dict[str, float], calls: int) -> None:
    floor, raw = results["no hooks"], results["raw PyTorch hooks"]
    rows = [
        [name, f"{t * 1000:.2f}", f"{t / floor:.3f}", f"{t / raw:.3f}", f"{(t - floor) / calls * 1e6:.2f}"]
        for name, t in results.items()
    ]
    print(title)
    print(table(["variant", "forward ms", "x no hooks", "x raw hooks", "us per module call"], rows))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    setup(2)
    model = torchvision.models.resnet50(weights=None).eval()
    calls = sum(1 for _ in model.modules()) + 16  # module calls per forward (a Bottleneck calls its ReLU 3x)
    big = compare(model, torch.randn(8, 3, 224, 224), args.rounds, 2)
    report(
        f"resnet50, batch 8, 224x224, 2 threads, no_grad, every module hooked; median of {2 * args.rounds}", big, calls
    )
    small = compare(model, torch.randn(1, 3, 32, 32), args.rounds, 20)
    report(f"the same on batch 1, 32x32 (hook cost made visible); median of {20 * args.rounds}", small, calls)

    modules = list(model.modules())

    def register_remove() -> None:
        with HookManager(model).group("g") as g:
            g.forward(modules, noop)

    def register_remove_by_glob() -> None:
        with HookManager(model).group("g") as g:
            g.forward("**", noop)

    times = {}
    for name, fn in {"objects": register_remove, "glob": register_remove_by_glob}.items():
        for _ in range(3):
            fn()
        samples = []
        for _ in range(30):  # back to back, as in use (the other tables force a gc.collect() before each run)
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    print(
        table(
            ["operation (median of 30)", "ms"],
            [
                [
                    f"register + remove a group on all {len(modules)} modules (module objects)",
                    f"{times['objects'] * 1e3:.2f}",
                ],
                ["register + remove a group by the glob '**' (name resolution included)", f"{times['glob'] * 1e3:.2f}"],
            ],
        )
    )

    print()
    print(registration_scaling())
    print()
    print(import_times())


def registration_scaling(rounds: int = 5) -> str:
    """One name at a time, 1000/4000/8000 of a model's 8000 modules: hookscope must stay linear, like PyTorch.

    Each loop starts after ``gc.collect()``. Without it, the first loop after the model is built also pays the full
    collection that the model's construction left due (every object of the process walked once, 0.1-0.3 s here),
    whichever code allocates next. The "garbage collector off" row is hookscope's own work alone.
    """
    counts = (1000, 4000, 8000)
    model = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(max(counts))])

    def hookscope(n: int) -> Callable[[], None]:
        mgr = HookManager(model)
        group = mgr.group("g")
        for i in range(n):
            group.forward(str(i), noop)
        return mgr.remove_all

    def plain(n: int) -> Callable[[], None]:
        handles = [model[i].register_forward_hook(noop) for i in range(n)]
        return lambda: [h.remove() for h in handles] and None

    rows = []
    for label, register, collect in (
        ("hookscope, one name at a time", hookscope, True),
        ("hookscope, garbage collector off", hookscope, False),
        ("plain PyTorch", plain, True),
    ):
        medians = {}
        for n in counts:
            samples = []
            for _ in range(rounds):
                gc.collect()
                if not collect:
                    gc.disable()
                start = time.perf_counter()
                undo = register(n)
                samples.append(time.perf_counter() - start)
                gc.enable()
                undo()
            medians[n] = statistics.median(samples)
        rows += [[str(n), label, f"{t * 1e3:.1f}", f"{t / medians[counts[0]]:.2f}"] for n, t in medians.items()]
    return table(["hooks", f"registration loop (median of {rounds})", "ms", "x 1000 hooks"], rows)


def import_times(runs: int = 7) -> str:
    """Seconds to import torch, then torch with hooks or attribution, each in a fresh process (median)."""
    code = "import time; t = time.perf_counter(); import {}; print(time.perf_counter() - t)"
    variants = {"torch": "torch", "torch + hooks": "torch, hooks", "torch + attribution": "torch, attribution"}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):  # in turn, so that drift hits all alike
        for name, modules in variants.items():
            out = subprocess.run([sys.executable, "-c", code.format(modules)], capture_output=True, text=True)
            samples[name].append(float(out.stdout.strip()))
    base = statistics.median(samples["torch"])
    rows = [[name, f"{statistics.median(v):.2f}", f"+{statistics.median(v) - base:.2f}"] for name, v in samples.items()]
    return table([f"import, fresh process (median of {runs})", "s", "over torch"], rows)


if __name__ == "__main__":
    main()
