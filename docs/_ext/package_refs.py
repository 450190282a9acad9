"""Resolve short Python cross-references in docstrings to the one object of the same package that has that name.

The classes and functions of :mod:`attribution` are documented under their public names (``attribution.record``,
``attribution.AttentionRollout``), while their docstrings, written in their own modules, refer to neighbours by
short name (``:func:`record``` in ``attribution.patching``, ``:func:`attention_rollout``` in
``attribution.rollout``). Sphinx looks such a name up only in the module the object is documented under, so these
references would be missing. This handler of ``missing-reference`` retries a dot-free name across the referring
object's top-level package and resolves it when exactly one documented object there ends with that name.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util.nodes import make_refnode


def resolve_short_name(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.reference | None:
    target = node.get("reftarget", "")
    module = node.get("py:module") or ""
    if node.get("refdomain") != "py" or not module or not target or "." in target:
        return None
    package = module.split(".")[0]
    domain: Any = env.get_domain("py")
    matches = [
        (name, entry)
        for name, entry in domain.find_obj(env, None, None, target, node.get("reftype"), searchmode=1)
        if name.startswith(f"{package}.") and not entry.aliased
    ]
    if len(matches) != 1:
        return None
    name, entry = matches[0]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", resolve_short_name)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
