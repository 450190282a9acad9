"""Draw docs/_static/architecture.png: the layers of hookscope, imports pointing down only.

Run from the repository root: ``python3 docs/_tools/make_architecture.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parents[1] / "_static" / "architecture.png"

# (x, y, width, height, title, lines, face colour)
BOXES = [
    (
        0.0,
        0.0,
        10.0,
        1.3,
        "hooks/",
        "HookManager · HookGroup · Recorder · trace · hooked_modules\n"
        "everything about PyTorch's hook internals and call tracing; knows nothing of attribution",
        "#dbe9f6",
    ),
    (
        0.0,
        1.9,
        6.3,
        1.3,
        "the run kernel: attribution/_*.py, targets.py",
        "HookedRun (one hook group, model state kept, graph from the first site)\n"
        "warn · inputs, pairs and targets · maps · replay · transformer rules",
        "#e3f1df",
    ),
    (
        6.4,
        1.9,
        3.6,
        1.3,
        "models/: the one reader",
        "lm_layout · vit_layout · find_attention\nweight · linear (also offloaded)",
        "#d5f0ec",
    ),
    (0.0, 3.8, 1.9, 1.7, "cam/", "GradCAM and kin\n_base · _math", "#fdf0d5"),
    (2.0, 3.8, 1.9, 1.7, "rollout/", "AttentionRollout\nGradientRollout\n_math · _sites", "#fdf0d5"),
    (4.0, 3.8, 2.1, 1.7, "patching/", "sites · activation\nAtP · path\n_sweep", "#fdf0d5"),
    (
        6.2,
        3.8,
        1.9,
        1.7,
        "more families",
        "gradients/ · lrp/\nreference/ · lens/\nperturbation/\ngeneration/ · circuits/",
        "#fdf0d5",
    ),
    (8.2, 3.8, 1.8, 1.7, "metrics/", "deletion · ROAD\npointing\nrandomisation", "#fdf0d5"),
    (
        0.0,
        6.1,
        6.6,
        1.3,
        "datasets/",
        "attribute_dataset (runner, shards, torchrun) · open_results\n"
        "aggregate (class_means, mean_patching) · cli (python -m attribution.cli)",
        "#efe3f5",
    ),
    (6.8, 6.1, 3.2, 1.3, "plot/", "maps · patching · metrics\n(matplotlib, imported inside)", "#efe3f5"),
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(11, 8.2))
    for x, y, w, h, title, lines, face in BOXES:
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", fc=face, ec="#555"))
        ax.text(x + w / 2, y + h - 0.28, title, ha="center", va="center", fontsize=10.5, weight="bold")
        ax.text(x + w / 2, y + (h - 0.45) / 2, lines, ha="center", va="center", fontsize=8.6, linespacing=1.35)
    for x, top, bottom in [(3.3, 6.1, 5.5), (8.4, 6.1, 5.5), (3.0, 3.8, 3.2), (7.6, 3.8, 3.2), (3.0, 1.9, 1.3)]:
        arrow = FancyArrowPatch((x, top), (x, bottom), arrowstyle="-|>", mutation_scale=16, lw=1.4, color="#333")
        ax.add_patch(arrow)
    ax.text(
        10.15,
        3.5,
        "imports point down only:\na layer uses the public\nnames of the layers below",
        fontsize=8.6,
        va="center",
        style="italic",
    )
    ax.set_xlim(-0.2, 12.3)
    ax.set_ylim(-0.2, 7.6)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
