"""HookManager and HookGroup: targets, order, activation, cleanup, errors, copies, threads, compile."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from hooks import HookError, HookManager, ModuleNotFoundInModelError, module_names
from tests.support import hook_state


def _log(log: list, tag: str):
    def fn(module, args, output):
        log.append(tag)

    return fn


# -- targets ---------------------------------------------------------------------------------------------------
def test_targets_by_name_glob_object_type_and_list(resnet18):
    mgr = HookManager(resnet18)
    g = mgr.group("t")
    assert [h.module_name for h in g.forward("layer4.1.conv2", _log([], "a"))] == ["layer4.1.conv2"]
    relus = g.forward("layer*.0.relu", _log([], "b"))
    assert [h.module_name for h in relus] == [f"layer{i}.0.relu" for i in range(1, 5)]
    assert [h.module_name for h in g.forward(resnet18.fc, _log([], "c"))] == ["fc"]
    bns = g.forward(nn.BatchNorm2d, _log([], "d"))
    assert len(bns) == sum(isinstance(m, nn.BatchNorm2d) for m in resnet18.modules())
    assert [h.module_name for h in g.forward("layer*", _log([], "g"))] == [f"layer{i}" for i in range(1, 5)]
    every_relu = g.forward("**.relu", _log([], "h"))
    assert [h.module_name for h in every_relu] == ["relu"] + [f"layer{i}.{j}.relu" for i in range(1, 5) for j in (0, 1)]
    assert len(g.forward("**", _log([], "i"))) == len(list(resnet18.modules())) - 1  # all but the model itself
    assert [h.module_name for h in g.forward("layer[!23].?.conv[1]", _log([], "j"))] == [
        "layer1.0.conv1",
        "layer1.1.conv1",
        "layer4.0.conv1",
        "layer4.1.conv1",
    ]
    mixed = g.forward(["conv1", resnet18.layer1, nn.AdaptiveAvgPool2d], _log([], "e"))
    assert [h.module_name for h in mixed] == ["conv1", "layer1", "avgpool"]  # model order
    assert g.forward("", _log([], "f"))[0].module is resnet18
    mgr.remove_all()


def test_unknown_name_lists_close_matches(resnet18):
    mgr = HookManager(resnet18)
    with pytest.raises(ModuleNotFoundInModelError) as info:
        mgr.group("g").forward("layer4.1.conv4", _log([], "x"))
    message = str(info.value)
    assert "'layer4.1.conv4'" in message and "layer4.1.conv1" in message and "did you mean" in message
    assert isinstance(info.value, KeyError)
    with pytest.raises(KeyError, match=r"glob 'layer9\.\*' matches no module"):
        mgr.group("g").forward("layer9.*", _log([], "x"))
    assert hook_state(resnet18) == hook_state(copy.deepcopy(resnet18))


def test_module_outside_model_and_bad_targets(mlp):
    mgr = HookManager(mlp)
    with pytest.raises(ValueError, match="not part of the model"):
        mgr.group("g").forward(nn.Linear(2, 2), _log([], "x"))
    with pytest.raises(ValueError, match="no module of type Conv2d"):
        mgr.group("g").forward(nn.Conv2d, _log([], "x"))
    with pytest.raises(TypeError, match="module name, a glob, a module"):
        mgr.group("g").forward(3, _log([], "x"))
    with pytest.raises(ValueError, match="empty list"):
        mgr.group("g").forward([], _log([], "x"))
    with pytest.raises(TypeError, match="no model to look names up in"):
        HookManager().group("g").forward("0", _log([], "x"))
    assert module_names(mlp) == ["", "0", "1", "2"]


# -- order -----------------------------------------------------------------------------------------------------
def test_order_is_priority_then_registration_and_survives_reactivation(mlp):
    log: list[str] = []
    mgr = HookManager(mlp)
    low, high = mgr.group("low", priority=-1), mgr.group("high", priority=5)
    a = low.forward("0", _log(log, "low-a"))[0]
    mid = mgr.group("mid")
    mid.forward("0", _log(log, "mid-a"))
    high.forward("0", _log(log, "high-a"))
    mid.forward("0", _log(log, "mid-b"))
    mlp(torch.randn(1, 4))
    expected = ["high-a", "mid-a", "mid-b", "low-a"]
    assert log == expected
    assert [h.group.name for h in mgr.order("0")] == ["high", "mid", "mid", "low"]
    # TackleBox re-registers on activation and moves the hook to the end; here nothing moves
    mid.deactivate()
    a.deactivate()
    mid.activate()
    a.activate()
    log.clear()
    mlp(torch.randn(1, 4))
    assert log == expected
    mgr.remove_all()


def test_position_relative_to_pytorch_hooks(mlp):
    log: list[str] = []
    before = mlp[0].register_forward_hook(_log(log, "torch-before"))
    mgr = HookManager(mlp)
    mgr.group("g").forward("0", _log(log, "ours-1"))
    after = mlp[0].register_forward_hook(_log(log, "torch-after"))
    mgr.group("g").forward("0", _log(log, "ours-2"))  # joins our dispatcher, which keeps its place
    mlp(torch.randn(1, 4))
    assert log == ["torch-before", "ours-1", "ours-2", "torch-after"]
    mgr.remove_all()
    log.clear()
    mlp(torch.randn(1, 4))
    assert log == ["torch-before", "torch-after"]  # user hooks stay and keep firing
    before.remove()
    after.remove()


# -- what hooks can do -----------------------------------------------------------------------------------------
def test_forward_replaces_output_and_pre_replaces_args_and_kwargs():
    class Add(nn.Module):
        def forward(self, x, *, bias):
            return x + bias

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))
    model.add = Add()
    x = torch.randn(2, 3)
    with HookManager(model) as mgr:
        g = mgr.group("edit")
        g.forward("0", lambda m, args, out: out * 0)
        assert torch.equal(model[0](x), torch.zeros(2, 3))
        g.forward_pre("0", lambda m, args: args[0] * 0)  # a non-tuple becomes (x,)
        g.forward_pre("add", lambda m, args, kwargs: (args, {"bias": kwargs["bias"] + 1}), with_kwargs=True)
        assert torch.equal(model.add(x, bias=torch.ones(1)), x + 2)
        seen = {}
        g.forward("add", lambda m, a, kw, out: seen.update(kw), with_kwargs=True)
        model.add(x, bias=torch.zeros(1))
        assert torch.equal(seen["bias"], torch.ones(1))  # forward hooks see the edited kwargs


def test_name_and_call_keywords_count_calls_per_forward():
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), relu, nn.Linear(2, 2), relu)
    seen: list[tuple[str, int]] = []
    with HookManager(model) as mgr:
        mgr.group("g").forward(relu, lambda m, a, o, *, name, call: seen.append((name, call)))
        model(torch.randn(1, 2))
        model(torch.randn(1, 2))
    assert seen == [("1", 0), ("1", 1), ("1", 0), ("1", 1)]


def test_wrong_signature_and_duplicate_register_nothing(mlp):
    before = hook_state(mlp)
    mgr = HookManager(mlp)
    g = mgr.group("g")
    with pytest.raises(TypeError, match=r"called as fn\(module, args, output\)"):
        g.forward(["0", "2"], lambda module, args: None)
    with pytest.raises(TypeError, match="with_kwargs=True"):
        g.forward("0", lambda module, args, kwargs, output: None)
    with pytest.raises(TypeError, match=r"fn\(module, grad_input, grad_output\)"):
        g.backward("0", lambda module, grad: None)
    fn = _log([], "x")
    g.forward("2", fn)
    with pytest.raises(HookError, match="already a forward hook on '2'"):
        g.forward(["0", "2"], fn)  # "0" is fine, "2" is not: neither is registered
    assert [h.module_name for h in mgr.handles()] == ["2"]
    mgr.group("other").forward("2", fn)  # another group may hold the same function
    with pytest.raises(ModuleNotFoundInModelError):
        g.forward(["0", "nope"], _log([], "y"))
    assert [h.module_name for h in mgr.handles()] == ["2", "2"]
    mgr.remove_all()
    assert hook_state(mlp) == before


# -- cleanup ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_group_context_removes_on_error_and_interrupt(resnet18, error):
    before = hook_state(resnet18)
    mgr = HookManager(resnet18)

    def body():
        with mgr.group("ctx") as g:
            g.forward("*", _log([], "x"))
            g.backward("layer*", lambda m, gi, go: None)
            assert hook_state(resnet18) != before
            raise error("boom")

    with pytest.raises(error):
        body()
    assert mgr.handles() == []
    assert "ctx" not in mgr.groups
    assert hook_state(resnet18) == before
    removed = mgr.group("ctx2")
    removed.remove()
    with pytest.raises(HookError, match="was removed"):
        removed.forward("fc", _log([], "x"))


def test_removal_by_group_function_module_and_handle(mlp):
    before = hook_state(mlp)
    log: list[str] = []
    mgr = HookManager(mlp)
    f1, f2 = _log(log, "f1"), _log(log, "f2")
    g1, g2 = mgr.group("g1"), mgr.group("g2")
    g1.forward(["0", "2"], f1)
    h = g2.forward(["0", "2"], f2)
    g2.forward_pre("1", lambda m, a: None)
    mgr.remove_function(f1)
    assert {x.fn for x in mgr.handles()} == {f2, mgr.handles(kind="forward_pre")[0].fn}
    mgr.remove_module("1")
    assert mgr.handles(kind="forward_pre") == []
    h[0].remove()
    h[0].remove()  # idempotent
    assert [x.module_name for x in mgr.handles()] == ["2"]
    g2.remove()
    g2.remove()
    assert mgr.handles() == [] and hook_state(mlp) == before


def test_garbage_collected_manager_leaves_no_hook(resnet18):
    before = hook_state(resnet18)
    log: list[str] = []
    mgr = HookManager(resnet18)
    g = mgr.group("g")
    g.forward("*", _log(log, "x"))
    g.backward("layer1", lambda m, gi, go: None)
    g.forward_pre("fc", lambda m, a: None)
    mgr.self_ref = mgr  # a reference cycle, as user code often makes
    del mgr, g
    gc.collect()
    assert hook_state(resnet18) == before
    resnet18(torch.randn(1, 3, 32, 32))
    assert log == []


def test_deepcopy_pickle_and_torch_save_carry_no_hooks(tiny_cnn):
    before = hook_state(tiny_cnn)
    log: list[str] = []
    mgr = HookManager(tiny_cnn)
    mgr.group("g").forward("**", lambda m, a, o: log.append("x"))  # a lambda: unpicklable if it were carried
    mgr.group("g").backward("features.0", lambda m, gi, go: None)
    x = torch.randn(1, 3, 8, 8)
    copies = [copy.deepcopy(tiny_cnn), copy.copy(tiny_cnn), pickle.loads(pickle.dumps(tiny_cnn))]
    buffer = io.BytesIO()
    torch.save(tiny_cnn, buffer)
    buffer.seek(0)
    copies.append(torch.load(buffer, weights_only=False))
    for clone in copies[:1] + copies[2:]:
        assert hook_state(clone) == before
        log.clear()
        torch.testing.assert_close(clone(x), tiny_cnn(x))
        assert len(log) == len(list(tiny_cnn.modules())) - 1  # only the original's submodules fired
    assert hook_state(copies[1])[""] == before[""]  # a shallow copy shares the children, not our root hook
    mgr.remove_all()
    assert hook_state(tiny_cnn) == before


# -- threads ---------------------------------------------------------------------------------------------------
def test_activation_is_per_thread_by_default(mlp):
    seen: list[str] = []
    mgr = HookManager(mlp)
    g = mgr.group("local", threads="current")
    g.forward("0", lambda m, a, o: seen.append(threading.current_thread().name))
    shared = mgr.group("shared", threads="all")
    shared.forward("2", lambda m, a, o: seen.append("shared:" + threading.current_thread().name))
    barrier = threading.Barrier(2)

    def run(name: str) -> None:
        barrier.wait()
        for _ in range(20):
            mlp(torch.randn(1, 4))

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "A" not in seen and "B" not in seen  # registered (and active) only in the main thread
    assert seen.count("shared:A") == 20 and seen.count("shared:B") == 20
    seen.clear()

    def activate_and_run() -> None:
        g.activate()
        mlp(torch.randn(1, 4))

    worker = threading.Thread(target=activate_and_run, name="C")
    worker.start()
    worker.join()
    mlp(torch.randn(1, 4))
    assert seen.count("C") == 1 and seen.count("MainThread") == 1
    mgr.remove_all()


def test_concurrent_threads_see_only_their_own_group(mlp):
    mgr = HookManager(mlp)
    results: dict[str, list[torch.Tensor]] = {"scale": [], "zero": []}
    errors: list[BaseException] = []
    x = torch.randn(3, 4)
    plain = mlp(x)

    def worker(tag: str, fn) -> None:
        try:
            group = mgr.group(tag, threads="current")
            group.forward("2", fn)
            for _ in range(50):
                results[tag].append(mlp(x))
            group.deactivate()
            results[tag].append(mlp(x))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    a = threading.Thread(target=worker, args=("scale", lambda m, a, o: o * 3))
    b = threading.Thread(target=worker, args=("zero", lambda m, a, o: o * 0))
    a.start()
    b.start()
    a.join()
    b.join()
    assert not errors
    assert all(torch.allclose(y, plain * 3) for y in results["scale"][:-1])
    assert all(torch.equal(y, torch.zeros_like(plain)) for y in results["zero"][:-1])
    assert torch.allclose(results["scale"][-1], plain) and torch.allclose(results["zero"][-1], plain)
    mgr.remove_all()


# -- lookup ----------------------------------------------------------------------------------------------------
def test_handles_filters_and_table(mlp):
    mgr = HookManager(mlp)
    f = _log([], "f")
    mgr.group("a", priority=2).forward(["0", "2"], f)
    b = mgr.group("b")
    b.backward("0", lambda m, gi, go: None, activate=False)
    assert len(mgr.handles(group="a")) == 2 and len(mgr.handles(group=b)) == 1
    assert [h.module_name for h in mgr.handles(module="0")] == ["0", "0"]
    assert [(h.module_name, h.fn) for h in mgr.handles(fn=f, module="2")] == [("2", f)]
    assert mgr.handles(active=False)[0].kind == "backward"
    table = mgr.table()
    assert table.splitlines()[0].split() == ["group", "priority", "kind", "module", "function", "state", "#"]
    assert "inactive" in table and table.count("\n") == 3
    assert "3 hook(s)" in repr(mgr)
    mgr.remove_all()


# -- torch.compile ---------------------------------------------------------------------------------------------
def test_groups_on_compiled_model_without_recompiling(mlp):
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    compiled = torch.compile(mlp, backend="eager")
    x = torch.randn(2, 4)
    plain = mlp(x)
    mgr = HookManager(mlp)
    g = mgr.group("g")
    g.forward("2", lambda m, a, o: o + 1)  # registered before the compiled model's first call
    torch.testing.assert_close(compiled(x), plain + 1)
    frames_after_first = counters["frames"]["total"]
    for _ in range(3):
        g.deactivate()
        torch.testing.assert_close(compiled(x), plain)
        g.activate()
        torch.testing.assert_close(compiled(x), plain + 1)
    extra = mgr.group("extra")
    extra.forward("0", lambda m, a, o: o * 0)  # a later group on another module is seen as well
    torch.testing.assert_close(compiled(x), mlp[2](mlp[1](torch.zeros(2, 8))))
    extra.remove()
    g.remove()
    torch.testing.assert_close(compiled(x), plain)
    assert counters["frames"]["total"] <= frames_after_first + 2  # no recompilation per call
    dynamo.reset()


def test_each_dispatcher_sits_where_the_manager_first_needed_it(mlp):
    log = []
    mgr = HookManager(mlp)
    mgr.group("g").forward("0", lambda m, a, o: log.append("mgr forward 1"))
    raw_pre = mlp[0].register_forward_pre_hook(lambda m, a: log.append("raw pre"))
    raw_forward = mlp[0].register_forward_hook(lambda m, a, o: log.append("raw forward"))
    mgr.group("g").forward_pre("0", lambda m, a: log.append("mgr pre"))  # the first pre-hook: after "raw pre"
    mgr.group("g").forward("0", lambda m, a, o: log.append("mgr forward 2"))  # joins the forward dispatcher
    mlp(torch.randn(1, 4))
    assert log == ["raw pre", "mgr pre", "mgr forward 1", "mgr forward 2", "raw forward"]
    raw_pre.remove()
    raw_forward.remove()
    mgr.remove_all()


def test_group_lookup_and_unhashable_callables(mlp):
    mgr = HookManager(mlp)
    shared = mgr.group("shared", threads="all", priority=3)
    assert mgr.group("shared") is shared

    @dataclass
    class Hook:  # a dataclass with eq=True is unhashable
        seen: list

        def __call__(self, module, args, output):
            self.seen.append(module)

    hook = Hook([])
    shared.forward(["0", "2"], hook)
    mlp(torch.randn(1, 4))
    assert len(hook.seen) == 2
    mgr.remove_function(hook)
    assert mgr.handles() == []
    mgr.remove_all()


def test_shared_module_answers_to_every_path():
    torch.manual_seed(0)
    block = nn.Linear(2, 2)
    model = nn.Sequential()
    model.a, model.b = nn.Sequential(block), nn.Sequential(block)
    with HookManager(model) as mgr:
        (handle,) = mgr.group("g").forward("b.0", lambda m, a, o: None)
    assert handle.module is block and handle.module_name == "b.0"  # named by the path it was asked by


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
