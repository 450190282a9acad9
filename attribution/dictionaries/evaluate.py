"""Evaluating a dictionary: reconstruction (FVU, L0, dead features) and the spliced model's loss and KL."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._inputs import call
from .._progress import progress as progress_bar
from .._run import eager_module, kept_state, warn
from ..patching import patch, record
from . import _math
from .modules import Dictionary, Transcoder, reconstruct
from .splice import splice


@dataclass(frozen=True)
class DictionaryReport:
    """How well a dictionary reconstructs its site and stands in for it (:func:`evaluate_dictionary`).

    Attributes:
        fvu: ``sum |y - y_hat|^2 / sum |y - mean(y)|^2`` over every recorded activation (``y`` the site's value, a
            transcoder's module output; the mean over all of them).
        l0: the mean number of active features per activation.
        dead_fraction: the fraction of features active on no activation of the data.
        loss_clean: the model's mean next-token cross-entropy (nats) over every predicted position.
        loss_spliced: the same with the dictionary spliced in, ``error=False``.
        loss_zero: the same with the site zero-ablated.
        loss_recovered: ``(loss_zero - loss_spliced) / (loss_zero - loss_clean)``.
        kl: ``KL(clean || spliced)`` of the next-token distributions, averaged over every position.
        tokens: the number of activations (positions) evaluated.
    """

    fvu: float
    l0: float
    dead_fraction: float
    loss_clean: float
    loss_spliced: float
    loss_zero: float
    loss_recovered: float
    kl: float
    tokens: int

    @property
    def ill_conditioned(self) -> bool:
        """Whether zero-ablation moves the loss by less than ``ILL_CONDITIONED`` (5%) of ``loss_clean``, or lowers it.

        ``loss_recovered`` divides by ``loss_zero - loss_clean``; when that gap is small, a small change of the
        spliced loss swings the ratio far outside ``[0, 1]`` (and a negative gap flips its sign), so the ratio says
        little: read ``loss_spliced - loss_clean`` and ``kl`` instead.
        """
        return self.loss_zero - self.loss_clean < ILL_CONDITIONED * abs(self.loss_clean)

    def __str__(self) -> str:
        note = ", ill-conditioned: zero-ablation barely changes the loss" if self.ill_conditioned else ""
        return (
            f"FVU {self.fvu:.3f}, L0 {self.l0:.1f}, dead {100 * self.dead_fraction:.1f}%, loss clean "
            f"{self.loss_clean:.3f} / spliced {self.loss_spliced:.3f} / zero {self.loss_zero:.3f} (recovered "
            f"{100 * self.loss_recovered:.1f}%{note}), KL {self.kl:.4f} nats over {self.tokens} tokens"
        )


ILL_CONDITIONED = 0.05
"""``loss_recovered`` is flagged when ``loss_zero - loss_clean`` is below this fraction of ``loss_clean``."""


class _Sums:
    """Running float64 sums over batches."""

    def __init__(self, n_features: int) -> None:
        self.sq_error = self.sum_sq = self.active = 0.0
        self.sum_y: torch.Tensor | float = 0.0
        self.rows = 0
        self.fired = torch.zeros(n_features, dtype=torch.bool)
        self.losses = [0.0, 0.0, 0.0]  # clean, spliced, zero
        self.predicted = 0
        self.kl = 0.0
        self.positions = 0


def evaluate_dictionary(
    model: nn.Module, data: Iterable[Any], site: str, dictionary: Dictionary, *, progress: bool = True
) -> DictionaryReport:
    """Measure ``dictionary`` at ``site`` of a language model over ``data``: a :class:`DictionaryReport`.

    Each batch runs three times without autograd, in eval mode (the model is left as found): clean (the site's
    activations and the logits recorded), spliced with ``error=False`` (:func:`~attribution.splice`), and with the
    site's output zero-ablated. The reconstruction numbers are taken on the clean activations; the losses are the
    mean next-token cross-entropy over every predicted position of every sequence. For a transcoder the site's value
    is the module's output and the features are read from its input.

    Args:
        model: a causal language model returning logits ``(batch, tokens, vocab)`` (or an output with ``.logits``).
        data: batches of token ids ``(batch, tokens)``, or of model inputs (dicts with ``"input_ids"``).
        site: the module the dictionary is spliced at.
        dictionary: the :class:`~attribution.SAE` or :class:`~attribution.Transcoder`.
        progress: show a progress bar on a terminal.

    Returns:
        The :class:`DictionaryReport`. A warning says when its ``loss_recovered`` is ill-conditioned
        (:attr:`~attribution.dictionaries.DictionaryReport.ill_conditioned`: zero-ablation moves the loss by less
        than 5%).

    Example:
        >>> from attribution import SAE
        >>> _ = torch.manual_seed(0)
        >>> lm = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 11))
        >>> report = evaluate_dictionary(lm, [torch.randint(0, 11, (2, 6))], "1", SAE(4, 8, k=2), progress=False)
        >>> report.tokens, 0 <= report.dead_fraction <= 1, report.l0 <= 2
        (12, True, True)
    """
    sums = _Sums(dictionary.n_features)
    model = eager_module(model)
    with kept_state(model), torch.no_grad():
        for batch in progress_bar(data, desc="evaluate_dictionary", enabled=progress):
            _one_batch(model, batch, site, dictionary, sums)
    if sums.rows == 0:
        raise ValueError("`data` gave no batch to evaluate")
    clean, spliced, zero = (total / sums.predicted for total in sums.losses)
    assert isinstance(sums.sum_y, torch.Tensor)
    report = DictionaryReport(
        fvu=_math.fvu(sums.sq_error, sums.sum_y, sums.sum_sq, sums.rows),
        l0=sums.active / sums.rows,
        dead_fraction=float((~sums.fired).double().mean()),
        loss_clean=clean,
        loss_spliced=spliced,
        loss_zero=zero,
        loss_recovered=_math.loss_recovered(clean, spliced, zero),
        kl=sums.kl / sums.positions,
        tokens=sums.rows,
    )
    if report.ill_conditioned:
        warn(
            f"loss recovered ({100 * report.loss_recovered:.1f}%) is ill-conditioned at `site` {site!r}: zero-ablating "
            f"it moves the loss from {clean:.4f} to {zero:.4f} nats ({100 * (zero - clean) / abs(clean):+.2f}%, "
            f"expected at least +{100 * ILL_CONDITIONED:.0f}%), so the ratio's denominator is too small to mean much. "
            "Read loss_spliced - loss_clean and kl instead, or evaluate at a site whose ablation matters"
        )
    return report


def _one_batch(model: nn.Module, batch: Any, site: str, dictionary: Dictionary, sums: _Sums) -> None:
    """The three runs of one batch, added to ``sums``."""
    tokens = batch["input_ids"] if isinstance(batch, dict) else batch
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise TypeError("`data` must give token ids (batch, tokens) or dicts with 'input_ids' of that shape")
    transcoder = isinstance(dictionary, Transcoder)
    with record(model, site) as out_acts, record(model, site, site="input") as in_acts:
        clean = _logits(call(model, batch))
    with splice(model, {site: dictionary}, error=False):
        spliced = _logits(call(model, batch))
    with patch(model, {site: torch.zeros_like}):
        zero = _logits(call(model, batch))
    y = out_acts[site]
    source = (in_acts[site] if transcoder else y).to(device=dictionary.W_enc.device, dtype=dictionary.W_enc.dtype)
    f = dictionary.encode(source)
    y_hat = reconstruct(dictionary, f, source)
    rows_y = y.reshape(-1, y.shape[-1]).double().cpu()
    sums.sq_error += float((rows_y - y_hat.reshape(rows_y.shape).double().cpu()).pow(2).sum())
    sums.sum_y = sums.sum_y + rows_y.sum(0)
    sums.sum_sq += float(rows_y.pow(2).sum())
    sums.rows += rows_y.shape[0]
    nonzero = (f != 0).reshape(-1, f.shape[-1]).cpu()
    sums.active += float(nonzero.sum())
    sums.fired |= nonzero.any(0)
    for i, logits in enumerate((clean, spliced, zero)):
        sums.losses[i] += float(_math.next_token_loss(logits, tokens).sum())
    sums.predicted += tokens.shape[0] * (tokens.shape[1] - 1)
    sums.kl += float(_math.next_token_kl(clean, spliced).sum())
    sums.positions += tokens.shape[0] * tokens.shape[1]


def _logits(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise TypeError(
            "evaluate_dictionary needs a language model: logits (batch, tokens, vocab) or an output with .logits"
        )
    return logits
