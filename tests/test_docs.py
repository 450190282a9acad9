"""Every Python block of README.md and of docs/**/*.rst runs on its own, from the packages alone.

The blocks of one page run in one fresh process, each in a namespace of its own, in a working directory that is
empty and with an import path that holds only the ``hooks`` and ``attribution`` packages of this checkout (as an
installed distribution would): a block cannot lean on ``tests/``, on the examples, or on the names of an earlier
block of its page. The processes are forked from one interpreter that has imported torch, the two packages and the
extras the blocks use, and nothing else (no block runs in it), so that each page does not pay the 3-7 s of imports.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._zygote import Zygote

pytestmark = pytest.mark.slow  # every page's blocks in a fresh interpreter

ROOT = Path(__file__).resolve().parents[1]
NEEDS = ("timm", "transformers")  # extras some blocks import; their blocks skip where they are missing


def _rst_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every ``.. code-block:: python`` directive (indented content after its options)."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)\.\. code-block:: python\s*$", line)
        if not match:
            continue
        indent = len(match[1])
        body: list[str] = []
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or lines[j].startswith(" " * (indent + 1))):
            if not body and lines[j].strip().startswith(":"):  # directive options
                j += 1
                continue
            body.append(lines[j])
            j += 1
        content = list(body)
        while content and not content[-1].strip():
            content.pop()
        width = min(len(b) - len(b.lstrip()) for b in content if b.strip())
        blocks.append((i + 1, "\n".join(b[width:] for b in content)))
    return blocks


def _markdown_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced ``python`` block."""
    blocks, current, start = [], None, 0
    for i, line in enumerate(path.read_text().splitlines()):
        if current is None and line.strip() == "```python":
            current, start = [], i + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _all_blocks() -> list[tuple[str, str]]:
    found = [(f"README.md:{line}", code) for line, code in _markdown_blocks(ROOT / "README.md")]
    for path in sorted((ROOT / "docs").rglob("*.rst")):
        if "_build" in path.parts:
            continue
        rel = path.relative_to(ROOT)
        found += [(f"{rel}:{line}", code) for line, code in _rst_blocks(path)]
    return found


BLOCKS = _all_blocks()


def test_the_blocks_are_found():
    pages = {name.split(":")[0] for name, _ in BLOCKS}
    assert {"README.md", "docs/getting-started.rst", "docs/methods/patching.rst"} <= pages
    assert len(BLOCKS) > 30


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding only the two packages, as ``site-packages`` would."""
    folder = tmp_path_factory.mktemp("site")
    for name in ("hooks", "attribution"):
        (folder / name).symlink_to(ROOT / name, target_is_directory=True)
    return folder


DOCS_JOB = """
def job(request):
    os.chdir(request["cwd"])
    sys.argv = sys.argv[:1]  # a block run as a script sees no arguments
    for where, block in json.load(open(request["listing"])):
        try:
            exec(compile(block, where, "exec"), {"__name__": "__main__"})  # a fresh namespace per block
        except BaseException:
            print(json.dumps({"where": where, "error": traceback.format_exc()[-3000:]}))
            return 1
    return 0
"""

PAGES = sorted({where.split(":")[0] for where, _ in BLOCKS})


@pytest.fixture(scope="module")
def zygote(packages: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """The interpreter the pages' processes are forked from (the import path: the two packages only)."""
    threads = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"  # a core of its own under pytest-xdist
    env = {**os.environ, "PYTHONPATH": str(packages), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": threads}
    started = Zygote(DOCS_JOB, env, tmp_path_factory.mktemp("zygote"))
    yield started
    started.close()


@pytest.mark.parametrize("page", PAGES)
def test_blocks_run_on_their_own(page: str, zygote: Zygote, tmp_path: Path):
    """The page's blocks, in order, in one fresh process, each in a namespace of its own."""
    blocks = [(where, code) for where, code in BLOCKS if where.split(":")[0] == page]
    for where, code in blocks:
        assert not re.search(r"^\s*(from|import) tests\b", code, re.MULTILINE), f"{where} imports from tests/"
        for module in NEEDS:
            if re.search(rf"^\s*(import|from) {module}\b", code, re.MULTILINE):
                pytest.importorskip(module)
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps(blocks))
    cwd = tmp_path / "work"
    cwd.mkdir()
    request = {"listing": str(listing), "cwd": str(cwd), "logs": str(tmp_path)}
    returncode, stdout, stderr = zygote.run(request, 900, f"the blocks of {page}")
    if returncode != 0:
        failure = json.loads(stdout.splitlines()[-1]) if stdout.strip() else {"where": page, "error": ""}
        code = dict(blocks).get(failure["where"], "")
        pytest.fail(f"{failure['where']} failed:\n{code}\n--- error ---\n{failure['error']}{stderr[-2000:]}")
