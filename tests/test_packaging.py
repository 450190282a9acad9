"""The distribution: import packages come from this checkout, hooks never imports attribution, public names."""

from __future__ import annotations

import ast
import re
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


# Files another engineer is rewriting, which still import private names of other families (reported, not fixed here).
def _cross_family_private_imports(path: Path) -> list[str]:
    """``from ..<family>._private import x``, or ``from ..<module> import _x``, in a file of another folder."""
    here = path.relative_to(ROOT / "attribution").parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        package = list(here[: len(here) - (node.level - 1)]) + [p for p in (node.module or "").split(".") if p]
        if not package or package[:1] == list(here[:1]):
            continue  # the kernel (attribution/_run.py, ...) or the file's own family
        names = [a.name for a in node.names if a.name.startswith("_")]
        if any(part.startswith("_") for part in package[1:]) or names:
            found.append(f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}")
    return found


def test_families_import_no_private_name_of_another_family():
    """Shared helpers go to the kernel (``_maps.py``, ``_run.py``, ``targets.py``), as CONTRIBUTING.md says."""
    offenders = {}
    for path in (ROOT / "attribution").rglob("*.py"):
        key = path.relative_to(ROOT / "attribution").as_posix()
        found = _cross_family_private_imports(path)
        if found:
            offenders[key] = found
    assert offenders == {}


def _private_names_from_public_siblings(path: Path) -> list[str]:
    """``from .<public module> import _x`` in a file of the same folder: a private name taken from a public module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level != 1 or not node.module:
            continue
        if node.module.split(".")[0].startswith("_"):
            continue  # a private module of the family: where shared helpers belong
        names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
        if names:
            found.append(f"from .{node.module} import {', '.join(names)}")
    return found


def test_a_family_shares_its_helpers_through_its_private_modules():
    """Inside a family, a helper two files need lives in a ``_module.py``, not as a private name of a public file."""
    offenders = {}
    for path in (ROOT / "attribution").rglob("*.py"):
        found = _private_names_from_public_siblings(path)
        if found:
            offenders[path.relative_to(ROOT / "attribution").as_posix()] = found
    assert offenders == {}


def test_the_docs_name_no_folder_of_the_machine_they_were_made_on():
    """Example outputs pasted into the docs show the documented command's paths (``out/``), not a temporary folder."""
    found = []
    for path in [*(ROOT / "docs").rglob("*.rst"), *(ROOT / "docs").rglob("*.inc"), ROOT / "README.md"]:
        if "_build" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(^|[\s(`'\"=])/(tmp|home|root|work|Users)/", line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
