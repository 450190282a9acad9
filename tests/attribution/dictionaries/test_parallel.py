"""train_dictionary under torchrun (two processes, gloo on the CPU) equals one process with the same global batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attribution.dictionaries import _parallel
from tests._torchrun import torchrun
from tests.attribution.dictionaries import _parallel_worker as worker


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """Every run of the worker in one torchrun start with two processes."""
    out = tmp_path_factory.mktemp("torchrun")
    torchrun(worker.__file__, str(out))
    return out


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the torchrun processes
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("share", [(5, 2), (1, 2), (0, 2), (7, 3), (4, 1)])
def test_shares_of_a_batch_are_contiguous_cover_it_once_and_differ_by_at_most_one_row(share):
    rows, world = share
    order = np.random.default_rng(0).permutation(rows)
    parts = [_parallel.share(order, rank, world) for rank in range(world)]
    assert np.array_equal(np.concatenate(parts), order)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(worker.RUNS))
def test_two_processes_equal_one_process_with_the_same_global_batch(two_processes, tmp_path, one_thread, name):
    """Two processes sum each step's gradient as two partial sums added, one process in one sum: the results differ
    by rounding, and by what Adam makes of it. A gradient that is zero in exact arithmetic (k = 1 at the initial
    ``W_enc = W_dec.T``: the error is orthogonal to the one active decoder row) is rounding noise, which Adam scales
    by ``lr / eps = 1e6``: in float64 that noise (1e-17) moves the "topk" run by up to 6.4e-12 (measured; the other
    float64 runs by at most 2.2e-16), held to 1e-10, far below the 1e-2 that one process's half of a batch alone
    would move it. In float32 that noise (1e-9, near Adam's eps) moves such a run by a whole step of 1e-2, so the
    float32 run uses k = 2, whose gradients are not zero: held to ``assert_close``'s float32 defaults (measured:
    1.2e-7)."""
    one = worker.run(name, tmp_path).state_dict()
    ranks = [torch.load(two_processes / name / f"final-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in one)  # every process made the same steps
    tolerance = {} if name.endswith("float32") else {"rtol": 0.0, "atol": 1e-10}
    for key, value in one.items():
        torch.testing.assert_close(ranks[0][key], value, **tolerance, msg=key)
    saved = torch.load(two_processes / name / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(saved["dictionary"][k], v) for k, v in ranks[0].items())  # the final checkpoint
    logs = [json.loads((two_processes / name / f"log-rank{r}.json").read_text()) for r in (0, 1)]
    assert logs[0]["checkpoints"] > 0 and logs[1]["checkpoints"] == 0  # rank 0 alone writes checkpoints
    assert not list((two_processes / name).glob("*.tmp-*"))


@pytest.mark.slow
def test_the_two_process_runs_exercise_what_differs_between_processes(two_processes, tmp_path, one_thread):
    """Guards for the equality test: AuxK ran, a process had no row, the thresholds and the recording were shared."""
    plan = json.loads((two_processes / "topk" / "training.json").read_text())
    assert plan["tokens"] % plan["batch_size"] == 1  # the last batch has one row: rank 1 gets none
    for name in ("topk", "batchtopk"):
        steps = json.loads((two_processes / name / "training.json").read_text())["steps"]
        for rank in (0, 1):
            assert json.loads((two_processes / name / f"log-rank{rank}.json").read_text())["auxk"] == steps, name
    batchtopk = torch.load(two_processes / "batchtopk" / "final-rank0.pt", weights_only=True)
    assert batchtopk["threshold"] > 0
    jumprelu = torch.load(two_processes / "jumprelu" / "final-rank0.pt", weights_only=True)
    assert (jumprelu["threshold"] != 0.01).all()  # every threshold moved from its start
    from attribution import open_results

    manifest = json.loads((two_processes / "recorded" / "activations" / "manifest.json").read_text())
    assert {s["rank"] for s in manifest["shards"]} == {0, 1}  # both processes recorded shards
    assert len(open_results(two_processes / "recorded" / "activations")) == 40
