"""Start a script under ``torchrun`` on this machine for the tests that compare several processes with one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    """This process's environment without torchrun's variables, with the checkout importable and one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def torchrun(*args: str, processes: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=processes *args`` from the checkout's root; it must succeed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment(), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result
