"""Every code example of TackleBox's README, unchanged but for the import line, and what it should do.

The README's snippets are copied as they are (marked ``# README``); the lines around them set up the modules the
snippets refer to and check the outcome.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hooks.tacklebox import HookManager  # README: `from tacklebox.hook_management import HookManager`
from tests.support import hook_state


# README: the hook functions of "Defining hooks"
def my_forward_hook(module, inputs, outputs):
    print('Finished forward pass for module %s' % module.name)
    return outputs


def my_forward_pre_hook(module, inputs):
    print('Beginning forward pass for module %s' % module.name)
    return inputs


def my_backward_hook(module, grad_in, grad_out):
    print('Finished backward pass for module %s' % module.name)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _run(net):
    x = torch.randn(5, 3, requires_grad=True)
    out = net(x)
    out.sum().backward()
    return x, out


def test_registering_hooks(net, capsys):
    my_module, other_module = net[0], net[2]
    more_named_modules = {"third_module": net[1]}
    before = hook_state(net)
    # README ------------------------------------------------------------------------------------------------
    hookmngr = HookManager()

    # register a forward hook on my_module, other_module, etc.
    hookmngr.register_forward_hook(my_forward_hook,
                                   my_module_name=my_module,
                                   other_module_name=other_module,
                                   **more_named_modules)

    # register a forward pre-hook on my_module, other_module, etc.
    hookmngr.register_forward_pre_hook(my_forward_pre_hook,
                                       my_module_name=my_module,
                                       other_module_name=other_module,
                                       **more_named_modules)

    # register a backward hook on my_module, other_module, etc.
    hookmngr.register_backward_hook(my_backward_hook,
                                    my_module_name=my_module,
                                    other_module_name=other_module,
                                    **more_named_modules)
    # -------------------------------------------------------------------------------------------------------
    x, out = _run(net)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "Beginning forward pass for module my_module_name", "Finished forward pass for module my_module_name",
        "Beginning forward pass for module third_module", "Finished forward pass for module third_module",
        "Beginning forward pass for module other_module_name", "Finished forward pass for module other_module_name",
        "Finished backward pass for module other_module_name", "Finished backward pass for module third_module",
        "Finished backward pass for module my_module_name",
    ]
    hookmngr.cleanup()
    assert hook_state(net) == before  # module.name, set for TackleBox-style hooks, is gone too
    torch.testing.assert_close(net(x), out)  # hooks that return their inputs/outputs change nothing


def test_activating_hooks_and_filters(net, capsys):
    my_module, other_module = net[0], net[2]
    more_modules: list[nn.Module] = []
    hookmngr = HookManager()
    # README ------------------------------------------------------------------------------------------------
    hookmngr.register_forward_hook(my_forward_hook, my_module_name=my_module,
                                   activate=False)
    # -------------------------------------------------------------------------------------------------------
    hookmngr.register_forward_pre_hook(my_forward_pre_hook, my_module_name=my_module, other_module_name=other_module)
    hookmngr.deactivate_all_hooks()

    def fired():
        net(torch.randn(1, 3))
        return capsys.readouterr().out.count("\n")

    assert fired() == 0
    # README ------------------------------------------------------------------------------------------------
    # activate/deactivate all hooks
    hookmngr.activate_all_hooks()
    # -------------------------------------------------------------------------------------------------------
    assert fired() == 3
    hookmngr.deactivate_all_hooks()
    assert fired() == 0
    # README ------------------------------------------------------------------------------------------------
    # filter by module:
    # activate/deactivate all hooks registered to my_module, other_module, etc.
    hookmngr.activate_module_hooks(my_module, other_module, *more_modules)
    # -------------------------------------------------------------------------------------------------------
    assert fired() == 3
    hookmngr.deactivate_module_hooks(my_module, other_module, *more_modules)
    assert fired() == 0
    # README ------------------------------------------------------------------------------------------------
    # filter by function:
    # activate/deactivate my_forward_hook on all modules it's been registered with
    hookmngr.activate_all_hook(hook_types=[my_forward_hook])
    # -------------------------------------------------------------------------------------------------------
    assert capsys.readouterr().out == "" and fired() == 1
    hookmngr.deactivate_all_hooks(hook_types=[my_forward_hook])
    assert fired() == 0
    # README ------------------------------------------------------------------------------------------------
    # filter by hook category
    # activate/deactivate all forward hooks that have been registered
    hookmngr.activate_all_hooks(category='forward_hook')
    # -------------------------------------------------------------------------------------------------------
    assert fired() == 1
    hookmngr.deactivate_all_hooks(category='forward_hook')
    assert fired() == 0
    hookmngr.activate_module_hooks(my_module, category="forward_pre_hook", hook_types=[my_forward_pre_hook])
    assert fired() == 1
    with pytest.raises(ValueError, match="`category` must be one of"):
        hookmngr.activate_all_hooks(category="forward")
    hookmngr.cleanup()


def test_contexts(net, capsys):
    my_module, other_module = net[0], net[2]
    more_modules = [net[1]]
    hookmngr = HookManager()
    hookmngr.register_forward_hook(my_forward_hook, my_module=my_module, other_module=other_module,
                                   third=net[1], activate=False)
    # README ------------------------------------------------------------------------------------------------
    with hookmngr.hook_all_context():
        # all hooks active
        ...
    # all hooks inactive
    # -------------------------------------------------------------------------------------------------------
        net(torch.randn(1, 3))
    net(torch.randn(1, 3))
    assert capsys.readouterr().out.count("Finished") == 3
    # README ------------------------------------------------------------------------------------------------
    with hookmngr.hook_module_context(my_module, other_module, *more_modules):
        # hooks on my_module, other_module, etc. are active
        ...
    # hooks on my_module, other_module, etc. are inactive
    # -------------------------------------------------------------------------------------------------------
        net(torch.randn(1, 3))
    net(torch.randn(1, 3))
    assert capsys.readouterr().out.count("Finished") == 3
    with pytest.raises(RuntimeError), hookmngr.hook_module_context(my_module):
        raise RuntimeError
    net(torch.randn(1, 3))
    assert capsys.readouterr().out == ""  # deactivated on the way out of an exception
    hookmngr.cleanup()


def test_hook_function_and_handle_objects(net, capsys):
    my_module = net[0]
    hookmngr = HookManager()
    hookmngr.register_forward_hook(my_forward_hook, my_module=my_module)
    hook_function = hookmngr.function_to_hookfn[my_forward_hook]
    # README ------------------------------------------------------------------------------------------------
    # access the HookHandle obtained from registering hook_function on my_module
    hook_handle = hook_function.module_to_handle[my_module]

    hook_handle.module  #  = my_module
    hook_handle.hook_fn  # = hook_function

    # activate/deactivate hook_function for my_module
    hook_handle.activate()
    hook_handle.deactivate()
    # -------------------------------------------------------------------------------------------------------
    assert hook_handle.module is my_module and hook_handle.hook_fn is hook_function
    net(torch.randn(1, 3))
    assert capsys.readouterr().out == ""
    hook_handle.activate()
    net(torch.randn(1, 3))
    assert capsys.readouterr().out == "Finished forward pass for module my_module\n"
    assert hook_function.name == repr(my_forward_hook)  # the default id, as in TackleBox
    hookmngr.cleanup()


def test_lookup_tables(net):
    my_module = net[0]
    hookmngr = HookManager()
    # README ------------------------------------------------------------------------------------------------
    hookmngr.register_forward_hook(my_forward_hook, hook_fn_name='my_forward_hook')
    # -------------------------------------------------------------------------------------------------------
    hookmngr.register_forward_hook(my_forward_hook, my_module=my_module)
    assert (
        # README --------------------------------------------------------------------------------------------
        hookmngr.name_to_module['my_module']
        # ---------------------------------------------------------------------------------------------------
        is my_module
    )
    assert (
        # README --------------------------------------------------------------------------------------------
        hookmngr.name_to_hookfn['my_forward_hook']
        # ---------------------------------------------------------------------------------------------------
        .function is my_forward_hook
    )
    # README ------------------------------------------------------------------------------------------------
    # access the HookHandle obtained from registering my_forward_hook on my_module
    hookmngr.name_to_hookhandle['my_forward_hook[my_module]']
    # -------------------------------------------------------------------------------------------------------
    assert hookmngr.name_to_hookhandle["my_forward_hook[my_module]"].module is my_module
    hookmngr.register_forward_pre_hook(my_forward_pre_hook, hook_fn_name="my_forward_hook")
    assert "my_forward_hook_1" in hookmngr.name_to_hookfn  # a taken id gets a suffix, as in TackleBox
    with pytest.raises(KeyError, match="'my_forward_hook\\[my_modul\\]' is not registered; did you mean"):
        hookmngr.remove_hook_by_name("my_forward_hook[my_modul]")
    hookmngr.cleanup()


@pytest.mark.parametrize("how", ["function", "module", "handle"])
def test_removing_hooks(net, capsys, how):
    my_module = net[0]
    before = hook_state(net)
    hookmngr = HookManager()
    hookmngr.register_forward_hook(my_forward_hook, hook_fn_name="my_forward_hook", my_module=my_module)
    hookmngr.register_forward_pre_hook(my_forward_pre_hook, my_module=my_module, other=net[2])
    if how == "function":
        # README --------------------------------------------------------------------------------------------
        hookmngr.remove_hook_function(my_forward_hook)
        # ---------------------------------------------------------------------------------------------------
        assert "my_forward_hook" not in hookmngr.name_to_hookfn
    elif how == "module":
        # README --------------------------------------------------------------------------------------------
        hookmngr.remove_module_by_name('my_module')
        # ---------------------------------------------------------------------------------------------------
        assert "my_module" not in hookmngr.name_to_module
    else:
        # README --------------------------------------------------------------------------------------------
        hookmngr.remove_hook_by_name('my_forward_hook[my_module]')
        # ---------------------------------------------------------------------------------------------------
        assert "my_forward_hook[my_module]" not in hookmngr.name_to_hookhandle
    net(torch.randn(1, 3))
    printed = capsys.readouterr().out
    assert "Finished forward pass" not in printed
    assert printed.count("Beginning") == (1 if how == "module" else 2)
    handle = next(iter(hookmngr.name_to_hookhandle.values()))
    hookmngr.remove_hook(handle)
    with pytest.raises(RuntimeError, match="was removed"):
        handle.activate()
    hookmngr.cleanup()
    assert hook_state(net) == before


def test_backward_hook_order_and_forward_cache(net):
    seen = {}

    def with_cache(module, grad_in, grad_out, inputs, outputs):
        seen["io"] = (grad_in, grad_out, inputs, outputs)

    hookmngr = HookManager(model=net)
    hookmngr.register_backward_hook(with_cache, net[2], retain_forward_cache=True)
    x = torch.randn(5, 3, requires_grad=True)
    net(x).pow(2).sum().backward()
    grad_in, grad_out, inputs, outputs = seen["io"]
    assert len(grad_in) == len(inputs) == 1 and len(grad_out) == len(outputs) == 1
    torch.testing.assert_close(grad_out[0], 2 * outputs[0].detach())
    torch.testing.assert_close(grad_in[0], grad_out[0] @ net[2].weight.detach())
    assert hookmngr.name_to_module["2"] is net[2]  # with a model, positional modules are named by their path
    hookmngr.cleanup()


def test_tacklebox_style_hooks_fire_in_every_thread(net):
    import threading

    seen = []
    hookmngr = HookManager()
    hookmngr.register_forward_hook(lambda module, inputs, outputs: seen.append(threading.current_thread().name), first=net[0])
    worker = threading.Thread(target=lambda: net(torch.randn(1, 3)), name="worker")
    worker.start()
    worker.join()
    assert seen == ["worker"]
    hookmngr.cleanup()
