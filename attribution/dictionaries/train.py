"""Training a dictionary: activations recorded into the dataset store, Adam, unit-norm decoder rows, AuxK, resumable."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._progress import progress as progress_bar
from . import _math
from ._activations import Rows, open_source, record_shards
from .modules import SAE, Dictionary, Transcoder

CHECKPOINT, SETTINGS = "checkpoint.pt", "training.json"
AUX_ALPHA = 1 / 32  # the AuxK loss's weight (Gao et al. 2024, appendix A.2)
THRESHOLD_BETA = 0.99  # BatchTopK's threshold: a running mean of the smallest kept activation


@dataclass(frozen=True)
class _Plan:
    """What one training run computes; a resumed run must match it."""

    kind: str
    dictionary: str
    rows: int
    width: int
    steps: int
    tokens: int
    batch_size: int
    lr: float
    seed: int
    dead_after: int


def train_dictionary(
    model: nn.Module | None,
    data: Any,
    site: str | None,
    dictionary: Dictionary,
    *,
    out: str | Path,
    tokens: int | None = None,
    batch_size: int = 4096,
    lr: float | None = None,
    seed: int = 0,
    checkpoint_every: int | None = None,
    progress: bool = True,
) -> Dictionary:
    """Train ``dictionary`` in place on the activations of ``site``, resumably; returns it.

    The activations of every position of ``data`` are recorded with :func:`~attribution.attribute_dataset` into
    ``out/activations`` (shards fingerprinted by the model's weights, the site and the data; verified; resumable; one
    writer); a transcoder's rows hold the module's input and output side by side. Training then takes the rows in a
    seeded random order (one permutation per pass over the data), ``batch_size`` rows per step:

    * loss: ``sum |x_hat - y|^2`` per row (``y = x`` for an SAE, the module's output for a transcoder), averaged,
      plus ``1/32`` of the AuxK loss (Gao et al. 2024): the error predicted from the ``d_in // 2`` largest
      pre-activations of the dead features (not fired for the last tenth of the tokens, at most 10M), normalised
      by the error's variance;
    * ``topk`` trains as it encodes; ``batchtopk`` keeps the ``k x rows`` largest activations of the batch and learns
      its inference threshold as a running mean (0.99) of the smallest one kept;
    * Adam (``lr`` default ``2e-4 / sqrt(n_features / 2**14)``, Gao et al.'s scaling), the decoder gradient's
      component along each row removed before the step and the rows set back to unit norm after it; a fresh
      dictionary's ``b_dec`` (all zeros) starts at the mean target of the first batch.

    Every ``checkpoint_every`` steps the state (dictionary, optimizer, dead-feature counters, step) is written to
    ``out/checkpoint.pt`` atomically. The same call again on the same ``out`` resumes from it and ends bitwise equal
    (on the CPU) to a run that was never interrupted; once finished it returns the stored result at once.

    Args:
        model: the model whose ``site`` is recorded; ``None`` to train on given activations.
        data: token batches ``(batch, tokens)`` (a tensor, or an iterable of tensors of one length), or a
            ``DataLoader`` of model inputs; with ``model=None``: activations ``(rows, d_in)`` (an SAE) or
            ``(rows, d_in + d_out)`` (a transcoder), or a folder of recorded shards (``out/activations`` of a
            previous run).
        site: the module whose output an SAE reconstructs (a transcoder: whose input it reads and output it
            predicts); ``None`` with ``model=None``.
        dictionary: an :class:`~attribution.SAE` or :class:`~attribution.Transcoder` with ``activation="topk"`` or
            ``"batchtopk"``, on the device to train on (CPU or CUDA).
        out: the folder of the shards, the checkpoint and the settings.
        tokens: how many activations to train on (default: all recorded, once); more than recorded makes several
            passes.
        batch_size: activations per optimizer step (also the token sequences per recording batch, at most 64).
        lr: Adam's learning rate.
        seed: the seed of the row order.
        checkpoint_every: steps between checkpoints (default: a tenth of the steps).
        progress: show progress bars.

    Returns:
        ``dictionary``, trained.

    Raises:
        ValueError: an activation other than topk/batchtopk, activations of the wrong width (both named), ``out``
            holding a run with other settings (named), no finite activation to train on.

    Warns:
        UserWarning: activations holding NaN or inf, named by item, are left out of training.

    Example:
        >>> import tempfile
        >>> from attribution import SAE
        >>> _ = torch.manual_seed(0)
        >>> sae = SAE(8, 32, k=2)
        >>> sae = train_dictionary(None, torch.randn(512, 8), None, sae, out=tempfile.mkdtemp(), batch_size=128,
        ...                        lr=1e-2, progress=False)
        >>> float(sae.W_dec.detach().norm(dim=-1).max()) < 1 + 1e-5
        True
    """
    out = Path(out)
    if dictionary.activation not in ("topk", "batchtopk"):
        raise ValueError(
            f"train_dictionary trains activation='topk' and 'batchtopk' dictionaries (sparsity set by k, no penalty "
            f"to tune); got activation={dictionary.activation!r}"
        )
    rows = _rows(model, data, site, dictionary, out, batch_size, progress)
    plan = _planned(dictionary, rows, tokens, batch_size, lr, seed)
    state = _resume(out, plan, dictionary)
    every = checkpoint_every or max(1, plan.steps // 10)
    _loop(dictionary, rows, plan, state, out, every, progress)
    return dictionary


def _rows(
    model: nn.Module | None, data: Any, site: str | None, dictionary: Dictionary, out: Path, batch: int, progress: bool
) -> Rows:
    """The rows to train on, recorded (with a model) or given; their width checked against the dictionary."""
    both = isinstance(dictionary, Transcoder)
    width = dictionary.d_in + dictionary.d_out if both else dictionary.d_in
    if model is None:
        rows = open_source(data)
    else:
        if not isinstance(site, str):
            raise TypeError(f"`site` must be the name of a module of the model; got {site!r}")
        results = record_shards(
            model, data, site, out / "activations", both=both, batch_size=min(batch, 64), progress=progress
        )
        rows = Rows(results)
    if rows.width != width:
        what = f"d_in + d_out = {dictionary.d_in} + {dictionary.d_out}" if both else f"d_in = {dictionary.d_in}"
        raise ValueError(
            f"the activations have width {rows.width}, but the {type(dictionary).__name__} reads {what}: give it the "
            "width of the site"
        )
    if len(rows) == 0:
        raise ValueError("no finite activation to train on")
    return rows


def _planned(dictionary: Dictionary, rows: Rows, tokens: int | None, batch: int, lr: float | None, seed: int) -> _Plan:
    total = len(rows) if tokens is None else int(tokens)
    if total < 1 or batch < 1:
        raise ValueError(f"`tokens` and `batch_size` must be positive; got {tokens!r} and {batch!r}")
    rate = lr if lr is not None else 2e-4 / math.sqrt(dictionary.n_features / 2**14)
    return _Plan(
        kind=type(dictionary).__name__,
        dictionary=repr(dictionary),
        rows=len(rows),
        width=rows.width,
        steps=math.ceil(total / batch),
        tokens=total,
        batch_size=batch,
        lr=float(rate),
        seed=seed,
        dead_after=max(batch, min(total // 10, 10_000_000)),
    )


@dataclass
class _State:
    """What a checkpoint holds besides the dictionary."""

    step: int
    optimizer: torch.optim.Adam
    last_fired: torch.Tensor  # (n_features,) the token count at which each feature last fired


def _resume(out: Path, plan: _Plan, dictionary: Dictionary) -> _State:
    """A fresh state, or the checkpoint's after checking that ``out`` holds the same run."""
    out.mkdir(parents=True, exist_ok=True)
    settings = out / SETTINGS
    stored = json.loads(settings.read_text()) if settings.is_file() else None
    if stored is not None and stored != asdict(plan):
        differ = "; ".join(
            f"{k}: {stored.get(k)!r} there, {v!r} now" for k, v in asdict(plan).items() if stored.get(k) != v
        )
        raise ValueError(
            f"`out` {str(out)!r} holds a training run with other settings ({differ}): use another folder, or delete "
            f"{settings.name} and {CHECKPOINT} there to start over"
        )
    _atomic(settings, lambda tmp: tmp.write_text(json.dumps(asdict(plan), indent=1)))
    optimizer = torch.optim.Adam(dictionary.parameters(), lr=plan.lr)
    state = _State(0, optimizer, torch.zeros(dictionary.n_features, dtype=torch.long, device=dictionary.W_enc.device))
    if (out / CHECKPOINT).is_file():
        saved = torch.load(out / CHECKPOINT, map_location=dictionary.W_enc.device, weights_only=True)
        dictionary.load_state_dict(saved["dictionary"])
        optimizer.load_state_dict(saved["optimizer"])
        state.step, state.last_fired = int(saved["step"]), saved["last_fired"]
    return state


def _loop(
    dictionary: Dictionary, rows: Rows, plan: _Plan, state: _State, out: Path, every: int, progress: bool
) -> None:
    """Steps ``state.step .. plan.steps - 1``, a checkpoint every ``every`` steps and at the end."""
    device = dictionary.W_enc.device
    for step in progress_bar(range(state.step, plan.steps), desc="train_dictionary", enabled=progress):
        batch = rows.take(_order(plan, step)).to(device=device, dtype=dictionary.W_enc.dtype)
        source, target = _split(dictionary, batch)
        if step == 0 and not dictionary.b_dec.any():
            with torch.no_grad():
                dictionary.b_dec.copy_(target.mean(0))
        _step(dictionary, state, source, target, plan, seen=step * plan.batch_size)
        state.step = step + 1
        if state.step % every == 0 or state.step == plan.steps:
            _checkpoint(out, dictionary, state)


def _order(plan: _Plan, step: int) -> np.ndarray:
    """The rows of one step: positions ``step * batch_size ...`` of the seeded permutations, one per pass."""
    start, stop = step * plan.batch_size, min((step + 1) * plan.batch_size, plan.tokens)
    parts, position = [], start
    while position < stop:
        epoch, offset = divmod(position, plan.rows)
        perm = _permutation(plan.seed, epoch, plan.rows)
        take = min(stop - position, plan.rows - offset)
        parts.append(perm[offset : offset + take])
        position += take
    return np.concatenate(parts)


@functools.lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, rows: int) -> np.ndarray:
    """The row order of one pass over the data."""
    return np.random.default_rng([seed, epoch]).permutation(rows)


def _split(dictionary: Dictionary, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(dictionary, SAE):
        return batch, batch
    return batch[:, : dictionary.d_in], batch[:, dictionary.d_in :]


def _step(
    dictionary: Dictionary, state: _State, source: torch.Tensor, target: torch.Tensor, plan: _Plan, seen: int
) -> None:
    """One optimizer step: loss, gradient without its parallel part on the decoder, Adam, unit rows, counters."""
    pre = dictionary.pre(source)
    f = _math.batch_topk(pre, dictionary.k) if dictionary.activation == "batchtopk" else _math.topk(pre, dictionary.k)
    skip = dictionary.skip_term(source) if isinstance(dictionary, Transcoder) else None
    x_hat = dictionary.decode(f) + (skip if skip is not None else 0)
    error = target - x_hat
    loss = error.pow(2).sum(-1).mean()
    fired = (f > 0).any(0)
    now = seen + len(source)
    state.last_fired = torch.where(fired, torch.full_like(state.last_fired, now), state.last_fired)
    dead = (now - state.last_fired) >= plan.dead_after
    if bool(dead.any()):
        aux = _math.auxiliary_topk(pre, dead, dictionary.d_in // 2) @ dictionary.W_dec
        residual = error.detach()
        scale = (residual - residual.mean(0)).pow(2).sum(-1).mean()
        loss = loss + AUX_ALPHA * ((residual - aux).pow(2).sum(-1).mean() / scale).nan_to_num(0.0)
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        assert dictionary.W_dec.grad is not None
        dictionary.W_dec.grad.copy_(_math.without_parallel_gradient(dictionary.W_dec, dictionary.W_dec.grad))
        state.optimizer.step()
        dictionary.W_dec.copy_(_math.unit_rows(dictionary.W_dec))
        if dictionary.activation == "batchtopk":
            kept = f[f > 0]
            smallest = kept.min() if kept.numel() else torch.zeros((), device=f.device, dtype=f.dtype)
            first = seen == 0
            dictionary.threshold.copy_(
                smallest if first else THRESHOLD_BETA * dictionary.threshold + (1 - THRESHOLD_BETA) * smallest
            )


def _checkpoint(out: Path, dictionary: Dictionary, state: _State) -> None:
    payload = {
        "step": state.step,
        "dictionary": dictionary.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "last_fired": state.last_fired,
    }
    _atomic(out / CHECKPOINT, lambda tmp: torch.save(payload, tmp))


def _atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename over ``path``: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
