"""Layer-wise relevance propagation for CNNs and MLPs: :class:`LRP`, rules as hooks, zennit's composites.

One call runs the model once with a hook group on its layers and takes one backward pass:

* each convolution or linear layer (with a batch norm that directly follows it merged in) runs without autograd,
  and its output is handed on by a :class:`~attribution.lrp._functions.RuleFunction` whose backward is the
  layer's rule: the layer's own backward and its weight gradients never run;
* elementwise activations (ReLU included, as in zennit) get the ``Pass`` rule, average pools the ``Norm`` rule,
  residual sums of known blocks the ``Norm`` rule on their two summands (:mod:`attribution.lrp.canonizers`); max
  pooling keeps its gradient, which hands relevance to the winner;
* the relevance at the output is the target's logit: the one-hot target times the output (zennit's
  ``attr_output = one_hot * output``), or for a callable target its gradient times the output.

The result is the relevance at the input, shaped like it, not normalised. The model is left as it was found
(parameters, buffers, hooks, modes), also on errors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from .._run import HookedRun, SiteValueError, eager_module, no_dependence, warn
from ..targets import Target, check_target, class_indices, class_logits
from ._functions import NormFunction, PassFunction, RuleFunction, SumFunction
from .canonizers import AFFINE, BATCH_NORMS, Residual, merge, merged_batch_norms, residual_blocks, units
from .composites import Composite, EpsilonPlusFlat
from .rules import Layer, Pass, Rule

__all__ = ["LRP"]

GRADIENT = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
)
"""Modules whose gradient is the relevance they hand on (max pooling gives it to the winner, the others pass it)."""
ACTIVATIONS = (
    nn.ELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.PReLU,
    nn.ReLU,
    nn.ReLU6,
    nn.RReLU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.Sigmoid,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
    nn.Threshold,
)
"""Elementwise activations: ``Pass`` rule (zennit's ``Activation`` types but ``MultiheadAttention``, and ``Mish``)."""
AVERAGE_POOLS = (
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
"""Average pools: ``Norm`` rule."""


@dataclass
class Plan:
    """What every module of the model gets during one call."""

    rules: dict[str, Rule]
    merges: dict[str, str]
    passes: list[str]
    norms: list[str]
    residuals: dict[str, Residual]
    stabilizer: float = 1e-6
    batch_norms: dict[str, str] = field(default_factory=dict)  # batch norm -> the layer merged with it

    def __post_init__(self) -> None:
        self.batch_norms = {bn: layer for layer, bn in self.merges.items()}


def plan(model: nn.Module, composite: Composite) -> Plan:
    """The rules, merges and pass-throughs of ``model`` under ``composite``; raises on modules nothing covers."""
    given = composite.rules(model)
    merges = {layer: bn for layer, bn in merged_batch_norms(model).items() if layer in given}
    merged = set(merges.values())
    rules: dict[str, Rule] = {}
    passes, norms, uncovered = [], [], []
    for name, module in units(model):
        rule = given.get(name)
        if isinstance(rule, Pass) and not isinstance(module, AFFINE):
            passes.append(name)
        elif rule is not None and isinstance(module, AFFINE):
            rules[name] = rule
        elif rule is not None:
            uncovered.append(f"{name!r} ({type(module).__name__}: {rule!r} applies to conv/linear layers only)")
        elif name in merged or isinstance(module, GRADIENT):
            continue
        elif isinstance(module, (*ACTIVATIONS, *BATCH_NORMS)):
            passes.append(name)
        elif isinstance(module, AVERAGE_POOLS):
            norms.append(name)
        else:
            uncovered.append(f"{name or '<model>'!r} ({type(module).__name__})")
    if uncovered:
        raise ValueError(
            f"{type(composite).__name__} has no rule for module(s) {', '.join(uncovered[:8])}"
            + (f" and {len(uncovered) - 8} more" if len(uncovered) > 8 else "")
            + ". Give their types a rule in the composite's `layer_map`, e.g. "
            f"{type(composite).__name__}(layer_map=[(torch.nn.LayerNorm, Pass())]) for a module that should hand "
            "relevance on unchanged (attribution.lrp.Pass), or Epsilon() for a conv/linear subclass"
        )
    return Plan(rules, merges, passes, norms, residual_blocks(model), composite.stabilizer)


class LRP:
    """Layer-wise relevance propagation (Bach et al. 2015, https://doi.org/10.1371/journal.pone.0130140).

    Numerically zennit 1.0's result for the same composite with its canonizers (batch norms merged, ResNet sums
    split by share), to about 1e-15 in float64. It costs 1.0-1.3x one forward and backward of the model (with
    parameter gradients) with the ``Epsilon`` / ``ZPlus`` composites, 1.5-2.1x with ``AlphaBeta`` and ``Gamma``
    (VGG-16 and ResNet-50, one thread; see the LRP docs page).

    The object keeps the weights the rules derive (merged with batch norms, positive and negative parts) from one
    call to the next while the parameters are unchanged (same storage and version counter): at most a few copies
    of the convolution weights, freed with the object.

    Args:
        model: a CNN or MLP of convolutions, linear layers, batch norms, activations, pools and torchvision/timm
            residual blocks. It is not modified.
        composite: the rule of each layer (:mod:`attribution.lrp.composites`); default
            :class:`~attribution.lrp.EpsilonPlusFlat`.

    Raises:
        ValueError: (at the call) a module no rule covers, named, with how to give it one.

    Example:
        >>> import torch, torchvision
        >>> from attribution import LRP
        >>> model = torchvision.models.vgg11(num_classes=4).eval()
        >>> x = torch.randn(1, 3, 32, 32)
        >>> relevance = LRP(model)(x, target=2)
        >>> relevance.shape
        torch.Size([1, 3, 32, 32])
    """

    def __init__(self, model: nn.Module, composite: Composite | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
        if composite is not None and not isinstance(composite, Composite):
            raise TypeError(
                f"`composite` must be an attribution.lrp Composite such as EpsilonPlusFlat(); got {composite!r}"
            )
        self.model = eager_module(model)  # torch.compile(model): its module, run eagerly (hooks need that)
        self.composite = composite if composite is not None else EpsilonPlusFlat()
        self._layers = _Layers()

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The relevance of ``target``'s logit at each element of ``inputs``.

        Args:
            inputs: ``(batch, ...)`` floating-point model inputs.
            target: ``None`` (each item's top class), a class, one class per item, or a callable
                ``logits -> (batch,)`` scores (seeded with its gradient times the logits).

        Returns:
            ``(batch, ...)``: the relevance, shaped like ``inputs``.
        """
        if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point() or inputs.dim() < 2:
            got = f"{tuple(inputs.shape)} {inputs.dtype}" if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise TypeError(f"`inputs` must be a floating-point tensor (batch, ...); got {got}")
        check_target(target, inputs.shape[0])
        steps = plan(self.model, self.composite)
        with HookedRun(self.model, "LRP", with_grad=True) as run:
            wiring = _Wiring(self.model, steps, run, self._layers)
            output = run.forward(inputs)
            wiring.check_finished()
            logits = class_logits(output)
            seed = _seed(logits, target)
            if wiring.leaf is None or not logits.requires_grad:
                raise no_dependence("the input", "inputs", logits)
            (relevance,) = torch.autograd.grad(logits, wiring.leaf, seed, allow_unused=True)
        if relevance is None:
            raise no_dependence("the input", "inputs", logits)
        _warn_degenerate(relevance)
        return relevance.detach()


def _seed(logits: torch.Tensor, target: Target) -> torch.Tensor:
    """The relevance at the output: one-hot target times the logits, or a callable target's gradient times them."""
    values = logits.detach()
    if callable(target):
        with torch.enable_grad():
            proxy = values.clone().requires_grad_(True)
            scores = target(proxy)
            if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (values.shape[0],):
                got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise ValueError(f"a callable `target` must return scores of shape ({values.shape[0]},); got {got}")
            (weights,) = torch.autograd.grad(scores.sum(), proxy)
        return weights * values
    index = class_indices(values, target, values.shape[0])
    one_hot = torch.zeros_like(values).scatter_(1, index[:, None], 1.0)
    return one_hot * values


def _warn_degenerate(relevance: torch.Tensor) -> None:
    if not bool(torch.isfinite(relevance).all()):
        warn(
            "LRP relevance has NaN or infinite entries: a stabiliser of 0 met a zero denominator, or the model "
            "overflows in this dtype; use a larger `epsilon`/`stabilizer` in the composite, or float64"
        )
    elif not bool(relevance.any()):
        warn(
            "LRP relevance is all zeros: the target logit is 0 for these inputs (the relevance starts from it); "
            "choose another `target`"
        )


class _Layers:
    """The layers as the rules see them (batch norms merged, modified weights memoised), kept between calls.

    A layer is kept for as long as the tensors it is made of are unchanged (same storage, same version counter).
    """

    def __init__(self) -> None:
        self.kept: dict[str, tuple[tuple[Any, ...], Layer]] = {}

    def get(self, name: str, module: nn.Module, norm: nn.Module | None = None) -> Layer:
        """The layer of ``module`` (merged with the batch norm ``norm`` if given)."""
        tensors = [t for m in (module, norm) if m is not None for t in (*m.parameters(), *m.buffers())]
        key: tuple[Any, ...] = (*(_version(t) for t in tensors), id(module), id(norm), getattr(norm, "eps", None))
        kept = self.kept.get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
        layer = Layer.of(module) if norm is None else Layer.of(module, *merge(module, norm))
        self.kept[name] = (key, layer)
        return layer


def _version(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape))


class _Wiring:
    """The hooks of one call and the tensors they pass between each other (inputs waiting for their outputs)."""

    def __init__(self, model: nn.Module, steps: Plan, run: HookedRun, layers: _Layers) -> None:
        self.model = model
        self.layers = layers
        self.plan = steps
        self.run = run
        self.leaf: torch.Tensor | None = None
        self.inputs: dict[str, list[torch.Tensor]] = {}  # module -> inputs of calls that have not returned yet
        self.waiting: dict[str, tuple[str, torch.Tensor, torch.Tensor]] = {}  # batch norm -> (layer, x, layer output)
        self.summands: dict[tuple[str, str], torch.Tensor] = {}  # (block, "branch" | "shortcut") -> tensor
        group = run.group
        group.forward_pre("", self._start)
        own = [*steps.rules, *steps.batch_norms, *steps.passes, *steps.norms]
        if own:
            group.forward_pre(own, self._before, with_kwargs=True)
        if steps.rules:
            group.forward(list(steps.rules), self._layer)
        if steps.batch_norms:
            group.forward_pre(list(steps.batch_norms), self._check_merge, with_kwargs=True)
            group.forward(list(steps.batch_norms), self._merged)
        if steps.passes:
            group.forward(steps.passes, self._pass)
        if steps.norms:
            group.forward(steps.norms, self._norm)
        for block, spec in steps.residuals.items():
            group.forward(_child(block, spec.branch), partial(self._summand, block, "branch"))
            if spec.shortcut is not None:
                group.forward(_child(block, spec.shortcut), partial(self._summand, block, "shortcut"))
        if steps.residuals:
            group.forward(list(steps.residuals), self._sum, with_kwargs=True)

    # -- forward hooks ------------------------------------------------------------------------------------------
    def _start(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        """Make the model's input the leaf the relevance arrives at (autograd on from here)."""
        if self.leaf is not None or not args:
            return None
        new = self.run.leaf(args)
        self.leaf = new[0] if isinstance(new[0], torch.Tensor) else None
        return new

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str) -> Any:
        """Keep the input; run the module without autograd (its output is handed on by a rule function)."""
        x, key = _first_input(module, args, kwargs, name)
        self.inputs.setdefault(name, []).append(x)
        torch.set_grad_enabled(False)
        if getattr(module, "inplace", False) is not True:
            return None
        copy = x.detach().clone()  # an in-place activation must not overwrite the kept input
        if isinstance(key, int):
            return (copy, *args[1:]), kwargs
        return args, {**kwargs, key: copy}

    def _layer(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, *, name: str) -> Any:
        x = self.inputs[name].pop()
        merged = self.plan.merges.get(name)
        if merged is not None:  # the rule runs at the batch norm's output, autograd stays off until then
            self.waiting[merged] = (name, x, output)
            return None
        step = self.plan.rules[name].prepare(self.layers.get(name, module), x, output.detach())
        torch.set_grad_enabled(True)
        return RuleFunction.apply(x, [output.detach()], step)

    def _check_merge(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str) -> None:
        waiting = self.waiting.get(name)
        if waiting is None or _first_input(module, args, kwargs, name)[0] is not waiting[2]:
            layer = self.plan.batch_norms[name]
            raise SiteValueError(
                f"batch norm {name!r} follows {layer!r} in module order but does not take its output directly, "
                "so the two cannot be merged for LRP; LRP supports batch norms applied right after a conv/linear "
                "layer, or anywhere else when no conv/linear layer precedes them in module order"
            )

    def _merged(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, *, name: str) -> Any:
        self.inputs[name].pop()
        layer_name, x, _ = self.waiting.pop(name)
        layer = self.layers.get(layer_name, self.model.get_submodule(layer_name), module)
        plain = type(module).forward in (bn.forward for bn in BATCH_NORMS)
        z = output.detach() if plain else layer.forward(x, layer.weight, layer.bias)  # BatchNormAct: z before act
        step = self.plan.rules[layer_name].prepare(layer, x, z)
        torch.set_grad_enabled(True)
        return RuleFunction.apply(x, [output.detach()], step)

    def _pass(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, *, name: str) -> Any:
        x = self.inputs[name].pop()
        torch.set_grad_enabled(True)
        return PassFunction.apply(x, [output.detach()])

    def _norm(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, *, name: str) -> Any:
        x = self.inputs[name].pop()
        torch.set_grad_enabled(True)
        fn = partial(type(module).forward, module)
        return NormFunction.apply(x, [output.detach()], fn, self.plan.stabilizer)

    def _summand(self, block: str, which: str, module: nn.Module, args: Any, output: Any) -> Any:
        self.summands[(block, which)] = output
        return output.detach().clone() if which == "branch" else None  # the block may add to it in place

    def _sum(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor, *, name: str
    ) -> Any:
        branch = self.summands.pop((name, "branch"))
        shortcut = self.summands.pop((name, "shortcut"), None)
        shortcut = _first_input(module, args, kwargs, name)[0] if shortcut is None else shortcut
        return SumFunction.apply(branch, shortcut, [output.detach()], self.plan.stabilizer)

    def check_finished(self) -> None:
        """Every merged layer met its batch norm (else its relevance would be lost)."""
        if self.waiting:
            names = ", ".join(f"{layer!r} -> {bn!r}" for bn, (layer, _, _) in self.waiting.items())
            raise ValueError(f"the batch norm(s) merged with these layers did not run after them: {names}")


def _first_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str
) -> tuple[torch.Tensor, int | str]:
    """A call's first input and its key: ``args[0]`` (0), or by the name of ``forward``'s first parameter."""
    if args:
        return args[0], 0
    first = next(iter(inspect.signature(module.forward).parameters), None)
    if first is not None and isinstance(kwargs.get(first), torch.Tensor):
        return kwargs[first], first
    raise SiteValueError(
        f"LRP needs the input of {name!r} ({type(module).__name__}): its forward's first parameter {first!r}, "
        f"positional or by keyword; the call passed only the keyword(s) {sorted(kwargs)}. Call the module with its "
        "input first"
    )


def _child(block: str, child: str) -> str:
    return f"{block}.{child}" if block else child
