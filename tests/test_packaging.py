"""The distribution: import packages come from this checkout, hooks never imports attribution, public names."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import attribution
import hooks

ROOT = Path(__file__).resolve().parents[1]


def test_packages_come_from_this_checkout():
    assert Path(attribution.__file__).resolve().parent == ROOT / "attribution"
    assert Path(hooks.__file__).resolve().parent == ROOT / "hooks"
    assert (ROOT / "hooks" / "py.typed").is_file() and (ROOT / "attribution" / "py.typed").is_file()


@pytest.mark.slow
def test_hooks_does_not_depend_on_attribution():
    for path in (ROOT / "hooks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("attribution"), path
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("attribution") for a in node.names), path
    code = "import sys, hooks; print('attribution' in sys.modules, 'matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.split() == ["False", "False"]


def test_public_names_exist_and_are_documented():
    for package in (hooks, attribution):
        for name in package.__all__:
            obj = getattr(package, name)
            if typing.get_origin(obj) is not None:  # a type alias: documented in the API reference
                continue
            assert (obj.__doc__ or "").strip(), f"{package.__name__}.{name} has no docstring"


def test_attribution_uses_only_the_public_names_of_hooks():
    for path in (ROOT / "attribution").rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hooks":
                assert node.module == "hooks", f"{path}: from {node.module} import ..."
                assert all(a.name in hooks.__all__ for a in node.names), f"{path}: a private name of hooks"
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("hooks.") for a in node.names), path
        for internal in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_global_forward_hooks"):
            assert internal not in source, f"{path} reads PyTorch's {internal}: ask hooks instead"


@pytest.mark.slow
def test_importing_hooks_does_not_import_dynamo():
    code = "import sys, hooks, attribution; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
