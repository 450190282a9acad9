"""The one hooked run of every method: state kept, hooks in one group, the graph started at the first site.

Every method that runs the model itself (the CAMs, rollout, the three patching sweeps) runs it through
:class:`HookedRun` (:func:`attribution.record` and :func:`attribution.patch`, which hook the caller's own runs, use
:func:`eager_if_compiled` and one hook group; the metrics use :func:`kept_state`). :class:`HookedRun`

* leaves the model as it found it, also on errors and ``KeyboardInterrupt``: every module's train/eval flag, the
  grad mode, each parameter's ``requires_grad`` and ``.grad``, and its hooks (one :class:`hooks.HookManager` group);
* runs compiled models eagerly: PyTorch does not guard the hook dictionaries of compiled code, so a model compiled
  and run before our hooks existed would not see them;
* starts the autograd graph at the first site (:meth:`HookedRun.leaf`): before it no parameter requires grad,
  so the backbone records no graph;
* words each error once (:func:`did_not_run`, :func:`no_dependence`, :meth:`HookedRun.forward`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from hooks import HookGroup, HookManager, resolve

from ._inputs import call, describe

Threads = Literal["current", "all"]
Element = int | str | None
_HERE = str(Path(__file__).resolve().parent)


# -- the model as it was found ----------------------------------------------------------------------------------
def eager_module(model: nn.Module) -> nn.Module:
    """The module the hooks go on: the one behind ``torch.compile(model)`` (its ``_orig_mod``), else the model.

    Every family takes the user's model through here before it reads the model's structure, so a model hooks
    cannot hook (a TorchScript module) is refused here, with hooks' own error (:func:`hooks.resolve` raises it).
    """
    inner = getattr(model, "_orig_mod", None)
    inner = inner if isinstance(inner, nn.Module) else model
    resolve(inner, "")  # the model itself, resolved: TorchScript is refused, saying what to do instead
    return inner


@contextmanager
def eager_if_compiled(model: nn.Module) -> Iterator[None]:
    """Run compiled code eagerly in the body when ``model`` or a submodule is compiled, so that hooks fire.

    ``torch.compile`` does not guard the hook dictionaries of compiled code: a model compiled and run before our
    hooks existed would silently skip them. ``torch.compiler.set_stance("force_eager")`` runs the same modules
    eagerly, with their hooks.
    """
    compiled = any(
        getattr(m, "_compiled_call_impl", None) is not None or m is not eager_module(m) for m in model.modules()
    )
    stance = getattr(torch.compiler, "set_stance", None)
    if compiled and stance is not None:
        with stance("force_eager"):
            yield
    else:
        yield


@contextmanager
def kept_state(model: nn.Module) -> Iterator[None]:
    """Run the body in eval mode, outside inference mode, compiled code eagerly; restore all state afterwards.

    Restored, also when the body raises: every module's flag, the grad mode, each parameter's ``requires_grad`` and
    ``.grad``, and a parameter that the body removed (set to ``None``) is put back. Dropout would make an attribution
    random and batch norm in train mode would update its running statistics: attribution calls therefore run in eval
    mode, whatever the model's mode.
    """
    modules = list(model.modules())
    flags = [m.training for m in modules]
    # by (module, name), not by object: accelerate swaps an offloaded module's parameter objects at each forward
    params = [(m, n, p, p.requires_grad, p.grad) for m in modules for n, p in m.named_parameters(recurse=False)]
    grad_mode = torch.is_grad_enabled()
    try:
        with ExitStack() as stack:
            if any(flags):
                model.eval()
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(eager_if_compiled(model))
            yield
    finally:
        for module, flag in zip(modules, flags, strict=True):
            if module.training != flag:
                module.training = flag
        _restore_parameters(params)
        torch.set_grad_enabled(grad_mode)


def _restore_parameters(saved: list[tuple[nn.Module, str, nn.Parameter, bool, torch.Tensor | None]]) -> None:
    """Give each parameter slot its ``requires_grad`` and ``.grad`` back; a slot emptied meanwhile gets its parameter.

    The slot is read in ``module._parameters``, where :meth:`~torch.nn.Module.named_parameters` found it, not with
    ``getattr``: zennit's batch-norm canonizers, once removed, leave a layer's ``bias`` attribute ``None`` in the
    instance ``__dict__`` over a registered parameter, and a hook may set a parameter to ``None``.
    """
    for module, name, param, requires_grad, grad in saved:
        p = module._parameters.get(name)
        if p is None:  # removed (set to None, or deleted) during the call: the model is left as it was found
            module._parameters[name] = p = param
        if p.requires_grad != requires_grad:
            p.requires_grad_(requires_grad)
        if p.grad is not grad:
            p.grad = grad


# -- errors, worded once ----------------------------------------------------------------------------------------
class SiteError(Exception):
    """Raised inside a hook about a site; re-raised as it is once the forward has unwound (no "model failed")."""


class SiteTypeError(SiteError, TypeError):
    """A site that is not the tensor the method needs (a tuple without ``element``, a non-floating output)."""


class SiteValueError(SiteError, ValueError):
    """A site with the wrong shape or contents, or an ``element`` name that is not there."""


class SiteIndexError(SiteError, IndexError):
    """An ``element`` index out of range."""


def did_not_run(what: str, name: str) -> ValueError:
    """A site that no forward call reached."""
    return ValueError(
        f"{what} {name!r} did not run during the forward pass: choose a module the model calls (see "
        "hooks.trace(model, inputs)); a parent that uses a child's weights without calling it (nn.MultiheadAttention "
        "and its out_proj) hides the child"
    )


def no_dependence(
    what: str, name: str, scores: torch.Tensor | None = None, *, checkpointed: bool = False
) -> ValueError:
    """A target score whose graph does not reach a site; names reentrant checkpointing when that is the cause."""
    message = f"the target score does not depend on {what} {name!r}"
    if checkpointed or (scores is not None and reentrant_checkpoint(scores)):
        return ValueError(message + ": " + CHECKPOINT_HINT)
    return ValueError(
        message + ": no gradient flows from the score back to it. Choose a site on the path to the output (a layer "
        "the output is computed from), or a target that reads the output it feeds"
    )


CHECKPOINT_HINT = (
    "the model runs part of its forward under torch.utils.checkpoint(use_reentrant=True), whose graph "
    "torch.autograd.grad cannot enter. Use use_reentrant=False (HuggingFace: model.gradient_checkpointing_enable("
    "gradient_checkpointing_kwargs={'use_reentrant': False}); timm: model.set_grad_checkpointing(False)), or switch "
    "checkpointing off for the call"
)


def reentrant_checkpoint(scores: torch.Tensor) -> bool:
    """Whether the graph of ``scores`` goes through a reentrant ``torch.utils.checkpoint`` segment."""
    seen: set[Any] = set()
    stack = [scores.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CheckpointFunction" in type(node).__name__:
            return True
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return False


def _inside_reentrant_checkpoint() -> bool:
    """Whether the calling hook runs inside ``CheckpointFunction.forward`` (``checkpoint(use_reentrant=True)``)."""
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        frame = frame.f_back
    return False


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn, attributed to the first caller outside this package (every user-facing warning goes through here).

    Inside :meth:`WarningScope.active`, a cause (the line of the package that calls ``warn``, and the category) warns
    only the first time in the scope.
    """
    frame = inspect.currentframe()
    scope = _ONCE.get()
    if scope is not None and frame is not None and frame.f_back is not None:
        cause = (frame.f_back.f_code.co_filename, frame.f_back.f_lineno, category)
        if cause in scope.seen:
            return
        scope.seen.add(cause)
        message = f"{message} ({scope.note})"
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


