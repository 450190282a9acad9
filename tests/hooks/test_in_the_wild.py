"""Hostile but ordinary settings: each test here failed on the hooks core before it was rewritten (issue 10)."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hooks import HookError, HookManager, Recorder
from tests.conftest import hook_state


def _grads(model: nn.Module, x: torch.Tensor, loss) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = model(x)
    loss(out).backward()
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def _bitwise(a: list, b: list) -> bool:
    return all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a, b, strict=True)
    )


# -- observing never changes the computation ------------------------------------------------------------------------
class WritesIntoOutput(nn.Module):
    """The caller writes into the output of an identity-like module and relies on the write reaching its input."""

    def __init__(self, inner: nn.Module, flat: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner
        self.flat = flat

    def forward(self, x):
        y = self.lin(x)
        z = self.inner(y)
        z.mul_(2)  # reaches y when z shares y's memory
        return (y * y).sum(-1) + z.sum(-1)


@pytest.mark.parametrize(
    "inner", [nn.Identity(), nn.Dropout(0.5).eval(), nn.Flatten(0, -1)], ids=["Identity", "Dropout-eval", "Flatten"]
)
def test_observing_an_identity_like_module_keeps_writes_to_its_output(inner):
    torch.manual_seed(0)
    model = WritesIntoOutput(inner)
    x = torch.randn(3, 4)
    out_ref, grads_ref = _grads(model, x, lambda o: o.sum())
    with Recorder(model, "inner", capture=("output", "grad_output", "grad_input")):
        with pytest.warns(RuntimeWarning, match="then modified in place"):
            out, grads = _grads(model, x, lambda o: o.sum())
    assert torch.equal(out, out_ref)  # the write reached the input, as without the recorder
    if isinstance(inner, nn.Flatten):
        assert _bitwise(grads, grads_ref)
    else:
        # Without hooks, the caller's write lands on its own tensor; with a per-call alias it is a write through a
        # view, and autograd adds the same gradient terms in another order: equal up to float rounding.
        for got, ref in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=4 * torch.finfo(ref.dtype).eps * ref.abs().max().item())


def test_identity_output_used_out_of_place_gets_its_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Identity(), nn.Tanh())
    x = torch.randn(2, 3)
    out_ref, grads_ref = _grads(model, x, lambda o: o.pow(2).sum())
    with Recorder(model, "1", capture=("grad_input", "grad_output")) as rec:
        out, grads = _grads(model, x, lambda o: o.pow(2).sum())
    assert torch.equal(out, out_ref) and _bitwise(grads, grads_ref)
    h = model[0](x)
    expected = 2 * torch.tanh(h) * (1 - torch.tanh(h) ** 2)
    torch.testing.assert_close(rec["1"].grad_output, expected.detach())
    torch.testing.assert_close(rec["1"].grad_input, expected.detach())


def test_multihead_self_attention_is_bitwise_equal_with_a_backward_recorder():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)

    def run():
        mha.zero_grad(set_to_none=True)
        q = x.clone().requires_grad_(True)
        out = mha(q, q, q)[0]  # `query is key is value` selects a packed projection
        out.pow(2).sum().backward()
        return out.detach(), [q.grad] + [p.grad for p in mha.parameters()]

    out_ref, grads_ref = run()
    with Recorder(mha, "", capture=("grad_input", "grad_output")) as rec:
        out, grads = run()
    assert torch.equal(out, out_ref) and _bitwise(grads, grads_ref)
    q_grad, k_grad, v_grad = rec[""].grad_input  # one tensor passed three times: its gradient once, at the first
    assert torch.equal(q_grad, grads_ref[0]) and not k_grad.any() and not v_grad.any()


def test_observing_every_module_of_common_models_changes_nothing(resnet18):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
    lstm = nn.Sequential()
    lstm.rnn = nn.LSTM(4, 6, batch_first=True)
    for model, x, loss in [
        (resnet18, torch.randn(2, 3, 32, 32), lambda o: o.logsumexp(-1).sum()),
        (vit, torch.randn(2, 3, 32, 32), lambda o: o.pow(2).sum()),
        (lstm, torch.randn(2, 5, 4), lambda o: o[0].sum() + o[1][0].pow(2).sum()),
    ]:
        before = hook_state(model)
        runs = []
        for observe in (False, True):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            fields = ("input", "output", "grad_input", "grad_output")
            with Recorder(model, "**", capture=fields) if observe else contextlib.nullcontext():
                out = model(xi)
                loss(out).backward()
            runs.append((torch.utils._pytree.tree_leaves(out), [xi.grad] + [p.grad for p in model.parameters()]))
        (outs_ref, grads_ref), (outs, grads) = runs
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(outs_ref, outs, strict=True))
        assert _bitwise(grads, grads_ref), type(model).__name__
        assert hook_state(model) == before


# -- gradient checkpointing ---------------------------------------------------------------------------------------
class Checkpointed(nn.Module):
    """One block run twice, each time in its own checkpointed segment."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        self.reentrant = reentrant

    def forward(self, x):
        for _ in range(2):
            x = self.block(x) if self.reentrant is None else checkpoint(self.block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_calls_are_the_calls_they_replay(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    plain = Checkpointed(None)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, requires_grad=True)

    def run(m):
        log = []
        with Recorder(m, ["block", "block.1"], capture=("output", "grad_output")) as rec, HookManager(m) as mgr:
            mgr.group("g").backward("block", lambda mod, gi, go, *, call: log.append(call))
            m(x).pow(2).sum().backward()
        return rec, log

    rec_ref, log_ref = run(plain)
    rec, log = run(model)
    assert log == log_ref == [1, 0]  # each call's backward hook once, with its own index
    assert sorted(rec) == sorted(rec_ref) == [("block", 0), ("block", 1), ("block.1", 0), ("block.1", 1)]
    for key in rec:
        assert rec[key].samples == 1 and rec[key].grad_samples == 1, key  # not recorded again on recomputation
        torch.testing.assert_close(rec[key].output, rec_ref[key].output, rtol=0, atol=0)
        torch.testing.assert_close(rec[key].grad_output, rec_ref[key].grad_output)


def test_checkpointing_replays_call_dependent_edits_with_the_original_call():
    """A hook that edits call 1 only must edit the recomputed call 1, or the gradients would be wrong."""
    torch.manual_seed(0)
    model = Checkpointed(False)
    plain = Checkpointed(None)
    plain.load_state_dict(model.state_dict())

    def edit(module, args, output, *, call):
        return output * 3 if call == 1 else None

    grads = []
    for m in (plain, model):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with HookManager(m) as mgr:
            mgr.group("edit").forward("block.0", edit)
            m(x).pow(2).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_timm_gradient_checkpointing_records_once():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    x = torch.randn(1, 3, 32, 32)
    results = []
    for on in (False, True):
        vit.set_grad_checkpointing(on)
        vit.train()  # timm checkpoints only in training mode
        vit.zero_grad(set_to_none=True)
        with Recorder(vit, "blocks.*.attn", capture=("output", "grad_output")) as rec:
            vit(x).sum().backward()
        results.append(rec)
    plain, ckpt = results
    assert list(ckpt) == list(plain)
    for key in ckpt:
        assert ckpt[key].samples == 1 and ckpt[key].grad_samples == 1
        torch.testing.assert_close(ckpt[key].grad_output, plain[key].grad_output)


# -- outputs and transforms ---------------------------------------------------------------------------------------
@dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class ReturnsDataclass(nn.Module):
    def __init__(self, factory) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.factory = factory

    def forward(self, x):
        y = self.lin(x)
        return self.factory(y, 3 * y)


def _factories():
    yield "dataclass", lambda a, b: Pair(a, b), lambda o: (o.a, o.b)
    transformers = pytest.importorskip("transformers.modeling_outputs")
    yield (
        "ModelOutput",
        lambda a, b: transformers.BaseModelOutput(last_hidden_state=a, hidden_states=(b,)),
        lambda o: (o.last_hidden_state, o.hidden_states[0]),
    )


@pytest.mark.parametrize("kind", ["dataclass", "ModelOutput"])
def test_dataclass_outputs_are_recorded_as_copies_with_gradients(kind):
    _, factory, parts = {f[0]: f for f in _factories()}[kind]
    torch.manual_seed(0)
    model = nn.Sequential()
    model.m = ReturnsDataclass(factory)
    x = torch.randn(4, 2)
    with Recorder(model, "m", capture=("output", "grad_output")) as rec:
        out = model(x)
        a, b = parts(out)
        (a.pow(2).sum() + b.sum()).backward()
    rec_a, _ = parts(rec["m"].output)
    assert rec_a is not a and not rec_a.requires_grad and torch.equal(rec_a, a.detach())
    grad_a, grad_b = rec["m"].grad_output
    torch.testing.assert_close(grad_a, 2 * a.detach())
    torch.testing.assert_close(grad_b, torch.ones_like(b))


def test_recorder_inside_vmap_raises_instead_of_leaking_a_batched_tensor(mlp):
    with Recorder(mlp, "0"), pytest.raises(HookError, match=r"torch\.func transform"):
        torch.func.vmap(mlp)(torch.randn(3, 4))
    assert hook_state(mlp) == hook_state(nn.Sequential(*mlp))


# -- interrupted and failing runs -----------------------------------------------------------------------------------
class Interruptible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.act = nn.ReLU()
        self.interrupt = False

    def forward(self, x):
        x = self.act(self.lin(x))
        if self.interrupt:
            raise KeyboardInterrupt
        return self.act(x)


def test_call_numbers_restart_after_a_keyboard_interrupt():
    model = Interruptible()
    calls = []
    mgr = HookManager(model)
    mgr.group("g").forward("act", lambda m, a, o, *, call: calls.append(call))
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(1, 2))
    model.interrupt = False
    model(torch.randn(1, 2))
    model(torch.randn(1, 2))
    assert calls == [0, 0, 1, 0, 1]
    mgr.remove_all()


