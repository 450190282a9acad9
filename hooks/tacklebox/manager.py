"""TackleBox's ``HookManager`` (``tacklebox.hook_management``, version 1.0.3) on top of :class:`hooks.HookManager`.

Every method has TackleBox's name, arguments and look-up tables. Its hooks live in one group of a core manager,
active in all threads (TackleBox's hooks are plain module hooks). Hook functions see what TackleBox gives them:

* forward pre-hooks ``fn(module, inputs)``, ``inputs`` the positional arguments; a returned tuple replaces them;
* forward hooks ``fn(module, inputs, outputs)``, ``inputs`` the positional arguments after the pre-hooks and
  ``outputs`` always a tuple (a single tensor output becomes ``(output,)``); a returned tuple replaces them;
* backward hooks ``fn(module, grad_in, grad_out)`` (with ``retain_forward_cache=True`` also ``inputs, outputs``):
  ``grad_in[i]`` the gradient of the i-th positional argument (``None`` for a non-tensor or one without gradient),
  ``grad_out[j]`` that of the j-th output, as lists of copies. Unlike TackleBox, ``grad_in`` is the gradient that
  flows through this call only, and the hooks fire once per call of a module called several times.

Modules are named as TackleBox names them (the keyword they were passed under, else ``repr(module)``), and those
names are set as their ``name`` attribute, which hooks read; :meth:`HookManager.cleanup` puts the attribute back.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import _tree
from .._resolve import close_match_hint, resolve
from ..manager import HookManager as CoreManager
from .context import HookContext

HOOK_TYPES = ("forward_hook", "backward_hook", "forward_pre_hook")
_KIND = {"forward_hook": "forward", "forward_pre_hook": "forward_pre", "backward_hook": "backward"}
_MISSING = object()


def increment_name(name: str) -> str:
    """``"name"`` -> ``"name_1"``, ``"name_1"`` -> ``"name_2"`` (how TackleBox renames a taken name)."""
    stem, _, count = name.rpartition("_")
    return f"{stem}_{int(count) + 1}" if stem and count.isnumeric() else f"{name}_1"


class HookFunction:
    """A registered function and the modules it is on.

    Attributes:
        name: its id (``hook_fn_name``, else ``repr(function)``).
        function: the user's function.
        hook_type: ``"forward_hook"``, ``"forward_pre_hook"`` or ``"backward_hook"``.
        retain_forward_cache: whether a backward hook also receives the call's inputs and outputs.
        handles: its :class:`HookHandle` objects, in registration order.
        module_to_handle: module -> :class:`HookHandle`.
    """

    def __init__(self, function: Callable[..., Any], hook_type: str, name: str, retain_forward_cache: bool) -> None:
        self.function = function
        self.hook_type = hook_type
        self.name = name
        self.retain_forward_cache = retain_forward_cache
        self.handles: list[HookHandle] = []
        self.module_to_handle: dict[nn.Module, HookHandle] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function."""
        return self.function(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<HookFunction {self.name!r} {self.hook_type} on {len(self.handles)} module(s)>"


class HookHandle:
    """One function on one module, named ``"<function id>[<module name>]"``."""

    def __init__(self, manager: HookManager, hook_fn: HookFunction, module: nn.Module, name: str, core: Any) -> None:
        self.manager = manager
        self.hook_fn = hook_fn
        self.module = module
        self.name = name
        self.core = core  # the hooks.HookHandle that runs it

    def is_active(self) -> bool:
        """Whether the hook fires."""
        return bool(self.core.is_active())

    def activate(self, raise_on_active: bool = False) -> None:
        """Let the hook fire."""
        if raise_on_active and self.is_active():
            raise AssertionError("Cannot activate hook: Hook is already active")
        self.core.activate()

    def deactivate(self, raise_on_inactive: bool = False) -> None:
        """Stop the hook from firing; it keeps its place."""
        if raise_on_inactive and not self.is_active():
            raise AssertionError("Cannot deactivate hook: Hook is already inactive")
        self.core.deactivate()

    def remove(self) -> None:
        """Remove the hook and forget it (same as ``manager.remove_hook(handle)``)."""
        self.manager.remove_hook(self)

    def set_name(self, name: str) -> None:
        """Rename the handle."""
        self.name = name

    def __repr__(self) -> str:
        state = "active" if self.is_active() else "inactive"
        return f"<{self.name} {type(self)} registered to {getattr(self.module, 'name', '?')} ({state})>"


class HookManager:
    """TackleBox's central registry of module hooks, with its look-up tables and contexts.

    Args:
        wrap_calls: accepted for compatibility (hooks always run from one dispatcher per module here).
        recursion_depth: accepted for compatibility (unused in TackleBox 1.0.3 too).
        model: optionally the model the modules belong to: modules passed without a name are then named by their
            path in it (``"layer1.0.conv1"``) instead of their ``repr``, and calls are numbered per forward.

    Example:
        >>> import torch
        >>> from hooks.tacklebox import HookManager
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> hookmngr = HookManager()
        >>> show = lambda module, inputs, outputs: print(module.name, outputs[0].shape)
        >>> _ = hookmngr.register_forward_hook(show, hook_fn_name="show", lin=net[0])
        >>> with hookmngr.hook_all_context() + torch.no_grad():
        ...     _ = net(torch.randn(3, 2))
        lin torch.Size([3, 2])
        >>> sorted(hookmngr.name_to_hookhandle)
        ['show[lin]']
        >>> hookmngr.cleanup()
    """

    def __init__(self, wrap_calls: bool = True, recursion_depth: int = 0, *, model: nn.Module | None = None) -> None:
        self.core = CoreManager(model)
        self.wrap_calls = wrap_calls
        self.max_recursion_depth = recursion_depth
        self.hook_fns: set[HookFunction] = set()
        self.modules: set[nn.Module] = set()
        self.name_to_hookfn: dict[str, HookFunction] = {}
        self.name_to_hookhandle: dict[str, HookHandle] = {}
        self.module_to_hookhandle: dict[nn.Module, list[HookHandle]] = {}
        self.name_to_module: dict[str, nn.Module] = {}
        self.function_to_hookfn: dict[Callable[..., Any], HookFunction] = {}
        self._renamed: dict[int, tuple[weakref.ref[nn.Module], Any]] = {}  # module -> its `name` before us
        self._finalizer = weakref.finalize(self, _restore_names, self._renamed)

    # -- registration ------------------------------------------------------------------------------------------
    def register_hook(
        self,
        hook_type: str,
        function: Callable[..., Any],
        *modules: nn.Module,
        hook_fn_name: str | None = None,
        activate: bool = True,
        retain_forward_cache: bool = False,
        **named_modules: nn.Module,
    ) -> list[HookHandle]:
        """Register ``function`` as a ``hook_type`` hook on the given modules (named by keyword, else by repr)."""
        if hook_type not in HOOK_TYPES:
            raise ValueError(f"`hook_type` must be one of {HOOK_TYPES}; got {hook_type!r}")
        if retain_forward_cache and hook_type != "backward_hook":
            raise ValueError("`retain_forward_cache` is only for backward hooks")
        pairs = [(None, m) for m in modules] + list(named_modules.items())
        for key, module in pairs:
            if not isinstance(module, nn.Module):
                raise TypeError(f"module `{key or '?'}` must be a torch.nn.Module; got {type(module).__name__}")
        hook_fn = self.function_to_hookfn.get(function)
        if hook_fn is None:
            _check_arity(function, hook_type, retain_forward_cache)
            name = hook_fn_name if hook_fn_name is not None else repr(function)
            if name in self.name_to_hookfn:
                name = increment_name(name)
            hook_fn = HookFunction(function, hook_type, name, retain_forward_cache)
        for _, module in pairs:
            if module in hook_fn.module_to_handle:
                raise ValueError(
                    f"hook function {hook_fn.name!r} is already registered with module {module.__dict__.get('name')!r}"
                )
        self.hook_fns.add(hook_fn)
        self.name_to_hookfn[hook_fn.name] = hook_fn
        self.function_to_hookfn[function] = hook_fn
        for key, module in pairs:
            self._adopt(key, module)
        group = self.core.group("tacklebox", threads="all")
        adapter = _adapter(hook_fn)
        kind = _KIND[hook_fn.hook_type]
        cores = getattr(group, kind)([m for _, m in pairs], adapter, activate=activate) if pairs else []
        by_module = {id(c.module): c for c in cores}
        handles = []
        for _, module in pairs:
            handle = HookHandle(self, hook_fn, module, f"{hook_fn.name}[{module.name}]", by_module[id(module)])
            hook_fn.handles.append(handle)
            hook_fn.module_to_handle[module] = handle
            self.module_to_hookhandle[module].append(handle)
            self.name_to_hookhandle[handle.name] = handle
            handles.append(handle)
        return handles

    def _adopt(self, key: str | None, module: nn.Module) -> None:
        """Name a module the first time this manager sees it, as TackleBox does (and remember the old name)."""
        if module in self.modules:
            return
        if key is not None:
            name = key
        else:  # TackleBox names a module passed without a name by its repr; with a model, its path is clearer
            path = self.core.model is not None and resolve(self.core.model, module)[0][0]
            name = path if isinstance(path, str) else repr(module)
        if name in self.name_to_module:
            name = increment_name(name)
        self.modules.add(module)
        self.module_to_hookhandle[module] = []
        self.name_to_module[name] = module
        if id(module) not in self._renamed:
            self._renamed[id(module)] = (weakref.ref(module), module.__dict__.get("name", _MISSING))
        module.__dict__["name"] = name

    def register_forward_hook(
        self, function: Callable[..., Any], *modules: nn.Module, hook_fn_name: str | None = None,
        activate: bool = True, **named_modules: Any,
    ) -> list[HookHandle]:  # fmt: skip
        """Register ``function(module, inputs, outputs)`` after each forward of the modules."""
        return self.register_hook(
            "forward_hook", function, *modules, hook_fn_name=hook_fn_name, activate=activate, **named_modules
        )

    def register_forward_pre_hook(
        self, function: Callable[..., Any], *modules: nn.Module, hook_fn_name: str | None = None,
        activate: bool = True, **named_modules: Any,
    ) -> list[HookHandle]:  # fmt: skip
        """Register ``function(module, inputs)`` before each forward of the modules."""
        return self.register_hook(
            "forward_pre_hook", function, *modules, hook_fn_name=hook_fn_name, activate=activate, **named_modules
        )

    def register_backward_hook(
        self, function: Callable[..., Any], *modules: nn.Module, hook_fn_name: str | None = None,
        activate: bool = True, retain_forward_cache: bool = False, **named_modules: Any,
    ) -> list[HookHandle]:  # fmt: skip
        """Register ``function(module, grad_in, grad_out[, inputs, outputs])`` for each backward of the modules."""
        return self.register_hook(
            "backward_hook", function, *modules, hook_fn_name=hook_fn_name, activate=activate,
            retain_forward_cache=retain_forward_cache, **named_modules,
        )  # fmt: skip

    # -- look-up and activation --------------------------------------------------------------------------------
    def get_module_hooks(
        self, module: nn.Module, hook_types: Any = (), category: str = "all", include_active: bool = True,
        include_inactive: bool = True,
    ) -> Iterator[HookHandle]:  # fmt: skip
        """The handles on ``module``, filtered by function, category and state."""
        _check_category(category)
        functions = list(hook_types)
        for h in list(self.module_to_hookhandle[module]):
            if functions and h.hook_fn.function not in functions:
                continue
            if category != "all" and category != h.hook_fn.hook_type:
                continue
            if (h.is_active() and not include_active) or (not h.is_active() and not include_inactive):
                continue
            yield h

    def get_module_hooks_by_name(self, module_name: str, hook_types: Any = (), **kwargs: Any) -> Iterator[HookHandle]:
        """:meth:`get_module_hooks` by module name."""
        return self.get_module_hooks(self._module(module_name), hook_types=hook_types, **kwargs)

    def is_module_hooked(self, module: nn.Module) -> bool:
        """Whether ``module`` has an active hook of this manager."""
        return any(True for _ in self.get_module_hooks(module, include_inactive=False))

    def is_module_hooked_backward(self, module: nn.Module) -> bool:
        """Whether ``module`` has an active backward hook of this manager."""
        return any(True for _ in self.get_module_hooks(module, category="backward_hook", include_inactive=False))

    def activate_module_hooks(self, *modules: nn.Module, hook_types: Any = (), category: str = "all") -> None:
        """Activate the hooks on ``modules`` (filtered by function and category)."""
        for module in modules:
            for h in self.get_module_hooks(module, hook_types=hook_types, category=category):
                h.activate()

    def deactivate_module_hooks(self, *modules: nn.Module, hook_types: Any = (), category: str = "all") -> None:
        """Deactivate the hooks on ``modules`` (filtered by function and category)."""
        for module in modules:
            for h in self.get_module_hooks(module, hook_types=hook_types, category=category):
                h.deactivate()

    def activate_module_hooks_by_name(self, *module_names: str, hook_types: Any = (), category: str = "all") -> None:
        """:meth:`activate_module_hooks` by module name."""
        self.activate_module_hooks(*self._modules(module_names), hook_types=hook_types, category=category)

    def deactivate_module_hooks_by_name(self, *module_names: str, hook_types: Any = (), category: str = "all") -> None:
        """:meth:`deactivate_module_hooks` by module name."""
        self.deactivate_module_hooks(*self._modules(module_names), hook_types=hook_types, category=category)

    def activate_all_hooks(self, hook_types: Any = (), category: str = "all") -> None:
        """Activate every hook (filtered by function and category)."""
        self.activate_module_hooks(*self.modules, hook_types=hook_types, category=category)

    activate_all_hook = activate_all_hooks  # the spelling TackleBox's README uses once

    def deactivate_all_hooks(self, hook_types: Any = (), category: str = "all") -> None:
        """Deactivate every hook (filtered by function and category)."""
        self.deactivate_module_hooks(*self.modules, hook_types=hook_types, category=category)

    def activate_hook_by_name(self, hook_name: str) -> None:
        """Activate the handle called ``"fn[module]"``."""
        self._handle(hook_name).activate()

    def deactivate_hook_by_name(self, hook_name: str) -> None:
        """Deactivate the handle called ``"fn[module]"``."""
        self._handle(hook_name).deactivate()

    # -- contexts ----------------------------------------------------------------------------------------------
    def hook_module_context(
        self, *modules: nn.Module, hook_types: Any = (), add_enter_fns: Any = (), add_exit_fns: Any = (),
        category: str = "all",
    ) -> HookContext:  # fmt: skip
        """A context in which the hooks on ``modules`` are active; combine it with others by ``+``.

        ``add_enter_fns`` run before the activation, ``add_exit_fns`` after the deactivation (no arguments).
        """
        _check_category(category)

        def activate() -> None:
            self.activate_module_hooks(*modules, hook_types=hook_types, category=category)

        def deactivate() -> None:
            self.deactivate_module_hooks(*modules, hook_types=hook_types, category=category)

        return HookContext(enter_fns=[*add_enter_fns, activate], exit_fns=[deactivate, *add_exit_fns])

    def hook_module_context_by_name(
        self, *module_names: str, hook_types: Any = (), add_enter_fns: Any = (), add_exit_fns: Any = (),
        category: str = "all",
    ) -> HookContext:  # fmt: skip
        """:meth:`hook_module_context` by module name."""
        return self.hook_module_context(
            *self._modules(module_names), hook_types=hook_types, add_enter_fns=add_enter_fns,
            add_exit_fns=add_exit_fns, category=category,
        )  # fmt: skip

    def hook_all_context(
        self, hook_types: Any = (), add_enter_fns: Any = (), add_exit_fns: Any = (), category: str = "all"
    ) -> HookContext:
        """A context in which every hook is active (filtered by function and category)."""
        return self.hook_module_context(
            *self.modules, hook_types=hook_types, add_enter_fns=add_enter_fns, add_exit_fns=add_exit_fns,
            category=category,
        )  # fmt: skip

    # -- removal -----------------------------------------------------------------------------------------------
    def remove_hook(self, handle: HookHandle) -> None:
        """Remove one handle and forget it."""
        handle.core.remove()
        self.name_to_hookhandle.pop(handle.name, None)
        if handle in self.module_to_hookhandle.get(handle.module, []):
            self.module_to_hookhandle[handle.module].remove(handle)
        if handle in handle.hook_fn.handles:
            handle.hook_fn.handles.remove(handle)
        handle.hook_fn.module_to_handle.pop(handle.module, None)

    def remove_hook_by_name(self, handle_name: str) -> None:
        """Remove the handle called ``"fn[module]"``."""
        self.remove_hook(self._handle(handle_name))

    def remove_hook_function(self, function: Callable[..., Any]) -> None:
        """Remove ``function`` from every module and forget it."""
        hook_fn = self.function_to_hookfn.get(function)
        if hook_fn is None:
            raise KeyError(f"{function!r} is not registered with this manager")
        for handle in list(hook_fn.handles):
            self.remove_hook(handle)
        self.name_to_hookfn.pop(hook_fn.name, None)
        self.function_to_hookfn.pop(function, None)
        self.hook_fns.discard(hook_fn)

    def remove_hook_function_by_name(self, hook_fn_name: str) -> None:
        """:meth:`remove_hook_function` by the function's id."""
        self.remove_hook_function(_lookup(self.name_to_hookfn, hook_fn_name, "hook function").function)

    def remove_module(self, module: nn.Module) -> None:
        """Remove every hook on ``module`` and forget the module (its ``name`` attribute is put back)."""
        for handle in list(self.module_to_hookhandle[module]):
            self.remove_hook(handle)
        self.name_to_module.pop(module.__dict__["name"])
        del self.module_to_hookhandle[module]
        self.modules.discard(module)
        _restore_names({id(module): self._renamed.pop(id(module))} if id(module) in self._renamed else {})

    def remove_module_by_name(self, module_name: str) -> None:
        """:meth:`remove_module` by name."""
        self.remove_module(self._module(module_name))

    def cleanup(self) -> None:
        """Remove every hook, clear the look-up tables and put the modules' ``name`` attributes back."""
        self.core.remove_all()
        self.hook_fns = set()
        self.modules = set()
        self.name_to_hookfn = {}
        self.name_to_hookhandle = {}
        self.module_to_hookhandle = {}
        self.name_to_module = {}
        self.function_to_hookfn = {}
        _restore_names(self._renamed)

    def _modules(self, names: tuple[str, ...]) -> list[nn.Module]:
        return [self._module(n) for n in names]

    def _module(self, name: str) -> nn.Module:
        module: nn.Module = _lookup(self.name_to_module, name, "module")
        return module

    def _handle(self, name: str) -> HookHandle:
        handle: HookHandle = _lookup(self.name_to_hookhandle, name, "hook handle")
        return handle

    def __repr__(self) -> str:
        return f"<tacklebox-style HookManager: {len(self.name_to_hookhandle)} hook(s) on {len(self.modules)} module(s)>"


def _restore_names(renamed: dict[int, tuple[weakref.ref[nn.Module], Any]]) -> None:
    for ref, previous in renamed.values():
        module = ref()
        if module is None:
            continue
        if previous is _MISSING:
            module.__dict__.pop("name", None)
        else:
            module.__dict__["name"] = previous
    renamed.clear()


def _lookup(table: dict[str, Any], key: str, what: str) -> Any:
    if key in table:
        return table[key]
    raise KeyError(f"{what} {key!r} is not registered; {close_match_hint(key, list(table))}")


def _check_category(category: str) -> None:
    if category not in (*HOOK_TYPES, "all"):
        raise ValueError(f"`category` must be one of {[*HOOK_TYPES, 'all']}; got {category!r}")


def _check_arity(fn: Callable[..., Any], hook_type: str, retain_forward_cache: bool) -> None:
    import inspect

    n = {"forward_hook": 3, "forward_pre_hook": 2, "backward_hook": 5 if retain_forward_cache else 3}[hook_type]
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError as exc:
        raise TypeError(f"a TackleBox {hook_type} {fn!r} must take {n} positional arguments: {exc}") from None
    except ValueError:
        pass


def _clones(values: Any) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def _adapter(hook_fn: HookFunction) -> Callable[..., Any]:
    """The core hook that calls a TackleBox hook function with TackleBox's arguments."""
    fn = hook_fn.function
    if hook_fn.hook_type == "forward_pre_hook":

        def pre(module: nn.Module, args: tuple[Any, ...]) -> Any:
            return fn(module, args)

        return pre

    if hook_fn.hook_type == "forward_hook":

        def forward(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            single = not isinstance(output, tuple)
            result = fn(module, args, (output,) if single else output)
            if result is None:
                return None
            if not isinstance(result, tuple):
                raise TypeError(
                    f"TackleBox-style forward hook {hook_fn.name!r} on {getattr(module, 'name', '?')!r} must return "
                    f"None or a tuple of outputs; got {type(result).__name__}"
                )
            return result[0] if single and len(result) == 1 else result

        return forward

    retain = hook_fn.retain_forward_cache

    def backward(module: nn.Module, grad_input: Any, grad_output: Any, *, args: Any, output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        grad_in = _clones(_per_item(args, grad_input))
        grad_out = _clones(_per_item(outputs, grad_output))
        if retain:
            fn(module, grad_in, grad_out, _clones(args), _clones(outputs))
        else:
            fn(module, grad_in, grad_out)

    return backward


def _per_item(items: tuple[Any, ...], grads: tuple[Any, ...]) -> list[Any]:
    """The gradient of each item that is a tensor (``None`` for the others), from the gradients of all leaves."""
    out = []
    position = 0
    for item in items:
        count = len(_tree.flatten(item)[0])
        out.append(grads[position] if isinstance(item, torch.Tensor) and position < len(grads) else None)
        position += count
    return out
