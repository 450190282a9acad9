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
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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


ZYGOTE = """
import json, os, sys, traceback

import torch, hooks, attribution  # imported once; nothing runs before a page's process is forked
for extra in ("matplotlib.pyplot", "transformers", "timm"):
    try:
        __import__(extra)
    except ImportError:
        pass
try:
    import transformers
    transformers.LlamaForCausalLM, transformers.GPT2LMHeadModel  # the lazy modules the blocks touch
except ImportError:
    pass
print("ready", flush=True)
for line in sys.stdin:
    listing, cwd, out = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chdir(cwd)
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = sys.argv[:1]  # a block run as a script sees no arguments
            for where, block in json.load(open(listing)):
                try:
                    exec(compile(block, where, "exec"), {"__name__": "__main__"})  # a fresh namespace per block
                except BaseException:
                    print(json.dumps({"where": where, "error": traceback.format_exc()[-3000:]}))
                    code = 1
                    break
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""

PAGES = sorted({where.split(":")[0] for where, _ in BLOCKS})


@pytest.fixture(scope="module")
def zygote(packages: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """The interpreter the pages' processes are forked from (the import path: the two packages only)."""
    threads = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"  # a core of its own under pytest-xdist
    env = {**os.environ, "PYTHONPATH": str(packages), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": threads}
    cwd = tmp_path_factory.mktemp("zygote")
    process = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    yield process
    process.kill()
    process.wait()


def _run_page(zygote: subprocess.Popen[str], listing: Path, cwd: Path) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of the page's blocks run in a process forked from the zygote."""
    assert zygote.stdin is not None and zygote.stdout is not None
    zygote.stdin.write(json.dumps([str(listing), str(cwd), str(listing.parent)]) + "\n")
    zygote.stdin.flush()
    if not select.select([zygote.stdout], [], [], 900)[0]:
        zygote.kill()
        pytest.fail(f"the blocks of {listing} ran for over 900 s")
    code = int(zygote.stdout.readline())
    return code, (listing.parent / "stdout").read_text(), (listing.parent / "stderr").read_text()


@pytest.mark.parametrize("page", PAGES)
def test_blocks_run_on_their_own(page: str, zygote: subprocess.Popen[str], tmp_path: Path):
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
    returncode, stdout, stderr = _run_page(zygote, listing, cwd)
    if returncode != 0:
        failure = json.loads(stdout.splitlines()[-1]) if stdout.strip() else {"where": page, "error": ""}
        code = dict(blocks).get(failure["where"], "")
        pytest.fail(f"{failure['where']} failed:\n{code}\n--- error ---\n{failure['error']}{stderr[-2000:]}")
