"""``TCAV``: how often the target's gradient at a layer points along a concept's CAVs, and whether that is chance."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._inputs import batches
from .._run import HookedRun, eager_module, no_dependence
from ..targets import Target, check_target, target_indices, target_scores
from . import _draws, _fit, _math, _stats
from ._fit import Kind
from ._record import activation, layer_names, record_sets
from .cav import CAV


@dataclass(frozen=True)
class ConceptScore:
    """TCAV's answer for one concept at one layer.

    Attributes:
        sign_count: the mean over runs of the share of inputs whose directional derivative along the run's CAV is
            positive (Kim et al.'s TCAV score).
        magnitude: the mean over runs of ``sum max(d, 0) / sum |d|`` over the inputs (0 when every ``d`` is 0).
        p_value: the two-sided t-test of the runs' sign counts against the random-vs-random CAVs' sign counts at this
            layer, Bonferroni-corrected: multiplied by the number of concepts times layers, capped at 1 (``nan`` when
            both samples are constant and equal).
        significant: ``p_value < alpha``.
        sign_counts: ``(runs,)`` the sign count of each run.
        magnitudes: ``(runs,)`` the magnitude of each run.
        random_sign_counts: ``(runs,)`` the sign counts of the random-vs-random CAVs (the null sample).
        accuracy: the mean held-out accuracy of the concept's CAVs.
        derivatives: ``(runs, items)`` the directional derivatives ``grad . v`` themselves.
    """

    sign_count: float
    magnitude: float
    p_value: float
    significant: bool
    sign_counts: torch.Tensor
    magnitudes: torch.Tensor
    random_sign_counts: torch.Tensor
    accuracy: float
    derivatives: torch.Tensor


@dataclass(frozen=True)
class TCAVResult:
    """What :class:`TCAV` returns: ``scores[concept][layer]``, a :class:`ConceptScore`, labelled (no order to mix up).

    Attributes:
        scores: ``{concept: {layer: ConceptScore}}``.
        layers: the layers, in model order.
        runs: the runs per concept.
        tests: the Bonferroni factor (concepts times layers).
        alpha: the significance level.
    """

    scores: dict[str, dict[str, ConceptScore]]
    layers: list[str]
    runs: int
    tests: int
    alpha: float


class TCAV:
    """Testing with concept activation vectors (Kim et al. 2018, https://arxiv.org/abs/1711.11279), with its t-test.

    For each concept and layer, ``runs`` CAVs are fitted (:func:`~attribution.cav`), each against another
    set of random counterexamples, and ``runs`` random-vs-random CAVs beside them. Called on inputs, the target's
    gradient at every layer comes from one backward per batch, and its dot product with every CAV gives the
    directional derivatives; their sign count and magnitude per run are averaged, and the runs' sign counts are
    compared with the random CAVs' by a two-sided t-test (Student's, as Kim et al.; ``test="welch"``), Bonferroni-
    corrected over concepts and layers.

    The random sets of each run: with ``random_concepts`` a list of example sets (at least ``runs + 1``), Kim et al.'s
    design: run ``i`` fits each concept against set ``i + 1``, and the null CAV of run ``i`` is set 0 against set
    ``i + 1``. Set 0 and the concept are shared by all runs, so the runs are not independent and the test is
    over-confident (a random concept set often comes out significant). With one pool of examples (a tensor or a mapping
    of tensors), every run draws three disjoint sets of ``set_size`` examples afresh (seeded): the concepts'
    counterexamples and the two sets of that run's null CAV, so that the null's spread is that of independent random
    pairs. Only the concept's own set is still shared by its runs: use many concept examples.

    The CAVs are fitted at the first call and kept (:attr:`cavs`, :attr:`random_cavs`).

    Args:
        model: the model.
        layers: module names, globs or modules.
        concepts: ``{name: examples}``, each a tensor of inputs ``(examples, ...)``, a mapping of such tensors, or an
            iterable of batches; at least two examples each.
        random_concepts: a list of at least ``runs + 1`` example sets, or one pool of examples to draw them from.
        runs: the CAVs per concept and layer (at least 2).
        kind: the CAVs' classifier: ``"logistic"``, ``"sgd"`` or ``"mean"`` (see :func:`~attribution.cav`).
        seed: seeds the draws from a pool, the held-out splits and SGD.
        held_out: the share of each set held out for the CAVs' accuracy.
        alpha: the significance level of the corrected p-values.
        test: ``"student"`` (pooled variance, as Kim et al. and ``scipy.stats.ttest_ind``) or ``"welch"``.
        set_size: the size of each set drawn from a pool (default: the smallest concept's size).
        batch_size: examples per forward for tensors and mappings.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> head = torch.nn.Linear(4, 2)
        >>> model = torch.nn.Sequential(torch.nn.Identity(), head)
        >>> along = head.weight[1].detach() - head.weight[0].detach()   # what raises class 1 over class 0
        >>> concepts = {"up": torch.randn(30, 4) + 3 * along, "down": torch.randn(30, 4) - 3 * along}
        >>> result = TCAV(model, "0", concepts, torch.randn(200, 4), runs=5)(torch.randn(16, 4), target=1)
        >>> result.scores["up"]["0"].sign_count, result.scores["down"]["0"].sign_count
        (1.0, 0.0)
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Any,
        concepts: Mapping[str, Any],
        random_concepts: Any,
        runs: int = 10,
        kind: Kind = "logistic",
        seed: int = 0,
        *,
        held_out: float = 0.2,
        alpha: float = 0.05,
        test: _stats.Test = "student",
        set_size: int | None = None,
        batch_size: int = 64,
    ) -> None:
        _fit.check_options(kind, held_out)
        _check_tcav_options(concepts, random_concepts, runs, test, set_size, alpha)
        self.model, self.kind, self.seed, self.runs = model, kind, seed, runs
        self.layers = layer_names(model, layers, what="`layers`")
        self.concepts, self.random_concepts = dict(concepts), random_concepts
        self.held_out, self.alpha, self.test, self.set_size, self.batch_size = (
            held_out,
            alpha,
            test,
            set_size,
            batch_size,
        )
        self._cavs: dict[str, dict[str, list[CAV]]] | None = None
        self._random: dict[str, list[CAV]] = {}

    @property
    def cavs(self) -> dict[str, dict[str, list[CAV]]]:
        """``{concept: {layer: [CAV of each run]}}``, fitted at the first use."""
        if self._cavs is None:
            self._cavs, self._random = self._fit()
        return self._cavs

    @property
    def random_cavs(self) -> dict[str, list[CAV]]:
        """``{layer: [random-vs-random CAV of each run]}``, the null sample."""
        _ = self.cavs
        return self._random

    def __call__(self, inputs: Any, target: Target = None) -> TCAVResult:
        """Score the concepts on ``inputs`` (a tensor, a mapping of tensors or an iterable of batches) for ``target``.

        ``target`` as every method takes it: ``None`` (each item's top class), a class, one class per item, or a
        callable ``output -> (batch,)``.
        """
        if isinstance(inputs, torch.Tensor):
            check_target(target, len(inputs))
        cavs, names = self.cavs, list(self.concepts)
        stacked = {
            layer: torch.stack(
                [v.vector for name in names for v in cavs[name][layer]] + [v.vector for v in self._random[layer]]
            )
            for layer in self.layers
        }
        derivatives = directional_derivatives(self.model, self.layers, stacked, inputs, target, self.batch_size)
        tests = len(names) * len(self.layers)
        scores: dict[str, dict[str, ConceptScore]] = {name: {} for name in names}
        for layer, d in derivatives.items():
            null = _math.sign_count(d[:, len(names) * self.runs :])
            for i, name in enumerate(names):
                own = d[:, i * self.runs : (i + 1) * self.runs]
                scores[name][layer] = self._score(own, null, cavs[name][layer], tests)
        return TCAVResult(scores, list(self.layers), self.runs, tests, self.alpha)

    def _score(self, d: torch.Tensor, null: torch.Tensor, cavs: list[CAV], tests: int) -> ConceptScore:
        """One concept at one layer: its runs' derivatives ``d (items, runs)`` against the null's sign counts."""
        counts, magnitudes = _math.sign_count(d), _math.magnitude(d)
        p = _math.bonferroni(_stats.t_test(counts.tolist(), null.tolist(), self.test), tests)
        return ConceptScore(
            sign_count=float(counts.mean()),
            magnitude=float(magnitudes.mean()),
            p_value=p,
            significant=bool(p < self.alpha),
            sign_counts=counts,
            magnitudes=magnitudes,
            random_sign_counts=null,
            accuracy=float(torch.tensor([c.accuracy for c in cavs], dtype=torch.float64).mean()),
            derivatives=d.T.detach().cpu(),
        )

    def _fit(self) -> tuple[dict[str, dict[str, list[CAV]]], dict[str, list[CAV]]]:
        """Record every set once at every layer, draw the runs, fit the concepts' and the null's CAVs."""
        pool = not isinstance(self.random_concepts, (list, tuple))
        randoms = [self.random_concepts] if pool else list(self.random_concepts)
        labels = [f"concept {name!r}" for name in self.concepts]
        labels += ["`random_concepts` (the pool)"] if pool else [f"random set {i}" for i in range(len(randoms))]
        found, shapes = record_sets(
            self.model, [*self.concepts.values(), *randoms], labels, self.layers, batch_size=self.batch_size
        )
        own, rest = found[: len(self.concepts)], found[len(self.concepts) :]
        sizes = [len(r[self.layers[0]]) for r in rest]
        if pool:
            size = self.set_size or min(len(o[self.layers[0]]) for o in own)
            runs = _draws.pool_runs(sizes[0], size, self.runs, self.seed)
        else:
            runs = _draws.kim_runs(sizes, self.runs)
        cavs: dict[str, dict[str, list[CAV]]] = {name: {} for name in self.concepts}
        null: dict[str, list[CAV]] = {}
        for layer in self.layers:
            rows = torch.cat([r[layer] for r in rest])

            def one(pos: torch.Tensor, neg: torch.Tensor, run: int, layer: str = layer) -> CAV:
                vector, accuracy = _fit.direction(pos, neg, layer, self.kind, self.seed + run, self.held_out)
                return CAV(vector, accuracy, layer, self.kind, shapes[layer])

            for name, acts in zip(self.concepts, own, strict=True):
                cavs[name][layer] = [one(acts[layer], rows[r.against.to(rows.device)], i) for i, r in enumerate(runs)]
            null[layer] = [
                one(rows[r.null_concept.to(rows.device)], rows[r.null_against.to(rows.device)], i)
                for i, r in enumerate(runs)
            ]
        return cavs, null


def directional_derivatives(
    model: nn.Module, layers: list[str], vectors: dict[str, torch.Tensor], inputs: Any, target: Target, batch_size: int
) -> dict[str, torch.Tensor]:
    """``{layer: (items, k)}``: the target's gradient at each layer (flattened) dotted with that layer's ``k`` vectors.

    One forward and one backward per batch give the gradients at every layer, for every vector.
    """
    index = None if target is None or callable(target) else target_indices(target, "`target`")
    found: dict[str, list[torch.Tensor]] = {layer: [] for layer in layers}
    seen = 0
    with HookedRun(eager_module(model), "TCAV", with_grad=True) as run:
        leaves: dict[str, torch.Tensor] = {}

        def at_layer(module: nn.Module, args: Any, output: Any, *, name: str, call: int) -> torch.Tensor:
            leaves[name] = run.leaf(activation(output, name, call))
            return leaves[name].clone()  # what runs on is a copy: an in-place operation next must not touch the leaf

        run.group.forward(layers, at_layer)
        for batch in batches(inputs, batch_size):
            leaves.clear()
            output = run.forward(batch)
            missing = [layer for layer in layers if layer not in leaves]
            if missing:
                raise ValueError(f"`layers` {missing[0]!r} did not run during the forward pass of `inputs`")
            count = len(leaves[layers[0]])
            part = index[seen : seen + count] if index is not None and index.dim() == 1 else index
            scores = target_scores(output, target if part is None else part, count)
            grads = run.gradients(scores, [leaves[layer] for layer in layers], "`layers`", layers)
            for layer, grad in zip(layers, grads, strict=True):
                if grad is None:
                    raise no_dependence("`layers`", layer, scores)
                found[layer].append(_along(grad, vectors[layer], layer))
            seen += count
    return {layer: torch.cat(parts) for layer, parts in found.items()}


def _along(grad: torch.Tensor, vectors: torch.Tensor, layer: str) -> torch.Tensor:
    """``grad.flatten(1) @ vectors.T``, checked: the inputs' activations have the concepts' size at ``layer``."""
    flat = grad.flatten(1)
    if flat.shape[1] != vectors.shape[1]:
        raise ValueError(
            f"`inputs` give activations of {flat.shape[1]} values per item at layer {layer!r} (shape "
            f"{tuple(grad.shape[1:])}), but the concepts' examples gave {vectors.shape[1]}: give inputs of the concept "
            "examples' shape"
        )
    return (flat.to(vectors.dtype) @ vectors.T).detach()


def _check_tcav_options(concepts: Any, random_concepts: Any, runs: Any, test: Any, set_size: Any, alpha: Any) -> None:
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 2:
        raise ValueError(f"`runs` must be an integer of at least 2 (the t-test needs two runs); got {runs!r}")
    if not isinstance(concepts, Mapping) or not concepts or not all(isinstance(k, str) for k in concepts):
        raise TypeError(
            f"`concepts` must be a non-empty dict {{name: examples}} with string names; got {type(concepts).__name__}"
        )
    if isinstance(random_concepts, (list, tuple)) and len(random_concepts) < runs + 1:
        raise ValueError(
            f"`random_concepts` is a list of {len(random_concepts)} example sets, but runs={runs} needs at least "
            f"{runs + 1} (one counterexample set per run and one more for the random-vs-random CAVs); give more sets, "
            "fewer runs, or one pool of examples to draw them from"
        )
    if not isinstance(random_concepts, (list, tuple, torch.Tensor, Mapping)):
        raise TypeError(
            "`random_concepts` must be a list of example sets or one pool of examples (a tensor or a mapping of "
            f"tensors); got {type(random_concepts).__name__}"
        )
    if test not in ("student", "welch"):
        raise ValueError(f"`test` must be 'student' or 'welch'; got {test!r}")
    if set_size is not None and (not isinstance(set_size, int) or set_size < 2):
        raise ValueError(f"`set_size` must be an integer of at least 2; got {set_size!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"`alpha` must be a significance level in (0, 1); got {alpha!r}")
