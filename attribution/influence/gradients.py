"""Per-example gradients by hooks: each module's input ``a`` and output gradient ``delta``, in one forward and backward.

A backward hook of :mod:`hooks` gets, for every call of a chosen module, its input and the gradient of the summed
per-example losses with respect to its output; the module's rule (:mod:`._rules`) turns them into one gradient per
example. A module called several times adds up its calls, and a parameter shared by several modules (tied
embeddings) adds up its modules. A module run once for the whole batch whose output is broadcast (GPT-2's position
embedding: batch size 1 in its output) has that output expanded to the batch in a forward hook, so each example gets
its own share of the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hooks import HookManager, ModuleTarget, resolve

from .._run import kept_state
from ._batches import Loss, check_loss, forward, labels_of, per_example_losses
from ._outside import OutsideUses
from ._rules import needs_plain_module, outer_factors, rule_for

if TYPE_CHECKING:
    from .projection import RandomProjection

_SUPPORTED = "nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, RMSNorm modules, HuggingFace Conv1D"


def select_modules(model: nn.Module, modules: ModuleTarget | None) -> list[tuple[str, nn.Module]]:
    """The modules with trainable parameters of their own in ``modules`` (each with its submodules); all by default.

    A module elsewhere that uses one of their parameters (a tied unembedding) is chosen too, so that a parameter's
    gradient is the sum over all its uses.

    Raises:
        ValueError: a module with trainable parameters has no per-example rule, or nothing is trainable.
    """
    pairs = list(model.named_modules()) if modules is None else resolve(model, modules, "`modules`")
    seen: dict[int, tuple[str, nn.Module]] = {}
    for name, module in pairs:
        for sub_name, sub in module.named_modules(prefix=name):
            if id(sub) not in seen and any(p.requires_grad for p in sub.parameters(recurse=False)):
                seen[id(sub)] = (sub_name, sub)
    shared = {id(p) for _, m in seen.values() for p in m.parameters(recurse=False) if p.requires_grad}
    for name, module in model.named_modules():  # every user of a chosen parameter (tied weights)
        if id(module) not in seen and any(id(p) in shared for p in module.parameters(recurse=False)):
            seen[id(module)] = (name, module)
    chosen = list(seen.values())
    unsupported = [
        f"{name!r} ({type(module).__name__})"
        for name, module in chosen
        if rule_for(module) is None
        or any(p.requires_grad and key not in ("weight", "bias") for key, p in module.named_parameters(recurse=False))
    ]
    if unsupported:
        raise ValueError(
            f"no per-example gradient rule for {', '.join(unsupported[:5])}{', ...' if len(unsupported) > 5 else ''}: "
            f"rules exist for {_SUPPORTED} (an embedding without scale_grad_by_freq). Leave it out with `modules=` "
            "(names or globs of the modules you want), or freeze its parameters (requires_grad_(False))"
        )
    if not chosen:
        raise ValueError(
            "no module with trainable parameters was chosen: every parameter has requires_grad=False, or `modules` "
            "names modules without parameters; unfreeze the parameters you want gradients of"
        )
    return chosen


def per_example_gradients(
    model: nn.Module,
    batch: Any,
    loss: Callable[[Any, Any], Tensor] | nn.Module,
    modules: ModuleTarget | None = None,
    projection: RandomProjection | None = None,
) -> dict[str, Tensor]:
    """The gradient of each example's loss for every trainable parameter of the chosen modules.

    One forward and one backward of the batch, with :mod:`hooks` recording each module call's input and output
    gradient, which a rule per module type turns into per-example gradients (``_rules.py``). The model runs in eval
    mode and is left exactly as found (modes, hooks, ``requires_grad``, ``.grad``: the backward goes through
    ``torch.autograd.grad``).

    Args:
        model: the model, batch first in every chosen module.
        batch: ``(inputs, labels)`` or a dict with a ``labels`` key whose other keys are keyword inputs.
        loss: a callable ``(outputs, batch) -> (batch,)`` or an ``nn.Module`` with ``reduction="none"``.
        modules: names, globs or module objects (with their submodules); default every module with trainable
            parameters. Frozen parameters are left out.
        projection: a :class:`RandomProjection` applied to each parameter's flattened gradient.

    Returns:
        Parameter name (as in ``model.named_parameters()``) -> ``(batch, *parameter.shape)``, or ``(batch, dim)``
        projected.

    Raises:
        ValueError: a mean-reduced loss, a module without a rule, a non-finite loss, a module whose output is not
            batch first.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> grads = per_example_gradients(model, (x, y), torch.nn.CrossEntropyLoss(reduction="none"))
        >>> {name: tuple(g.shape) for name, g in grads.items()}
        {'0.weight': (4, 2, 3), '0.bias': (4, 2)}
    """
    with session(model, loss, modules, projection) as run:
        return run(batch)


@contextmanager
def session(
    model: nn.Module,
    loss: Loss,
    modules: ModuleTarget | None = None,
    projection: RandomProjection | None = None,
) -> Iterator[Callable[[Any], dict[str, Tensor]]]:
    """The hooks of :func:`per_example_gradients` registered once for many batches: yields ``run(batch)``.

    The model is in eval mode and hooked for the whole block (TracIn's passes over a data set), and left as found
    after it.
    """
    check_loss(loss)
    targets = [module for _, module in select_modules(model, modules)]
    watched = {id(p) for module in targets for p in module.parameters(recurse=False) if p.requires_grad}
    names = {id(p): name for name, p in model.named_parameters() if id(p) in watched}  # in named_parameters order
    if projection is not None:  # before any work: every parameter's gradient must be at least `dim` numbers
        sizes = {id(p): p.numel() for p in model.parameters()}
        for key, name in names.items():
            projection.check(name, sizes[key])
    calls, outside = _Calls(names, projection), OutsideUses(names)
    with kept_state(model), HookManager(model) as manager:
        group = manager.group("per-example-gradients")
        group.forward_pre(targets, outside.enter, with_kwargs=True)
        group.forward(targets, calls.forward, with_kwargs=True)
        group.forward(targets, outside.leave, with_kwargs=True)
        group.backward(targets, calls.backward)

        def run(batch: Any) -> dict[str, Tensor]:
            calls.reset(labels_of(batch).shape[0])
            _one_pass(model, batch, loss, calls, outside)
            group.deactivate()  # the norms' rules run the norm itself: without our hooks
            try:
                for module, a, delta in calls.deferred:
                    calls.add(module, a, delta)
            finally:
                group.activate()
            params = dict(model.named_parameters())
            shapes = {name: (projection.dim,) if projection else params[name].shape for name in names.values()}
            return {
                name: calls.sums[key] if key in calls.sums else params[name].new_zeros(calls.size, *shapes[name])
                for key, name in names.items()
            }  # fmt: skip  (zeros only for a parameter that got no gradient)

        yield run


def _one_pass(model: nn.Module, batch: Any, loss: Loss, calls: _Calls, outside: OutsideUses) -> None:
    """One hooked forward and backward of ``batch``: ``calls`` gathers the per-example gradients."""
    with torch.enable_grad():
        with outside:
            outputs = forward(model, batch)
        if outside.found:
            raise outside.error()
        losses = per_example_losses(loss, outputs, batch, calls.size)
        if not losses.requires_grad:
            raise ValueError(
                "the loss does not depend on any trainable parameter of the chosen modules (no graph): unfreeze them, "
                "or choose modules on the path to the loss"
            )
        ends = [t for t in calls.ends.values() if t.requires_grad]
        if ends:  # else no chosen module ran: every gradient is zero
            torch.autograd.grad(losses.sum(), ends, allow_unused=True)


class _Calls:
    """What the hooks of one run gather: per-parameter sums, the tensors the backward must reach, deferred norms."""

    def __init__(self, names: dict[int, str], projection: RandomProjection | None) -> None:
        self.names, self.projection = names, projection
        self.reset(0)

    def reset(self, size: int) -> None:
        """Start a batch of ``size`` examples."""
        self.size = size
        self.sums: dict[int, Tensor] = {}
        self.ends: dict[int, Tensor] = {}  # what the backward differentiates with respect to
        self.deferred: list[tuple[nn.Module, Tensor, Tensor]] = []

    def add(self, module: nn.Module, a: Tensor, delta: Tensor) -> None:
        """Apply the module's rule and add each trainable parameter's share to its sum.

        With a projection each share is projected at once (a projection is linear, so the sum of the projected shares
        is the projected sum): only one module's unprojected gradients are ever held.
        """
        for p, g in self._shares(module, a, delta):
            self.sums[id(p)] = self.sums[id(p)] + g if id(p) in self.sums else g

    def _shares(self, module: nn.Module, a: Tensor, delta: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """Each trainable parameter of ``module`` and its per-example gradient from this call (projected if asked).

        A structured projection of a linear layer's (or embedding's) weight is computed from its factors, never
        forming the ``(batch, out, in)`` gradient; the bias is its output gradient summed over positions, projected.
        """
        projection, weight = self.projection, getattr(module, "weight", None)
        factors = outer_factors(module, a, delta) if projection is not None and projection.structured else None
        if factors is not None and isinstance(weight, Tensor) and weight.requires_grad and weight.ndim == 2:
            assert projection is not None
            yield weight, projection.outer(self.names[id(weight)], *factors, rows=weight.shape[0])
            bias = getattr(module, "bias", None)
            if isinstance(bias, Tensor) and bias.requires_grad:
                yield bias, projection(self.names[id(bias)], factors[0 if isinstance(module, nn.Linear) else 1].sum(1))
            return
        rule = rule_for(module)
        assert rule is not None
        for key, g in rule(module, a, delta).items():
            p = getattr(module, key)
            if isinstance(p, Tensor) and p.requires_grad:
                yield p, g if projection is None else projection(self.names[id(p)], g)

    def forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        """Note what the backward must reach; expand a batch-wide output (batch 1) to the batch."""
        a = args[0] if args else next(iter(kwargs.values()), None)
        # through the call's input where that requires grad (autograd then skips the batch-summed weight gradients
        # nobody needs), else through the module's own parameters
        reached = [a] if isinstance(a, Tensor) and a.requires_grad else list(module.parameters(recurse=False))
        self.ends.update({id(t): t for t in reached})
        if isinstance(output, Tensor) and output.ndim and output.shape[0] == 1 and self.size > 1:
            return output.expand(self.size, *output.shape[1:])  # each example's share of a batch-wide call
        return None

    def backward(self, module: nn.Module, grad_in: Any, grad_output: Any, *, name: str, args: Any, kwargs: Any) -> None:
        """Turn one call's input and output gradient into per-example gradients (a norm's: after the run)."""
        delta = grad_output[0]
        if delta is None:
            return
        a = (args[0] if args else next(iter(kwargs.values()))).detach()
        if a.shape[0] == 1 and self.size > 1:
            a = a.expand(self.size, *a.shape[1:])
        if delta.shape[0] != self.size or a.shape[0] != self.size:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has input {tuple(a.shape)} and output gradient "
                f"{tuple(delta.shape)}, but the batch has {self.size} examples: per-example rules need the batch first "
                "in every chosen module (not sequence-first); leave it out with `modules=`"
            )
        if needs_plain_module(module):
            self.deferred.append((module, a, delta.clone()))
        else:
            self.add(module, a, delta)
