"""The public surface: every exported name is the function or class itself, documented, and old paths still work."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import attribution

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference" / "attribution.rst"
FAMILIES = ["cam", "rollout", "patching", "metrics", "datasets", "plot", "features", "probes", "causal"]
FAMILIES += ["influence", "concepts", "robust"]


def documented_top_level_names() -> set[str]:
    """Names the API reference documents directly under ``attribution`` (``.. autoclass:: attribution.GradCAM``)."""
    found = re.findall(r"^\.\. auto(?:function|class|data)::\s+attribution\.(\w+)\s*$", REFERENCE.read_text(), re.M)
    return set(found)


@pytest.mark.parametrize("name", attribution.__all__)
def test_every_exported_name_is_the_function_or_class_not_a_module(name):
    value = getattr(attribution, name)
    assert not isinstance(value, types.ModuleType), f"attribution.{name} is a module"
    assert inspect.isfunction(value) or inspect.isclass(value), f"attribution.{name} is a {type(value).__name__}"
    assert value.__name__ == name


def test_the_exports_and_the_api_reference_agree_both_ways():
    exported, documented = set(attribution.__all__), documented_top_level_names()
    assert not exported - documented, f"exported but not in {REFERENCE.name}: {sorted(exported - documented)}"
    assert not documented - exported, f"in {REFERENCE.name} but not exported: {sorted(documented - exported)}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_folder_exports_its_names_with_an_all(family):
    module = importlib.import_module(f"attribution.{family}")
    assert module.__file__ is not None and module.__file__.endswith("__init__.py")
    assert module.__all__ == sorted(module.__all__, key=str)
    for name in module.__all__:
        value = getattr(module, name)
        assert not isinstance(value, types.ModuleType), f"attribution.{family}.{name} is a module"
        if name in attribution.__all__:
            assert getattr(attribution, name) is value


@pytest.mark.parametrize(
    ("path", "name", "same_as"),
    [
        ("attribution.attribution_patching", "attribution_patching", attribution.attribution_patching),
        ("attribution.path_patching", "path_patching", attribution.path_patching),
        ("attribution.patching", "activation_patching", attribution.activation_patching),
        ("attribution.dataset", "attribute_dataset", attribution.attribute_dataset),
        ("attribution.aggregate", "class_means", attribution.class_means),
        ("attribution.rollout", "AttentionRollout", attribution.AttentionRollout),
        ("attribution.cli", "main", None),
        ("attribution.plot", "overlay", None),
    ],
)
def test_the_import_paths_the_docs_named_before_the_family_folders_still_work(path, name, same_as):
    module = importlib.import_module(path)
    value = getattr(module, name)
    assert same_as is None or value is same_as
    # importing the old module path must not replace the exported function by a module
    assert attribution.attribution_patching is not module or path == "attribution.attribution_patching"
    assert inspect.isfunction(attribution.attribution_patching) and inspect.isfunction(attribution.path_patching)


def test_an_old_module_path_in_a_fresh_interpreter_leaves_the_functions_exported():
    code = (
        "import attribution.attribution_patching, attribution.path_patching, attribution.dataset, inspect\n"
        "from attribution.attribution_patching import attribution_patching\n"
        "import attribution\n"
        "print(inspect.isfunction(attribution.attribution_patching), inspect.isfunction(attribution.path_patching),"
        " attribution.attribution_patching is attribution_patching)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["True", "True", "True"]
