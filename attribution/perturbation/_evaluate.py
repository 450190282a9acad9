"""The one batched perturbation evaluator of every perturbation method: target scores of perturbed copies of items.

A perturbation is a weight per element of one item, ``w`` in ``[0, 1]``: the item becomes ``x * w + b * (1 - w)``
(``b`` the baseline; token ids take ``x`` where ``w`` is 1, ``b`` elsewhere). The same perturbations apply to every
item of the batch. :class:`Evaluator` runs the model through one :class:`attribution._run.HookedRun` (the model left
as found), scores the unperturbed inputs first (resolving ``target=None`` to the top class or next token and
measuring the largest activation to size the batches), then runs the perturbations ``per_forward`` at a time, item
after item in the batch (row ``b * k + j`` is item ``b`` under perturbation ``j``).

For a causal language model that takes ``past_key_values`` (``cache`` in transformers 5.2x) and an integer or
``None`` target (``reuse=True``), the unperturbed run keeps its keys/values; perturbations are sorted by the first
position they change and grouped where the groups cost the least (:func:`~._cache.prefix_groups`): a group whose
earliest change is at ``i`` runs only positions ``i..T-1`` on a copy of the cached positions ``< i`` (exact, the
same scores as a full re-run to float rounding), and costs :data:`CALL_COST` positions for the call itself plus the
positions it runs. Left to the budget, a group holds as many rows as fit it at its width (a group that starts later
runs fewer positions, so it holds more). Only the last position's logits are computed (``logits_to_keep=1``) where
the model can. A callable target gets the whole output of full runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from hooks import hooked_modules, tensors

from .._kv import returned_cache, usable_cache
from .._progress import progress
from .._run import HookedRun, warn
from ..models import cache_keyword, takes_logits_to_keep
from ..targets import Target, check_target, class_indices, class_logits, target_scores
from ._cache import first_changes, prefix_cache, prefix_groups
from ._continuation import Continuation, continuation_scores
from ._layer import LayerSite, close_scores
from ._masks import Baseline, baseline_batch

MEMORY_BUDGET = 2**28
"""Bytes a batch of perturbations may take at the model's largest activation (counted 3 times: in, out, spare)."""
CPU_BUDGET = 2**26
"""The same on the CPU: batches whose activations stay near the caches run faster there (resnet50 Occlusion and
SmolLM2 token ablation were fastest at 4 to 7 perturbations per call, about this budget; 256 MiB gave 22 to 27)."""
MAX_PER_FORWARD = 256
CALL_COST = {"cpu": 48}
"""A model call's own cost, counted in token positions of one row, per device type (others: 4096). On one CPU
thread SmolLM2-135M ran one position in 90 to 300 ms (quiet to loaded machine) and each position more, in large
batches, in 3.5 to 5 ms: every call reads every weight once, 25 to 60 positions' worth. An accelerator runs a
batch's positions side by side, so calls cost most there."""
"""The most perturbations in one forward when ``perturbations_per_forward`` is left to the budget."""

Weights = Callable[[int, int], torch.Tensor]  # (first, stop) -> (stop - first, *item) weights


