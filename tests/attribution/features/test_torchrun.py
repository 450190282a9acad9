"""Two torchrun processes give the one-process report bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attribution.features import UnitReport, feature_statistics
from tests.attribution.features import _torchrun_worker as worker

from .test_statistics import assert_same

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_two_processes_merge_to_the_one_process_report_bitwise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", worker.__file__]
    result = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, ids, units = worker.setting()
        one = feature_statistics(model, ids, units, progress=False, **worker.OPTIONS)
    finally:
        torch.set_num_threads(threads)
    two = UnitReport.load(tmp_path / "two.report")
    assert_same(one, two)
    assert len(one.first.blocks) > 1  # 13 batches: more than one block, so the merge tree was really exercised
