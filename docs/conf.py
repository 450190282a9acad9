"""Sphinx configuration of the hookscope documentation (builds offline: no intersphinx, no CDN assets)."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the packages `hooks` and `attribution`, also without an install
sys.path.insert(0, str(DOCS / "_ext"))

project = "hookscope"
author = "hookscope developers"
copyright = "hookscope developers"
release = "0.3.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "mathtext_svg",  # docs/_ext: formulas drawn by matplotlib, since MathJax loads from a CDN
    "package_refs",  # docs/_ext: docstrings' short names (`record`) resolved within their package
]
html_math_renderer = "mathtext_svg"

exclude_patterns = ["_build", "_tools"]
html_theme = "furo"
html_title = "hookscope"
html_static_path = ["_static"]
html_css_files = ["custom.css"]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True}
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

nitpicky = True
nitpick_ignore_regex = [
    # names of other libraries in signatures: no intersphinx (it would fetch their inventories over the network)
    (r"py:.*", r"(torch|numpy|np|matplotlib|PIL|einops|tqdm)(\..*)?"),
    (r"py:.*", r"(nn|Tensor|Figure|Axes)(\..*)?"),
    (r"py:.*", r"(collections\.abc|contextlib|pathlib|typing|types|threading|weakref)\..*"),  # the standard library
]
nitpick_ignore = [
    # type aliases and private helpers named in signatures (aliases have no page of their own)
    ("py:class", "LayerTarget"),
    ("py:class", "Fusion"),
    ("py:class", "AttentionSite"),
    ("py:class", "ModelIndex"),
    ("py:class", "hooks._resolve.ModelIndex"),
    # the protocol a handle needs of its group (hooks.HookGroup satisfies it); private, so no page of its own
    ("py:class", "hooks._handle.Group"),
    # `Target`, the private type alias of `target` arguments (hooks and attribution); the guides describe it
    ("py:class", "Target"),
    # short names of type aliases in signatures: hooks.ModuleTarget (module names, globs, objects), hooks' Kind and
    # Reduction, and attribution's Site ("output" | "input"), Element (int | str | None) and Threads
    ("py:class", "ModuleTarget"),
    ("py:class", "Kind"),
    ("py:class", "Reduction"),
    # attribution.features: a unit's number or label (int | str), and what a unit kind binds to (private)
    ("py:class", "Unit"),
    ("py:class", "attribution.features.units.Bound"),
    ("py:class", "Path"),
    ("py:class", "Site"),
    ("py:class", "Element"),
    ("py:class", "Threads"),
    # how hooks.flatten rebuilds a value (private; specs are only compared and passed back)
    ("py:class", "hooks._tree.Spec"),
    # the private per-layer record of a circuits graph (module names of one decoder layer)
    ("py:class", "attribution.circuits.graph.Layer"),
]
