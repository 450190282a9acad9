"""Plots of saliency maps, token relevance, patching results and metrics (matplotlib, imported inside the functions).

Every function follows matplotlib's habits: it draws on ``ax=`` when given (else on a new figure), returns the axes
or figure it drew on, never calls ``plt.show()``, and works with the Agg backend. Images may be tensors
``(C, H, W)`` / ``(B, C, H, W)``, numpy arrays ``(H, W, C)`` or PIL images; ``mean``/``std`` undo a normalisation.
"""

from .._maps import to_rgb
from .maps import compare, overlay, show_batch, show_tokens
from .metrics import plot_curves, plot_randomization
from .patching import plot_atp_vs_exact, plot_patching, plot_path_patching

__all__ = [
    "compare",
    "overlay",
    "plot_atp_vs_exact",
    "plot_curves",
    "plot_patching",
    "plot_path_patching",
    "plot_randomization",
    "show_batch",
    "show_tokens",
    "to_rgb",
]