class WarningScope:
    """Where each cause of :func:`warn` warns once over many calls (a run of many batches), with a note added.

    A cause is the line of the package that calls :func:`warn`, with the warning's category. The calls are the
    bodies of :meth:`active`; ``note`` may be changed between them (which batch runs).

    Example:
        >>> import warnings
        >>> scope = WarningScope("shown once per run")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for batch in range(3):
        ...         with scope.active():
        ...             warn("the map is all zeros")
        >>> [str(w.message) for w in caught]
        ['the map is all zeros (shown once per run)']
    """

    def __init__(self, note: str) -> None:
        self.note = note
        self.seen: set[tuple[str, int, type[Warning]]] = set()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Count the warnings of the body in this scope; inside another scope's body, that one counts them."""
        if _ONCE.get() is not None:
            yield
            return
        token = _ONCE.set(self)
        try:
            yield
        finally:
            _ONCE.reset(token)


_ONCE: ContextVar[WarningScope | None] = ContextVar("attribution_warning_scope", default=None)


# -- sites: which tensor of a module's output or arguments ------------------------------------------------------
def select(value: Any, element: Element, where: str) -> torch.Tensor:
    """The tensor at a site: ``value``, or its ``element`` (an index, a key, a ``ModelOutput`` or named-tuple field)."""
    if element is not None:
        value = _element(value, element, where)
    if not isinstance(value, torch.Tensor):
        hint = ""
        if isinstance(value, (tuple, list)):
            hint = " (it is a tuple: pass element=i to choose)"
        elif isinstance(value, Mapping):
            hint = f" (it is a mapping: pass element= one of {list(value)})"
        raise SiteTypeError(f"{where} is a {type(value).__name__}, not a tensor{hint}")
    return value


