"""Attribution patching (AtP): every cell of an activation-patching sweep estimated from one backward pass.

Attribution patching (`Nanda 2023 <https://www.neelnanda.io/mechanistic-interpretability/attribution-patching>`_;
AtP*, `Kramár et al. 2024 <https://arxiv.org/abs/2403.00745>`_; EAP, `Syed et al. 2023
<https://arxiv.org/abs/2310.10348>`_) replaces the one-forward-per-cell sweep of
:func:`attribution.activation_patching` by its first-order Taylor expansion around the run being patched:
``metric(patched) ~ metric(target) + sum_cell (a_source - a_target) . d metric / d a``. With ``ig_steps=k`` the
gradient is averaged over ``k`` points of the straight line between the two activations (integrated gradients at
the site, as in `Marks et al. 2024 <https://arxiv.org/abs/2403.19647>`_ and EAP-IG, `Hanna et al. 2024
<https://arxiv.org/abs/2403.17806>`_).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hooks import ModuleTarget

from .._inputs import batch_size
from .._maps import at_least_float32 as wide
from .._progress import progress as progress_bar
from .._relp import Rules, relp_sites
from .._run import Element, HookedRun, SiteTypeError, hook_site, no_dependence, reentrant_checkpoint, warn
from .._transformer_rules import Sites, register_rules
from ..models import LMLayout
from ._sweep import (
    DEFAULT_HEAD_PATTERN,
    Cells,
    Inputs,
    check_direction,
    chosen_cells,
    prepare,
    ran_more_often,
    reference_run,
)
from .result import PatchingResult
from .sites import Site, check_site

Calls = dict[str, list[torch.Tensor]]  # module name -> one tensor per call of the module in one forward


def attribution_patching(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    layers: ModuleTarget,
    metric: Callable[[Any], torch.Tensor],
    *,
    site: Literal["output", "input"] = "output",
    element: Element = None,
    cells: Cells | None = None,
    positions: bool | Sequence[int] = True,
    heads: int | None = None,
    head_pattern: str = DEFAULT_HEAD_PATTERN,
    per_example: bool = False,
    normalize: bool = False,
    direction: Literal["denoise", "noise"] = "denoise",
    ig_steps: int = 1,
    rules: Rules = "gradient",
    progress: bool = True,
    layout: LMLayout | None = None,
) -> PatchingResult:
    """Estimate :func:`attribution.activation_patching` to first order, every cell from one backward pass.

    Denoising (default): the clean input runs once without autograd and its activations ``a_clean`` are recorded;
    the corrupted input runs once with autograd from the first requested site on, and ``metric`` is differentiated
    with respect to the activation of every site (nothing else: the model's parameters do not require grad during
    the call). Each cell gets

    ``metric(corrupted) + sum over the cell's elements of (a_clean - a_corrupted) * d metric / d a``

    the first-order estimate of what :func:`attribution.activation_patching` measures for that cell, with the same
    shape and meaning, so that the two compare cell for cell. Noising swaps the runs. A module that runs several
    times in one forward is patched at each call, so its estimate sums over its calls.

    With ``ig_steps=k > 1`` the gradient is the mean over the ``k`` points ``a_t + j / k * (a_s - a_t)``,
    ``j = 0 .. k-1``, of the line from the target's activation ``a_t`` to the source's ``a_s`` (a left Riemann sum of
    integrated gradients, so ``k=1`` is plain AtP). Each layer's whole activation (every position and head) moves
    along its line while the rest of the model runs on: a layer's path needs runs of its own, so integrated
    gradients cost ``k - 1`` more forward + backward passes per layer. The same holds, for the ``j = 0`` point, for a
    module that runs several times in one forward: its calls' gradients must hold each other fixed, as patching all
    calls does, so such a layer gets one run of its own. With ``positions=False`` and no heads, the estimate tends to
    the exact patching result as ``k`` grows.

    With ``rules="relp"`` the gradient is RelP's (relevance patching, `Jafari et al. 2025
    <https://arxiv.org/abs/2508.21258>`_): the backward of the same forward through LRP's rules (norm scales held
    constant, the identity rule on the MLP's activation, half of the gradient to each factor of a gated MLP's product;
    linear maps and attention by their gradient), for a HuggingFace decoder language model (Llama/Qwen2/Mistral
    layout or GPT-2). The cost is AtP's; the estimate is the same formula with ``g`` the propagation coefficients.

    Args:
        model: any module (a ``torch.compile`` d model: the module it wraps); called as ``model(x)``, ``model(*x)``
            for a tuple or ``model(**x)`` for a mapping (a HuggingFace tokenizer's ``BatchEncoding`` as it is).
        clean: the clean input.
        corrupted: the corrupted input, same structure and shapes.
        layers: modules whose site is patched (names, globs, modules), in the order of the result's first axis.
        metric: ``metric(model_output)``: a scalar tensor, or with ``per_example=True`` a ``(batch,)`` tensor; it
            must be differentiable in the activations.
        site: ``"output"`` of the modules, or their ``"input"``: the first argument as called (positional, else the
            first keyword argument).
        element: for tuple, mapping or ``ModelOutput`` sites, the tensor that is the site (an index or a name); for
            ``site="input"``, the argument (a position or a parameter name such as ``"hidden_states"``).
        cells: the cells of the sweep as one value, :class:`~attribution.patching.Cells` (the four keywords
            below, documented there); not together with them.
        positions: one cell per position (``True``), per listed position, or none (``False``): see ``Cells``.
        heads: one cell per head, the activation viewed through ``head_pattern``: see ``Cells``.
        head_pattern: the heads' view of the activation: see ``Cells``.
        per_example: keep one value per batch item (a trailing batch axis): see ``Cells``. The per-item gradients
            come from one backward pass of the summed metric, so batch items must not interact in the model.
        normalize: return ``(estimate - m_target) / (m_source - m_target)``: 0 is the unpatched run of the input
            being patched, 1 the run the activations come from (as in :func:`attribution.activation_patching`).
        direction: ``"denoise"`` (clean into corrupted: gradients on the corrupted run) or ``"noise"`` (corrupted
            into clean: gradients on the clean run).
        ig_steps: points on the line from the target's activation to the source's at which the gradient is taken
            and averaged; 1 is plain attribution patching.
        rules: ``"gradient"`` (attribution patching) or ``"relp"`` (relevance patching: ``g`` from LRP's rules).
        progress: show a tqdm progress bar on a terminal over the extra runs of ``ig_steps > 1`` (and of layers
            called several times per forward).
        layout: with ``rules="relp"``, the model's :func:`attribution.models.lm_layout` where its modules are not
            found by name (the same keywords in every family).

    Returns:
        A float32 CPU :class:`~attribution.patching.PatchingResult` ``(layers, positions)``, ``(layers,)``,
        ``(layers, heads)`` or ``(layers, positions, heads)``, plus a trailing batch axis with ``per_example=True``:
        the estimated metric
        of each patched run (or its normalised value).

    Raises:
        ValueError: bad ``site``, ``direction``, ``ig_steps`` or ``rules``; ``rules="relp"`` on a model without the
            norms, activations and attention it looks for (``TypeError`` without ``get_input_embeddings``);
            ``clean`` and ``corrupted`` of different structure or shapes (before any forward); ``metric`` not a scalar
            (or ``(batch,)`` with ``per_example``) or not differentiable in any site, a layer that never runs,
            ``heads`` that do not divide the activation.
        TypeError: ``cells`` together with one of the keywords it replaces; a site that is not a floating-point tensor
            (a tuple needs ``element``); inputs of another form.
        IndexError: a position out of range.

    Warns:
        UserWarning: a layer whose activation does not reach the metric through differentiable operations (its
            estimates are the unpatched metric).

    Example:
        >>> from attribution import activation_patching
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
        >>> metric = lambda out: out[:, -1].mean()
        >>> estimate = attribution_patching(model, clean, corrupted, ["0", "1"], metric)
        >>> exact = activation_patching(model, clean, corrupted, ["0", "1"], metric, progress=False)
        >>> estimate.shape, bool(torch.allclose(estimate[1], exact[1], atol=1e-6))  # linear after the Tanh
        (torch.Size([2, 3]), True)
    """
    check_site(site)
    check_direction(direction)
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"`ig_steps` must be an int of at least 1 (1: plain attribution patching); got {ig_steps!r}")
    inputs = prepare(model, clean, corrupted, layers, ("`clean`", "`corrupted`"), swap=direction == "noise")
    where = relp_sites(inputs.model, rules, layout)
    taps = _Taps(site, element, metric, chosen_cells(cells, positions, heads, head_pattern, per_example), where)
    with HookedRun(inputs.model, "attribution-patching") as run:
        for p in inputs.model.parameters():  # no graph before the first site, no parameter gradients; restored on exit
            p.requires_grad_(False)
        recorded, source_metric = reference_run(run, inputs, taps.cells, site, element, metric)
        _, shape = taps.cells.plan(inputs.names, recorded, inputs.model, site)  # checks positions and heads
        source: Calls = {name: list(recorded.calls[name]) for name in inputs.names}
        target, grads, target_metric = _gradients(inputs, source, taps, ig_steps, progress)
    values = [_estimate(name, source[name], target[name], grads[name], taps, ig_steps) for name in inputs.names]
    effect = taps.cells.shaped(torch.stack(values).float().cpu(), shape, inputs.batch)
    base, top = target_metric.float().cpu(), source_metric.float().cpu()
    # normalised: 0 = the unpatched run, 1 = the run the activations come from
    return taps.cells.labelled(effect / (top - base) if normalize else base + effect, inputs.names)


@dataclass(frozen=True)
class _Taps:
    """Where the metric is differentiated: each layer's site (and element), the metric, and the cells."""

    site: Site
    element: Element
    metric: Callable[[Any], torch.Tensor]
    cells: Cells
    rules: Sites | None = None  # RelP's rules where they go; None: the plain gradient


def _gradients(
    inputs: Inputs, source: Calls, taps: _Taps, ig_steps: int, progress: bool
) -> tuple[Calls, dict[str, list[torch.Tensor | None]], torch.Tensor]:
    """The target's activations, the (integrated) gradients of the metric at them, and the target's metric.

    One shared forward + backward for every layer; then runs of one layer each: its line points ``j/k`` for
    ``j >= 1``, and ``j = 0`` where the shared run's gradient of a module called several times would also carry each
    call's effect through the module's later calls.
    """
    names = inputs.names
    target, grads, target_metric = _gradient_run(inputs.model, inputs.target, names, taps)
    for name in names:
        if len(target[name]) != len(source[name]):
            raise RuntimeError(
                f"{name!r} ran {len(target[name])} time(s) in the forward of the input being patched but "
                f"{len(source[name])} time(s) in the other: the two runs must call the same modules"
            )
    runs = [(name, j / ig_steps) for name in names for j in range(0 if len(source[name]) > 1 else 1, ig_steps)]
    for name, alpha in progress_bar(runs, desc="attribution patching", enabled=progress and bool(runs)):
        points = {name: [t + alpha * (s - t) for s, t in zip(source[name], target[name], strict=True)]}
        _, line, _ = _gradient_run(inputs.model, inputs.target, [name], taps, points)
        shared = [None] * len(line[name]) if alpha == 0 else grads[name]
        grads[name] = [_add(g, h) for g, h in zip(shared, line[name], strict=True)]
    return target, grads, target_metric


def _estimate(
    name: str,
    source: list[torch.Tensor],
    target: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    taps: _Taps,
    ig_steps: int,
) -> torch.Tensor:
    """One layer's first-order effects, summed over each cell and over the layer's calls; warns without gradient."""
    if all(g is None for g in grads):
        warn(
            f"`layers` {name!r} got no gradient: `metric` does not depend on its {taps.site} through differentiable "
            "operations, so its estimates are the unpatched metric. Check the layer and the metric (argmax, "
            ".item() or detach() cut the gradient)"
        )
    product = sum(
        (wide(s) - wide(t)) * (wide(g) / ig_steps)  # never multiplied and summed in half precision
        for s, t, g in zip(source, target, grads, strict=True)
        if g is not None
    )
    if not isinstance(product, torch.Tensor):
        product = torch.zeros_like(source[0])
    return taps.cells.sums(product)


def _gradient_run(
    model: nn.Module, inputs: Any, names: list[str], taps: _Taps, replace: Calls | None = None
) -> tuple[Calls, dict[str, list[torch.Tensor | None]], torch.Tensor]:
    """One forward + backward: the activations of ``names`` (every call), ``d metric / d activation``, the metric.

    Without ``replace``, every site is tapped where it is: the run goes on with an equal tensor through which the
    gradient also flows upstream, so an earlier site's gradient includes the paths through later sites. With
    ``replace`` (``name -> one tensor per call``), those activations are replaced and differentiated as leaves.
    The forward runs without autograd up to the first site (:meth:`HookedRun.leaf`); nothing after it keeps a graph
    for the parameters as long as they do not require grad (:func:`attribution_patching` switches that off).
    """
    batch = batch_size(inputs)
    leaves: Calls = {name: [] for name in names}

    with HookedRun(model, "attribution-patching-gradients", with_grad=True) as run:

        def tap(current: torch.Tensor, name: str, call_index: int) -> torch.Tensor:
            if not current.is_floating_point():
                raise SiteTypeError(
                    f"the {taps.site} of {name!r} is a {current.dtype} tensor: attribution patching differentiates "
                    "the metric with respect to the activation, which must be floating point"
                )
            calls = leaves[name]
            del calls[call_index:]
            if replace is None:
                # our own copy: an in-place change of the module's tensor later in the forward cannot reach it
                leaf = run.leaf(current.detach().clone())
                new = Tap.apply(current, leaf)  # a copy of `current`; its gradient reaches both
            else:
                if call_index >= len(replace[name]):
                    raise ran_more_often(name, len(replace[name]))
                leaf = run.leaf(replace[name][call_index].detach().to(current.dtype).clone())
                new = leaf.clone()  # later in-place operations change this copy, never the leaf
            calls.append(leaf)
            return new

        if taps.rules is not None:  # before the taps: a tapped site's gradient is the rules' from above it
            register_rules(run.group, taps.rules)  # RelP's sites: relp_sites keeps no attention rule
        hook_site(run.group, names, taps.site, taps.element, tap)
        value = taps.cells.metric(taps.metric, run.forward(inputs), batch)
        order = [(name, i) for name in names for i in range(len(leaves[name]))]
        if not value.requires_grad:
            if run.checkpointed or reentrant_checkpoint(value):
                raise no_dependence("`layers`", names[0], value, checkpointed=True)
            raise ValueError(
                f"`metric` returned a tensor without a gradient: it does not depend on any of `layers` ({names[0]!r}"
                f"{', ...' if len(names) > 1 else ''}) through differentiable operations (argmax, .item() or detach() "
                "cut the gradient)"
            )
        found = run.gradients(value, [leaves[n][i] for n, i in order], "`layers`", names)
    grads: dict[str, list[torch.Tensor | None]] = {name: [] for name in names}
    for (name, _), grad in zip(order, found, strict=True):
        grads[name].append(grad)
    acts = {name: [leaf.detach() for leaf in calls] for name, calls in leaves.items()}
    return acts, grads, value.detach()


class Tap(torch.autograd.Function):
    """``Tap.apply(x, leaf)``: a copy of ``x`` whose gradient goes to both ``x`` and ``leaf`` (equal tensors)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        """A copy of ``x``."""
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The same gradient to ``x`` (where it needs one) and to ``leaf``."""
        return (grad if ctx.needs_input_grad[0] else None), grad


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Sum of two gradients, ``None`` counting as zero."""
    if a is None or b is None:
        return b if a is None else a
    return a + b
