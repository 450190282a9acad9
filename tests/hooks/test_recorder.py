"""Recorder: per-call records, detached copies, device, condition, reductions, counts, save/load, gradients."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn

from hooks import HookError, HookManager, Recorder, Recording
from tests.support import hook_state


def test_records_are_copies_taken_before_inplace_ops(tiny_cnn):
    x = torch.randn(2, 3, 8, 8)
    before = hook_state(tiny_cnn)
    with Recorder(tiny_cnn, ["features.0", "features.1"], capture=("input", "output")) as rec:
        tiny_cnn(x)
    assert hook_state(tiny_cnn) == before
    conv_out = tiny_cnn.features[0](x)
    # features.1 is ReLU(inplace=True): it overwrites conv's output; the records do not change
    torch.testing.assert_close(rec["features.0"].output, conv_out)
    assert (rec["features.0"].output < 0).any()
    torch.testing.assert_close(rec["features.1"].input, conv_out)
    torch.testing.assert_close(rec["features.1"].output, conv_out.clamp(min=0))
    assert rec["features.0"].output.grad_fn is None and not rec["features.0"].output.requires_grad


def test_one_record_per_call_in_call_order():
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), relu, nn.Linear(2, 2), relu)
    x = torch.randn(3, 2)
    with Recorder(model, relu) as rec:
        out = model(x)
    assert list(rec) == [("1", 0), ("1", 1)] and rec.calls("1") == [0, 1]
    torch.testing.assert_close(rec["1", 1].output, out)
    torch.testing.assert_close(rec["1", 0].output, relu(model[0](x)))
    with pytest.raises(KeyError, match=r"called 2 times per forward; ask for rec\['1', i\]"):
        rec["1"]
    with pytest.raises(KeyError, match=r"nothing was recorded for 'fc'"):
        rec["fc"]


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [
        ("last", lambda xs: xs[-1]),
        ("sum", lambda xs: sum(xs)),
        ("mean", lambda xs: sum(xs) / len(xs)),
        ("max", lambda xs: torch.stack(xs).amax(0)),
        ("min", lambda xs: torch.stack(xs).amin(0)),
        (lambda a, b: a * b, lambda xs: xs[0] * xs[1] * xs[2]),
    ],
)
def test_reductions_against_hand_computation(mlp, reduction, expected):
    inputs = [torch.randn(5, 4) for _ in range(3)]
    with Recorder(mlp, "0", reduction=reduction) as rec:
        for x in inputs:
            mlp(x)
    outs = [mlp[0](x).detach() for x in inputs]
    torch.testing.assert_close(rec["0"].output, expected(outs))
    assert rec.samples("0") == 3


def test_list_reduction_condition_and_device(mlp):
    flag = {"on": True}
    with Recorder(mlp, ["0", "2"], reduction="list", condition=lambda: flag["on"], device="meta") as rec:
        mlp(torch.randn(1, 4))
        flag["on"] = False
        mlp(torch.randn(1, 4))
        flag["on"] = True
        mlp(torch.randn(1, 4))
    assert rec["2"].samples == 2 and len(rec["2"].output) == 2
    assert all(t.device.type == "meta" for t in rec["0"].output)
    with pytest.raises(TypeError, match="called with no arguments"):
        Recorder(mlp, "0", condition=lambda x: True)
    with pytest.raises(ValueError, match="`capture` must be"):
        Recorder(mlp, "0", capture=("activations",))
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        Recorder(mlp, "0", reduction="median")


def test_gradients_match_autograd(mlp):
    x = torch.randn(3, 4, requires_grad=True)
    with Recorder(mlp, ["0", "2"], capture=("output", "grad_input", "grad_output"), reduction="sum") as rec:
        for _ in range(2):
            mlp(x).pow(2).sum().backward()
    h = mlp[0](x)
    y = mlp[2](mlp[1](h))
    g_y, g_h, g_x = torch.autograd.grad(y.pow(2).sum(), [y, h, x])
    torch.testing.assert_close(rec["2"].grad_output, 2 * g_y)
    torch.testing.assert_close(rec["0"].grad_output, 2 * g_h)
    torch.testing.assert_close(rec["0"].grad_input, 2 * g_x)
    assert rec["0"].grad_samples == 2 and rec["0"].samples == 2


def test_save_and_load_roundtrip(tmp_path):
    class Pair(nn.Module):
        def forward(self, x):
            return x.sin(), {"cos": x.cos()}

    model = nn.Sequential(nn.Linear(3, 3), Pair())
    with Recorder(model, ["0", "1"], capture=("input", "output"), reduction="list") as rec:
        model(torch.randn(2, 3))
        model(torch.randn(2, 3))
    rec.save(tmp_path / "rec")
    loaded = Recording.load(tmp_path / "rec")
    assert list(loaded) == list(rec)
    for key in rec:
        assert loaded[key].samples == rec[key].samples == 2
        for field in ("input", "output"):
            a, b = getattr(rec[key], field), getattr(loaded[key], field)
            torch.testing.assert_close(a, b)
    with pytest.raises(FileNotFoundError, match=r"index\.json is missing"):
        Recording.load(tmp_path)


def test_removed_recorder_keeps_records_and_hooks_nothing(mlp):
    before = hook_state(mlp)
    rec = Recorder(mlp, "**")
    mlp(torch.randn(1, 4))
    rec.remove()
    assert hook_state(mlp) == before
    mlp(torch.randn(1, 4))
    assert rec["0"].samples == 1 and len(rec) == 3
    rec.clear()
    assert len(rec) == 0


def test_same_as_torchfunc_recorders(mlp):
    recorders = pytest.importorskip("torchfunc.hooks.recorders")
    theirs = recorders.ForwardPre(reduction=lambda a, b: a + b)
    theirs.children(mlp, indices=(2,))
    outs = recorders.ForwardOutput()
    outs.modules(mlp, types=(nn.Linear,))
    with (
        Recorder(mlp, "2", capture="input", reduction=lambda a, b: a + b) as ours_in,
        Recorder(mlp, nn.Linear, reduction="list") as ours_out,
    ):
        for _ in range(3):
            mlp(torch.randn(5, 4))
    for h in theirs.handles + outs.handles:
        h.remove()
    torch.testing.assert_close(ours_in["2"].input, theirs[0])
    assert ours_in.samples("2") == theirs.samples(0) == 3
    for i, name in enumerate(["0", "2"]):
        assert len(ours_out[name].output) == len(outs[i]) == 3
        for a, b in zip(ours_out[name].output, outs[i], strict=True):
            # torchfunc keeps `outputs[0]`, which for a tensor output is only its first row; we keep the tensor
            torch.testing.assert_close(a[0], b)


def test_removed_recorder_is_not_kept_alive_by_a_shared_manager(mlp):
    mgr = HookManager(mlp)
    rec = Recorder(mlp, "0", manager=mgr)
    mlp(torch.randn(1, 4))
    rec.remove()
    ref = weakref.ref(rec)
    del rec
    gc.collect()
    assert ref() is None
    assert mgr.handles() == [] and mgr.groups == {}


def test_recorder_inside_vmap_raises_instead_of_leaking_a_batched_tensor(mlp):
    with Recorder(mlp, "0"), pytest.raises(HookError, match=r"torch\.func transform"):
        torch.func.vmap(mlp)(torch.randn(3, 4))
    assert hook_state(mlp) == hook_state(nn.Sequential(*mlp))


def _in_worker(fn) -> None:
    errors = []

    def run():
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=run, name="worker")
    worker.start()
    worker.join()
    assert not errors, errors


def test_recorder_for_a_model_run_in_a_worker_thread(mlp):
    x = torch.randn(2, 4)
    with Recorder(mlp, "0", threads="all") as rec:
        _in_worker(lambda: mlp(x))
    torch.testing.assert_close(rec["0"].output, mlp[0](x).detach())
    with Recorder(mlp, "0") as rec, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _in_worker(lambda: mlp(x))
        _in_worker(lambda: mlp(x))
    assert len(rec) == 0
    messages = [str(w.message) for w in caught if "thread" in str(w.message)]
    assert len(messages) == 1 and "threads='all'" in messages[0]  # said once, with the fix
    with Recorder(mlp, "0", threads="current"), warnings.catch_warnings():
        warnings.simplefilter("error")
        _in_worker(lambda: mlp(x))  # asked for per-thread recording: nothing to warn about