def test_call_numbers_of_a_recursive_model_are_not_restarted_by_its_inner_call():
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x, depth=1):
            x = self.lin(x)
            return x if depth == 0 else self(x, depth - 1)

    model, calls = Recursive(), []
    with HookManager(model) as mgr:
        mgr.group("g").forward("lin", lambda m, a, o, *, call: calls.append(call))
        model(torch.randn(1, 2))
        model(torch.randn(1, 2))
    assert calls == [0, 1, 0, 1]


def test_a_group_removing_itself_from_its_own_hook_leaves_numbering_intact():
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), relu, relu)
    mgr = HookManager(model)
    group = mgr.group("once")
    group.forward("1", lambda m, a, o: group.remove())  # the manager's only group: the model's hooks go too
    model(torch.randn(1, 2))
    calls = []
    mgr.group("later").forward("1", lambda m, a, o, *, call: calls.append(call))
    model(torch.randn(1, 2))
    model(torch.randn(1, 2))
    assert calls == [0, 1, 0, 1]
    mgr.remove_all()


def test_a_backward_hook_that_raised_fires_again_on_the_next_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    x = torch.randn(3, 2, requires_grad=True)
    calls = []

    def flaky(module, grad_input, grad_output):
        calls.append(grad_output[0].clone())
        if len(calls) == 1:
            raise ValueError("boom")

    with HookManager(model) as mgr:
        mgr.group("g").backward("1", flaky)  # fires before the recorder's hook on the same module
        with Recorder(model, "1", capture=("grad_output",), reduction="list", manager=mgr) as rec:
            loss = model(x).pow(2).sum()
            with pytest.raises(ValueError, match="boom"):
                loss.backward(retain_graph=True)
            loss.backward(retain_graph=True)
            loss.backward()
    assert len(calls) == 3 and torch.equal(calls[1], calls[2])
    assert len(rec["1"].grad_output) == 2  # the aborted pass is lost, the two after it are recorded


