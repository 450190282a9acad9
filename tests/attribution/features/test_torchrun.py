"""Two torchrun processes give the one-process report bit for bit."""

from __future__ import annotations

import pytest
import torch

from attribution.features import UnitReport, feature_statistics
from tests._torchrun import torchrun
from tests.attribution.features import _torchrun_worker as worker

from .test_statistics import assert_same


@pytest.mark.slow
def test_two_processes_merge_to_the_one_process_report_bitwise(tmp_path):
    torchrun(worker.__file__, str(tmp_path))
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
