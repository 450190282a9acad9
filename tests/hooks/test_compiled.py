"""``torch.compile`` wrappers are hooked through the module they wrap, or refused clearly; TorchScript is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks import HookError, HookManager, Recorder, module_names
from tests.support import hook_state


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("target", ["**", "0", ["0", "2"], nn.Linear])
def test_hooks_registered_before_the_first_call_record_under_the_eager_names(target):
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    with Recorder(compiled, target, capture=("output", "grad_output")) as rec:
        compiled(x).pow(2).sum().backward()
    assert module_names(compiled) == module_names(model) == ["", "0", "1", "2"]
    assert "0" in rec and not any(name.startswith("_orig_mod") for name in rec.names)
    torch.testing.assert_close(rec["0"].output, model[0](x).detach(), rtol=0, atol=0)
    assert rec["0"].grad_output is not None


def test_hooks_added_after_the_model_was_compiled_raise_instead_of_recording_nothing():
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    compiled(x)  # compiled without hooks: PyTorch does not guard on hooks added later
    before = hook_state(model)
    with pytest.raises(HookError, match=r"torch\.compile.*_orig_mod"), Recorder(compiled, "**"):
        compiled(x)
    assert hook_state(model) == before
    with Recorder(compiled._orig_mod, "**") as rec:  # the advice given: hook and call the original module
        compiled._orig_mod(x)
    assert rec.names == ["0", "1", "2"]


def test_a_name_of_the_wrapper_is_answered_with_the_eager_name():
    compiled = torch.compile(_mlp(), backend="eager")
    with pytest.raises(KeyError, match="did you mean '0'"):
        HookManager(compiled).group("g").forward("_orig_mod.0", lambda m, a, o: None)


@pytest.mark.parametrize("convert", ["script", "trace"])
def test_torchscript_models_are_refused_with_what_to_do(convert):
    model = _mlp()
    scripted = torch.jit.script(model) if convert == "script" else torch.jit.trace(model, torch.randn(1, 4))
    with pytest.raises(TypeError, match=r"TorchScript.*cannot call Python hooks.*eager"):
        Recorder(scripted, "0")


def test_a_scripted_submodule_of_an_eager_model_is_refused_by_name():
    model = _mlp()
    model[2] = torch.jit.script(model[2])
    before = hook_state(model)
    with pytest.raises(TypeError, match="`target` '2' is a TorchScript module"):
        Recorder(model, "**")
    assert hook_state(model) == before