class Evaluator:
    """Target scores of perturbed copies of ``inputs`` (see the module documentation); a context manager.

    Args:
        model: the network (its eager module).
        method: the method's name, for errors, warnings and the hook group.
        inputs: ``(batch, *item)``, floating point, or token ids ``(batch, T)``.
        target: what is explained (:mod:`attribution.targets`); for a language model (3-D logits) an integer is
            the log-probability of that token at the last position, ``None`` the top token there; a
            :class:`~._continuation.Continuation` the log-probability of each of its tokens (``N`` scores per item).
        baseline: what perturbed elements become (``baseline=`` of the methods), for the inputs or, with ``layer``,
            for the layer's output.
        per_forward: perturbations per forward, or ``None`` for as many as fit :data:`MEMORY_BUDGET` (on the CPU
            :data:`CPU_BUDGET`).
        reuse: reuse a causal language model's unperturbed keys/values (see the module documentation).
        show_progress: a progress bar on a terminal on long calls.
        layer: the qualified name of a module whose output is perturbed instead of the inputs (see ``_layer.py``).

    ``units`` is what the perturbations act on, ``(batch, *item)``: the inputs, or with ``layer`` the layer's
    unperturbed output (known once the context is entered). Scores are ``(batch * outputs, ...)``: one row per item,
    or with a continuation one per item and token (row ``b * N + i``); :meth:`result` gives attributions their shape.
    """

    def __init__(
        self,
        model: nn.Module,
        method: str,
        inputs: torch.Tensor,
        target: Target | Continuation,
        baseline: Baseline,
        *,
        per_forward: int | None,
        reuse: bool = True,
        show_progress: bool = True,
        layer: str | None = None,
    ) -> None:
        self.model, self.method, self.x, self.layer = model, method, inputs, layer
        self.batch = inputs.shape[0]
        self.keyword = None if inputs.is_floating_point() else cache_keyword(model)  # a HuggingFace LM
        self.tokens: torch.Tensor | None = None  # (batch, N) a continuation's tokens
        if isinstance(target, Continuation):
            self.tokens = self._continuation(target)
        else:
            check_target(target, self.batch)
        self.target: Target | Continuation = target
        self.per_forward = per_forward
        self.sized = per_forward is None  # sized by the budget: token groups hold rows by their width
        self.units = inputs
        self._baseline = baseline
        self.baseline = baseline_batch(baseline, inputs, model) if layer is None else inputs  # set on entry
        self.reuse = reuse and layer is None and self.keyword is not None and not callable(target)
        self.last_only = self.keyword is not None and not callable(target) and takes_logits_to_keep(model)
        self.length = inputs.shape[-1] + (0 if self.tokens is None else self.tokens.shape[1] - 1)  # positions run
        self.show_progress = show_progress
        self.forwards = 0  # model calls made, for the cost model and tests
        self.cache: Any = None
        self.site: LayerSite | None = None
        self._run = HookedRun(model, method)
        self._stack = ExitStack()

    def _continuation(self, target: Continuation) -> torch.Tensor:
        """A continuation's tokens ``(batch, N)``, checked: the inputs must be a causal LM's token ids."""
        if self.keyword is None:
            raise TypeError(
                f"{self.method}: a `Continuation` target needs token ids (batch, P) of a HuggingFace causal language "
                f"model (its forward takes input_ids and a key/value cache); got {type(self.model).__name__} on "
                f"{tuple(self.x.shape)} {self.x.dtype} inputs"
            )
        embedding = getattr(self.model, "get_input_embeddings", lambda: None)()
        vocabulary = getattr(embedding, "num_embeddings", None)
        return target.rows(self.batch, self.x.device, vocabulary)

    def result(self, attributions: torch.Tensor, single: bool) -> torch.Tensor:
        """Attributions ``(batch * outputs, *item)`` shaped: ``(batch, *item)``, or ``(batch, N, *item)``."""
        if self.units.is_floating_point():
            attributions = attributions.to(self.units.dtype)
        if self.tokens is not None:
            attributions = attributions.reshape(self.batch, self.tokens.shape[1], *attributions.shape[1:])
        return attributions[0] if single else attributions

    def __enter__(self) -> Evaluator:
        hooked = {id(m) for m in hooked_modules(self.model)} if self.layer is not None else set()  # the user's
        self._run.__enter__()
        try:
            if self.layer is not None:
                self.site = LayerSite(self._run, self.layer, hooked, self.method)
            self.full = self._unperturbed()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cache = None
        try:
            self._stack.close()  # the layer's replay: every module's forward restored
        finally:
            self._run.__exit__(*exc)

    # -- the unperturbed run ------------------------------------------------------------------------------------
    def _unperturbed(self) -> torch.Tensor:
        """Score the inputs, resolve the target, measure the largest activation per item, keep the LM cache."""
        largest = [0]

        def measure(module: nn.Module, args: Any, output: Any) -> None:
            largest[0] = max([largest[0], *(t.numel() * t.element_size() for t in tensors(output))])

        handles = self._run.group.forward(list(self.model.modules()), measure)
        try:
            if self.site is not None:  # traced: the calls up to the layer are replayed afterwards
                output = self.site.trace(self._call, self.x, self._stack)
            else:
                output = self._call(self.x, store=self.reuse)
        finally:
            for handle in handles:
                handle.remove()
        if self.site is not None:
            assert self.site.activation is not None
            self.units = self.site.activation
            self.baseline = baseline_batch(
                self._baseline, self.units, self.model, of=f"the outputs of `layer` {self.layer!r}"
            )
        self.lm = _lm_logits(output) is not None and not callable(self.target)
        if self.reuse:
            assert self.keyword is not None
            cache = returned_cache(output, self.keyword)
            self.reuse = usable_cache(cache, self.length)
            self.cache = cache if self.reuse else None
        if not callable(self.target) and not isinstance(self.target, Continuation):
            self.target = _resolve(output, self.target, self.batch, self.lm)
        per_item = max(largest[0], self.units[0].numel() * self.units.element_size(), 1) / self.batch
        if self.per_forward is None:
            budget = CPU_BUDGET if self.units.device.type == "cpu" else MEMORY_BUDGET
            self.per_forward = int(max(1, min(MAX_PER_FORWARD, budget // (3 * per_item * self.batch))))
        full = self._scores(output, 1)[:, 0]
        if self.site is not None and self.site.replay is not None:
            self._check_replay(full)
        return full

    def _check_replay(self, full: torch.Tensor) -> None:
        """Two unperturbed copies per item through the replayed run must give the unperturbed scores back."""
        assert self.site is not None
        try:
            again = self._score_rows(self.units.repeat_interleave(2, 0), 2)
        except Exception as exc:  # a replayed call's result that later code cannot take
            self.site.stop_replay(f"made the model fail ({exc})")
            return
        if not close_scores(again, full[:, None].expand(-1, 2)):
            self.site.stop_replay("did not give the unperturbed scores back")

    # -- perturbations ------------------------------------------------------------------------------------------
    def keep(self, keep: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Scores ``(batch * outputs, P)`` with the features where ``keep`` ``(P, M)`` is False at the baseline."""
        keep = keep.to(ids.device)
        return self.scores(len(keep), lambda first, stop: keep[first:stop][:, ids])

    def scores(self, count: int, weights: Weights) -> torch.Tensor:
        """Scores ``(batch * outputs, count)`` of the perturbations ``weights(first, stop)``, a batch at a time."""
        if count == 0:
            return self.full.new_zeros(len(self.full), 0)
        if not self.units.is_floating_point():
            return self._token_scores(weights(0, count))
        assert self.per_forward is not None
        out = []
        chunks = range(0, count, self.per_forward)
        for first in progress(chunks, desc=self.method, enabled=self.show_progress):
            w = weights(first, min(count, first + self.per_forward)).to(self.units.device)
            out.append(self._score_rows(self._perturb(w), len(w)))
        return torch.cat(out, dim=1)

    def _perturb(self, w: torch.Tensor) -> torch.Tensor:
        """The rows ``(batch * k, *item)``, item after item: ``x * w + b * (1 - w)`` (a choice for booleans)."""
        x, b = self.units[:, None], self.baseline[:, None]
        if w.dtype == torch.bool or not x.is_floating_point():
            rows = torch.where(w.bool()[None], x, b)
        else:
            w = w.to(x.dtype)[None]
            rows = x * w + b * (1 - w)
        return rows.flatten(0, 1)

    def _token_scores(self, w: torch.Tensor) -> torch.Tensor:
        """Token-id perturbations, grouped by their first change and run on the cached prefix where possible."""
        assert self.per_forward is not None
        count, prompt = len(w), self.x.shape[-1]
        perturbed = torch.where(w.bool().to(self.x.device)[None], self.x[:, None], self.baseline[:, None])
        if not self.reuse:
            starts = torch.zeros(count, dtype=torch.long)
            runs = [(i, min(count, i + self.per_forward)) for i in range(0, count, self.per_forward)]
        else:  # the last prompt position predicts the first token: a run has one position at least
            starts = first_changes(perturbed, self.x).clamp(max=prompt - 1).cpu()
        order = torch.sort(starts, stable=True).indices
        if self.reuse:
            call = CALL_COST.get(self.x.device.type, 4096) / self.batch  # per row of one perturbation
            runs = prefix_groups(starts[order].tolist(), self.length, self._most, call)
        result = self.full.new_empty(len(self.full), count)
        for first, stop in progress(runs, desc=self.method, enabled=self.show_progress):
            chunk = order[first:stop]
            rows = perturbed[:, chunk.to(self.x.device)].flatten(0, 1)
            result[:, chunk.to(result.device)] = self._score_rows(rows, len(chunk), start=int(starts[chunk[0]]))
        return result

    def _most(self, width: int) -> int:
        """The most perturbations in a call that runs ``width`` positions: the budget's rows at full length."""
        assert self.per_forward is not None
        if not self.sized:
            return self.per_forward
        return max(self.per_forward, min(MAX_PER_FORWARD, self.per_forward * self.length // width))

    def _score_rows(self, rows: torch.Tensor, k: int, *, start: int = 0) -> torch.Tensor:
        """Scores ``(batch, k)`` of ``batch * k`` rows; with ``start``, positions ``start..`` run on the cache.

        With a layer, the rows are the layer's output and the model runs on the inputs repeated ``k`` times.
        """
        if self.site is not None:
            output = self.site.forward(self._call, self.x, rows, k)
        elif start > 0:
            cache = prefix_cache(self.cache, start, k)
            output = self._call(rows[:, start:], cache=cache)
        else:
            output = self._call(rows)
        return self._scores(output, k)

    def _call(self, rows: torch.Tensor, *, store: bool = False, cache: Any = None) -> Any:
        """One model call; a HuggingFace LM gets ``input_ids=``, the cache, ``use_cache`` and ``logits_to_keep``.

        With a continuation, its tokens but the last follow every row (rows are item after item).
        """
        self.forwards += 1
        if self.keyword is None:
            return self._run.forward(rows)
        if self.tokens is not None:
            rows = torch.cat([rows, self.tokens[:, :-1].repeat_interleave(len(rows) // self.batch, 0)], 1)
        inputs: dict[str, Any] = {"input_ids": rows, "use_cache": store or cache is not None}
        if cache is not None:
            inputs[self.keyword] = cache
        if self.last_only:  # only the last positions' logits are read: exact, and less work
            inputs["logits_to_keep"] = 1 if self.tokens is None else self.tokens.shape[1]
        return self._run.forward(inputs)

    def _scores(self, output: Any, k: int) -> torch.Tensor:
        """The ``(batch * outputs, k)`` target scores of an output of ``batch * k`` rows (item after item)."""
        rows = self.batch * k
        if self.tokens is not None:
            logits = _lm_logits(output)
            if logits is None:
                raise TypeError(f"{self.method}: a `Continuation` target needs a model whose output has `.logits`")
            return continuation_scores(logits, self.tokens, k)
        target = self.target
        if not callable(target):
            assert isinstance(target, torch.Tensor)
            target = target.repeat_interleave(k)
        if self.lm:
            logits = _lm_logits(output)
            assert logits is not None
            assert isinstance(target, torch.Tensor)
            scores = torch.log_softmax(logits[:, -1], dim=-1).gather(1, target.to(logits.device)[:, None])[:, 0]
        else:
            scores = target_scores(output, target, rows)
        return scores.detach().reshape(self.batch, k)


def _lm_logits(output: Any) -> torch.Tensor | None:
    """The ``(rows, T, vocabulary)`` logits of a language model's output, else ``None``."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, dict):
        logits = logits.get("logits")
    return logits if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None


def _resolve(output: Any, target: Target, batch: int, lm: bool) -> torch.Tensor:
    """An integer target as a ``(batch,)`` index tensor (``None``: the top class, or the top next token)."""
    if lm:
        logits = _lm_logits(output)
        assert logits is not None
        return class_indices(logits[:, -1], target, batch)
    return class_indices(class_logits(output), target, batch)


def nan_items(attributions: torch.Tensor, scores: torch.Tensor, method: str) -> torch.Tensor:
    """Warn about items whose target score is NaN under some perturbation; their attributions become all NaN."""
    bad = torch.isnan(scores).flatten(1).any(1)
    if bad.any():
        items = bad.nonzero().flatten().tolist()
        count = int(torch.isnan(scores[bad]).flatten(1).any(0).sum())
        warn(
            f"{method}: the target score is NaN for item(s) {items[:8]}{'...' if len(items) > 8 else ''} under "
            f"{count} perturbation(s): the model's output is not finite for the perturbed inputs (check the baseline "
            "and the model's dtype). Their attributions are NaN, not averaged over the other perturbations"
        )
        attributions = attributions.clone()
        attributions[bad.to(attributions.device)] = math.nan
    return attributions
