"""TackleBox's own test scripts and tutorial notebooks print the same hook log with only the import changed.

The six programs of TackleBox 1.0.3 (``tests/test.py``, ``test_multi_input.py``, ``test_remove_hook.py``,
``test_retain_forward_cache.py`` and the two "Hook Management" notebooks, as scripts) live in ``tests/data/tacklebox``,
ported to the CPU with small random models and synthetic data (their changed lines say ``port``). Their logs under
TackleBox 1.0.3 are stored beside them; here they run with ``hooks.tacklebox`` and must print the same.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # TackleBox's scripts run in fresh interpreters

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tacklebox"
SCRIPTS = [
    "test.py",
    "test_multi_input.py",
    "test_remove_hook.py",
    "test_retain_forward_cache.py",
    "hook_management_part_1.py",
    "hook_management_part_2.py",
]
NEEDS_TRANSFORMERS = {"test_multi_input.py", "hook_management_part_2.py"}
OURS = {
    "from tacklebox.hook_management import HookManager": "from hooks.tacklebox import HookManager",
    "from tacklebox.hooks.model_tracking import ModuleTracker": "from hooks.tacklebox import ModuleTracker",
}
RUNNER = """
import contextlib, io, json, runpy, sys, warnings

warnings.simplefilter("ignore")
logs = {}
for script in sys.argv[1:]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        runpy.run_path(script, run_name="__main__")
    logs[script] = buffer.getvalue()
print(json.dumps(logs))
"""


def _normalise(log: str) -> str:
    """Function addresses differ between runs; a mean printed as -0.00 on one CPU may be 0.00 on another."""
    return re.sub(r"-0\.00\b", "0.00", re.sub(r"0x[0-9a-f]+", "0x...", log))


def _run(scripts: list[str], tmp_path: Path, ours: bool) -> dict[str, str]:
    names = []
    for script in [*scripts, "_xlm.py"]:
        text = (DATA / script).read_text()
        if ours:
            for theirs, mine in OURS.items():
                text = text.replace(theirs, mine)
        (tmp_path / script).write_text(text)
        names.append(script)
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, *scripts], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    logs: dict[str, str] = json.loads(result.stdout.splitlines()[-1])
    return {name: _normalise(log) for name, log in logs.items()}


def _available() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [s for s in SCRIPTS if s not in NEEDS_TRANSFORMERS]
    return SCRIPTS


def test_ports_change_nothing_but_the_import_line():
    for script in SCRIPTS:
        text = (DATA / script).read_text()
        changed = text
        for theirs, mine in OURS.items():
            changed = changed.replace(theirs, mine)
        differing = [a for a, b in zip(text.splitlines(), changed.splitlines(), strict=True) if a != b]
        assert differing and all(line.strip() in OURS for line in differing), script


def test_tacklebox_scripts_print_the_logs_of_tacklebox(tmp_path):
    scripts = _available()
    logs = _run(scripts, tmp_path, ours=True)
    for script in scripts:
        expected = (DATA / "logs" / script.replace(".py", ".txt")).read_text()
        assert logs[script] == expected, script
        assert expected.strip()  # every script prints a log


@pytest.mark.peers
def test_tacklebox_itself_prints_the_stored_logs(tmp_path):
    """The stored logs are TackleBox's: rerun it where it is installed."""
    pytest.importorskip("tacklebox")
    scripts = _available()
    logs = _run(scripts, tmp_path, ours=False)
    for script in scripts:
        assert logs[script] == (DATA / "logs" / script.replace(".py", ".txt")).read_text(), script