def test_deactivating_between_forward_and_backward_stops_the_backward_hook():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    fired = []
    with HookManager(model) as mgr:
        group = mgr.group("g")
        group.backward("1", lambda m, gi, go: fired.append(1))
        loss = model(torch.randn(1, 2, requires_grad=True)).sum()
        group.deactivate()
        loss.backward()
        assert fired == []
        group.activate()
        model(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert fired == [1]


# -- threads --------------------------------------------------------------------------------------------------------
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


# -- copies ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["weight_norm", "orthogonal"])
def test_deepcopy_of_a_hooked_parametrized_module_carries_no_hooks(how):
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    lin = getattr(parametrizations, how)(nn.Linear(3, 3))
    model = nn.Sequential(lin, nn.Tanh())
    fired = []
    with HookManager(model) as mgr:
        mgr.group("g").forward(["0", ""], lambda m, a, o: fired.append(m))
        replica = copy.deepcopy(model)
        lone = copy.deepcopy(lin)
        replica(torch.randn(1, 3))
        lone(torch.randn(1, 3))
        assert fired == []
        model(torch.randn(1, 3))
        assert len(fired) == 2
    for m in (*replica.modules(), lone):
        assert not any(type(h).__module__.startswith("hooks") for h in m._forward_hooks.values())
        assert "__getstate__" not in m.__dict__ and "__deepcopy__" not in m.__dict__
    assert hook_state(model) == hook_state(replica)


# -- misuse that must not pass silently ---------------------------------------------------------------------------
def test_entering_a_group_inside_its_own_with_block_is_an_error(mlp):
    seen = []
    with HookManager(mlp) as mgr:
        group = mgr.group("g")
        group.forward("0", lambda m, a, o: seen.append(1))
        with group:
            with pytest.raises(HookError, match="already used by an enclosing `with` block"):
                with group:
                    pass
            mlp(torch.randn(1, 4))
        assert group.removed and seen == [1]


def test_one_module_under_two_names_is_an_error_not_a_silent_merge():
    shared = nn.Linear(2, 2)
    model = nn.Sequential()
    model.a, model.b = shared, shared
    with HookManager(model) as mgr:
        with pytest.raises(ValueError, match=r"'a' and 'b', which are the same module"):
            mgr.group("g").forward(["a", "b"], lambda m, a, o: None)
        assert mgr.handles() == []
        (handle,) = mgr.group("g").forward("**", lambda m, a, o: None)  # a glob reaches it once, by its first name
        assert handle.module_name == "a"


def test_errors_name_the_group_and_the_module(mlp):
    with HookManager(mlp) as mgr:
        with pytest.raises(TypeError, match=r"group 'probe' on '2'.*fn\(module, args, output\)"):
            mgr.group("probe").forward("2", lambda module, args: None)
        mgr.group("edit").forward_pre("0", lambda m, a, k: 5, with_kwargs=True)
        with pytest.raises(HookError, match=r"forward pre-hook '.*<lambda>' of group 'edit' on '0'.*got int"):
            mlp(torch.randn(1, 4))


def test_registering_one_module_at_a_time_does_not_rescan_the_model(monkeypatch):
    model = nn.Sequential(*[nn.Identity() for _ in range(300)])
    scans = []
    original = nn.Module.named_modules

    def counting(self, *args, **kwargs):
        if self is model:
            scans.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", counting)
    with HookManager(model) as mgr:
        group = mgr.group("g")
        for i in range(300):
            group.forward(str(i), lambda m, a, o: None)
        for module in list(model)[:100]:
            group.forward_pre(module, lambda m, a: None)
    assert len(scans) <= 2  # by name: no scan at all; by object: one table, reused


def test_importing_hooks_does_not_import_dynamo():
    code = "import sys, hooks, attribution; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
