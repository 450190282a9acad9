"""Interpreters that import torch and the heavy extras once and run each job in a fork of themselves.

The docs' blocks (``tests/test_docs.py``) and the examples (``tests/test_examples.py``) each run in a fresh process;
importing torch, transformers, timm and matplotlib costs about 10 s of CPU per process. A zygote pays it once: it
imports them (and runs nothing else), then for each request forks a child that sends its output to files in the
request's ``logs`` folder, runs the job and exits with its code.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_LOOP = """
import json, os, sys, traceback

import torch, hooks, attribution  # imported once; nothing runs before a job's process is forked
for extra in ("matplotlib.pyplot", "transformers", "timm", "torchvision", "accelerate", "gguf", "sklearn"):
    try:
        __import__(extra)
    except ImportError:
        pass
try:
    import transformers
    transformers.LlamaForCausalLM, transformers.GPT2LMHeadModel, transformers.AutoTokenizer  # lazy modules
except ImportError:
    pass
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(request["logs"], name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            code = job(request)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class Zygote:
    """One zygote process; ``job`` is the source of a function ``job(request) -> exit code`` it runs in each fork."""

    def __init__(self, job: str, env: dict[str, str], cwd: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", job + _LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd,
            env=env,
        )  # fmt: skip
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def run(self, request: dict[str, Any], timeout: float, what: str) -> tuple[int, str, str]:
        """Exit code, stdout and stderr of the job run on ``request`` (which names its ``logs`` folder)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            self.process.kill()
            pytest.fail(f"{what} ran for over {timeout:.0f} s")
        code = int(self.process.stdout.readline())
        logs = Path(request["logs"])
        return code, (logs / "stdout").read_text(), (logs / "stderr").read_text()

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