def _element(value: Any, element: int | str, where: str) -> Any:
    if isinstance(value, Mapping):  # dicts and HuggingFace ModelOutputs (whose keys are the fields that are set)
        keys = list(value.keys())
        if isinstance(element, int):
            if not -len(keys) <= element < len(keys):
                raise SiteIndexError(f"`element`={element}, but {where} has {len(keys)} entries ({keys})")
            return value[keys[element]]
        if element not in value:
            raise SiteValueError(f"`element`={element!r}, but {where} has entries {keys}")
        return value[element]
    if isinstance(value, (tuple, list)):
        if isinstance(element, str):
            if hasattr(value, "_fields") and element in value._fields:  # a named tuple
                return getattr(value, element)
            raise SiteTypeError(f"`element`={element!r} names a field, but {where} is a {type(value).__name__}")
        if not -len(value) <= element < len(value):
            raise SiteIndexError(f"`element`={element}, but {where} is a tuple of {len(value)}")
        return value[element]
    raise SiteTypeError(
        f"{where} is a {type(value).__name__}, not a tuple or mapping: `element`={element!r} does not apply"
    )


def put(value: Any, element: Element, tensor: torch.Tensor) -> Any:
    """``value`` with the tensor at ``element`` replaced (a new container; ``value`` is not modified)."""
    if element is None:
        return tensor
    if isinstance(value, Mapping):
        key = list(value.keys())[element] if isinstance(element, int) else element
        copied: Any = type(value)(**value) if all(isinstance(k, str) for k in value) else dict(value)
        copied[key] = tensor  # a ModelOutput is rebuilt from its fields, then the field is set (key and attribute)
        return copied
    if isinstance(element, str):
        return value._replace(**{element: tensor})
    items = list(value)
    items[element] = tensor
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # named tuples too


def hook_site(
    group: HookGroup,
    layers: Any,
    site: Literal["output", "input"],
    element: Element,
    fn: Callable[[torch.Tensor, str, int], torch.Tensor | None],
) -> None:
    """Call ``fn(tensor, name, call)`` at each module's site; a tensor it returns replaces the site's tensor.

    The site is the module's output (its ``element``), or for ``site="input"`` its first argument as called
    (positional, else the first keyword argument), or with ``element`` the argument at that position or of that
    name (by keyword or by the parameter's position in ``forward``). ``call`` counts the module's calls within one
    forward of the model.
    """
    if site == "output":

        def after(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> Any:
            new = fn(select(output, element, f"the output of {name!r}"), name, call)
            return None if new is None else put(output, element, new)

        group.forward(layers, after)
        return

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str, call: int) -> Any:
        where, key = _argument(module, args, kwargs, element, name)
        current = args[key] if isinstance(key, int) else kwargs[key]
        new = fn(select(current, None, where), name, call)
        if new is None:
            return None
        if isinstance(key, int):
            return (*args[:key], new, *args[key + 1 :]), kwargs
        return args, {**kwargs, key: new}

    group.forward_pre(layers, before, with_kwargs=True)


def _argument(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], element: Element, name: str
) -> tuple[str, int | str]:
    """Where the input site is: a position in ``args`` or a key of ``kwargs``, and its description."""
    if element is None:
        if args:
            return f"the first argument of {name!r}", 0
        if kwargs:
            key = next(iter(kwargs))
            return f"the first argument of {name!r} ({key}=, by keyword)", key
        raise SiteTypeError(f"{name!r} was called without arguments: site='input' has nothing to read")
    if isinstance(element, int):
        if not -len(args) <= element < len(args):
            raise SiteIndexError(
                f"`element`={element}, but {name!r} was called with {len(args)} positional argument(s)"
                + (f" and keywords {list(kwargs)}: name the argument, element='{next(iter(kwargs))}'" if kwargs else "")
            )
        return f"positional argument {element} of {name!r}", element % len(args)
    if element in kwargs:
        return f"argument {element!r} of {name!r}", element
    params = [
        p.name
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if element in params and params.index(element) < len(args):
        return f"argument {element!r} of {name!r}", params.index(element)
    raise SiteValueError(
        f"`element`={element!r}, but {name!r} was called without an argument of that name (positional "
        f"{len(args)}, keywords {list(kwargs)}; forward's parameters: {params})"
    )


# -- the run ------------------------------------------------------------------------------------------------------
class HookedRun:
    """One guarded forward with one hook group (see the module documentation).

    Used as ``with HookedRun(model, "GradCAM", with_grad=True) as run:``; register on ``run.group``, make the
    first site's tensor a leaf with :meth:`leaf`, run :meth:`forward`, then take :meth:`gradients`.
    """

    def __init__(self, model: nn.Module, name: str, *, with_grad: bool = False, threads: Threads = "current") -> None:
        self.model = model
        self.name = name
        self.with_grad = with_grad
        self.threads = threads
        self.started = False
        self.checkpointed = False  # a site ran inside a reentrant checkpoint, whose graph autograd.grad cannot enter
        self._stack = ExitStack()

    def __enter__(self) -> HookedRun:
        with ExitStack() as stack:
            stack.enter_context(kept_state(self.model))
            if self.with_grad:  # nothing requires grad until the leaf: the backbone records no graph
                for p in self.model.parameters():
                    p.requires_grad_(False)
            manager = stack.enter_context(HookManager(self.model))
            self.group = manager.group(self.name, threads=self.threads)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def leaf(self, x: Any) -> Any:
        """Start the graph here: from now on autograd is on, and ``x`` (its floating-point tensors) is a new leaf.

        Before the first call nothing is recorded; a later call for a tensor that already requires grad keeps it
        (it is downstream of the leaf), one that does not (a parallel branch with frozen parameters) starts its own.
        """
        if not self.with_grad:
            return x

        def one(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not (self.started and t.requires_grad):
                return t.detach().requires_grad_(True)
            return t

        if not self.checkpointed:
            self.checkpointed = _inside_reentrant_checkpoint()
        torch.set_grad_enabled(True)
        new = (
            tuple(one(t) for t in x)
            if isinstance(x, tuple)
            else {k: one(v) for k, v in x.items()}
            if isinstance(x, dict)
            else one(x)
        )
        self.started = True
        return new

    def forward(self, inputs: Any) -> Any:
        """Run the model; errors from hooks and the model become one error.

        Without gradients, autograd is off. With them it is on, but the parameters do not require grad (restored on
        exit), so nothing is recorded before :meth:`leaf`: the backbone keeps no graph, and a view that the model
        makes before the first site and updates in place after it is an ordinary view (under ``no_grad`` PyTorch
        would refuse the in-place update).
        """
        torch.set_grad_enabled(self.with_grad)
        try:
            return call(self.model, inputs)
        except SiteError as exc:
            raise exc.with_traceback(None) from None
        except Exception as exc:
            message = f"the model failed on `inputs` {describe(inputs)}: {exc}"
            try:
                clearer = type(exc)(message)
            except Exception:
                raise exc from None
            raise clearer from exc

    def gradients(
        self, scores: torch.Tensor, tensors: Sequence[torch.Tensor], what: str, names: Sequence[str]
    ) -> list[torch.Tensor | None]:
        """``d scores.sum() / d tensors`` by ``torch.autograd.grad`` (nothing accumulates into ``.grad``)."""
        if not scores.requires_grad:
            raise no_dependence(what, names[0], scores, checkpointed=self.checkpointed)
        try:
            return list(torch.autograd.grad(scores.sum(), list(tensors), allow_unused=True))
        except RuntimeError as exc:
            if "checkpoint" in str(exc) and "reentrant" in str(exc):
                raise ValueError(f"the gradient of the target score cannot be taken: {CHECKPOINT_HINT}") from None
            raise
