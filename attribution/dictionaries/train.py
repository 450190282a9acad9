"""Training a dictionary: activations recorded into the dataset store, Adam, unit-norm decoder rows, AuxK, resumable."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._progress import progress as progress_bar
from . import _math, _parallel, _sparse
from ._activations import Rows, open_source, record_shards
from .modules import SAE, Dictionary, Transcoder, reconstruct

CHECKPOINT, SETTINGS = "checkpoint.pt", "training.json"
AUX_ALPHA = 1 / 32  # the AuxK loss's weight (Gao et al. 2024, appendix A.2)
THRESHOLD_BETA = 0.99  # BatchTopK's threshold: a running mean of the smallest kept activation
JUMPRELU_START = 0.01  # a JumpReLU threshold that is not positive starts here (SAELens's jumprelu_init_threshold)
PENALTIES = {"relu": "l1_coefficient", "jumprelu": "l0_coefficient"}


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
    l1_coefficient: float | None = None  # ReLU's penalty (None for the other activations, also in older runs)
    l0_coefficient: float | None = None  # JumpReLU's penalty
    bandwidth: float | None = None  # JumpReLU's kernel width
    sparsity_warmup: int | None = None  # steps over which the penalty's coefficient rises to its value


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
    l1_coefficient: float | None = None,
    l0_coefficient: float | None = None,
    bandwidth: float | None = None,
    sparsity_warmup: int = 0,
) -> Dictionary:
    """Train ``dictionary`` in place on the activations of ``site``, resumably; returns it.

    The activations of every position of ``data`` are recorded with :func:`~attribution.attribute_dataset` into
    ``out/activations`` (shards fingerprinted by the model's weights, the site and the data; verified; resumable; one
    writer); a transcoder's rows hold the module's input and output side by side. Training then takes the rows in a
    seeded random order (one permutation per pass over the data), ``batch_size`` rows per step. The loss is
    ``sum |x_hat - y|^2`` per row (``y = x`` for an SAE, the module's output for a transcoder), averaged, plus what
    the activation adds:

    * ``topk`` trains as it encodes; ``batchtopk`` keeps the ``k x rows`` largest activations of the batch and learns
      its inference threshold as a running mean (0.99) of the smallest one kept. Both add ``1/32`` of the AuxK loss
      (Gao et al. 2024): the error predicted from the ``d_in // 2`` largest pre-activations of the dead features (not
      fired for the last tenth of the tokens, at most 10M), normalised by the error's variance. The decoder rows are
      kept at unit norm: the decoder gradient's component along each row is removed before the step and the rows
      are set back to unit norm after it. Both train on sparse codes: the pre-activations are one dense product
      without a graph, and the decoder (``embedding_bag``) and every backward touch only the active features, equal
      to the dense computation to float rounding.
    * ``relu`` adds the L1 penalty ``l1_coefficient * sum_i f_i |W_dec[i]|`` per row (SAELens's standard SAE,
      Anthropic's April 2024 update): the decoder rows' norms are free and weigh their features.
    * ``jumprelu`` (Rajamanoharan et al. 2024) adds the L0 penalty ``l0_coefficient * sum_i H(pre_i - t_i)`` per
      row; the thresholds ``t = exp(log_t)`` are learned through straight-through estimators with the rectangle
      kernel of width ``bandwidth``: ``d f_i / d t_i = -(t_i / bandwidth) K((pre_i - t_i) / bandwidth)`` and ``d
      H / d t_i = -(1 / bandwidth) K(...)``, ``K(u) = 1`` for ``|u| < 1/2``; no gradient reaches ``pre`` through
      the step. A threshold that is not positive (a fresh dictionary's zeros) starts at 0.01 (as SAELens's); set
      ``dictionary.threshold`` before training to start elsewhere. The decoder rows' norms are free.
    * ``sparsity_warmup`` steps raise the penalty's coefficient linearly from ``coefficient / sparsity_warmup``
      to its value (SAELens's ``l1_warm_up_steps`` / ``l0_warm_up_steps``).

    Adam (``lr`` default ``2e-4 / sqrt(n_features / 2**14)``, Gao et al.'s scaling); a fresh dictionary's ``b_dec``
    (all zeros) starts at the mean target of the first batch.

    Every ``checkpoint_every`` steps the state (dictionary, optimizer, dead-feature counters, JumpReLU's log
    thresholds, step) is written to ``out/checkpoint.pt`` atomically. The same call again on the same ``out``
    resumes from it and ends bitwise equal (on the CPU, with the same number of processes) to a run that was never
    interrupted; once finished it returns the stored result at once.

    Under ``torchrun`` (or any process group with more than one process) the call is data parallel: every process
    records its share of the shards, then takes its contiguous share of each step's ``batch_size`` rows, the losses
    are normalised by the whole batch, the gradients summed over the processes (one all-reduce), BatchTopK's
    selection, the AuxK normaliser and the dead-feature counters computed over the whole batch, and every process
    makes the same Adam step; rank 0 alone writes the settings and the checkpoints. The result equals a one-process
    run with the same ``batch_size`` to float rounding (sums taken in another order). Every process must make the
    same call with the same ``data``.

    Args:
        model: the model whose ``site`` is recorded; ``None`` to train on given activations.
        data: token batches ``(batch, tokens)`` (a tensor, or an iterable of tensors of one length), dict batches
            of model inputs (``[{"input_ids": ..., "attention_mask": ...}, ...]``, the model called with each
            item's entries as keywords), or a ``DataLoader`` of model inputs; with ``model=None``: activations
            ``(rows, d_in)`` (an SAE) or ``(rows, d_in + d_out)`` (a transcoder), or a folder of recorded shards
            (``out/activations`` of a previous run).
        site: the module whose output an SAE reconstructs (a transcoder: whose input it reads and output it
            predicts); ``None`` with ``model=None``.
        dictionary: an :class:`~attribution.SAE` or :class:`~attribution.Transcoder`, on the device to train on
            (CPU or CUDA).
        out: the folder of the shards, the checkpoint and the settings.
        tokens: how many activations to train on (default: all recorded, once); more than recorded makes several
            passes.
        batch_size: activations per optimizer step, over all processes (also the token sequences per recording
            batch, at most 64).
        lr: Adam's learning rate.
        seed: the seed of the row order.
        checkpoint_every: steps between checkpoints (default: a tenth of the steps).
        progress: show progress bars on a terminal.
        l1_coefficient: the L1 penalty's weight; required for ``activation="relu"`` (its right value depends on the
            activations' scale: larger is sparser), refused for the others.
        l0_coefficient: the L0 penalty's weight; required for ``activation="jumprelu"``, refused for the others.
        bandwidth: the width of JumpReLU's rectangle kernel, in the pre-activations' units (default 0.05, as
            SAELens's ``jumprelu_bandwidth``).
        sparsity_warmup: steps over which the penalty's coefficient rises linearly to its value (``relu`` and
            ``jumprelu``).

    Returns:
        ``dictionary``, trained.

    Raises:
        ValueError: a penalty missing for its activation or given for another (named), activations of the wrong
            width (both named), ``out`` holding a run with other settings (named), no finite activation to train on.

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
        >>> relu = SAE(8, 32, activation="relu")
        >>> relu = train_dictionary(None, torch.randn(512, 8), None, relu, out=tempfile.mkdtemp(), batch_size=128,
        ...                         lr=1e-2, l1_coefficient=0.1, progress=False)
    """
    out = Path(out)
    penalties = _penalties(dictionary, l1_coefficient, l0_coefficient, bandwidth, sparsity_warmup)
    rank, world = _parallel.setup()
    rows = _rows(model, data, site, dictionary, out, batch_size, progress)
    plan = _planned(dictionary, rows, tokens, batch_size, lr, seed, penalties)
    state = _resume(out, plan, dictionary, rank)
    every = checkpoint_every or max(1, plan.steps // 10)
    _loop(dictionary, rows, plan, state, out, every, progress, rank, world)
    return dictionary


def _penalties(
    dictionary: Dictionary, l1: float | None, l0: float | None, bandwidth: float | None, warmup: int
) -> dict[str, Any]:
    """The penalty settings of the dictionary's activation, checked; the others ``None``."""
    activation = dictionary.activation
    given = {"l1_coefficient": l1, "l0_coefficient": l0, "bandwidth": bandwidth}
    wanted = {"relu": ("l1_coefficient",), "jumprelu": ("l0_coefficient", "bandwidth")}.get(activation, ())
    for name, value in given.items():
        if value is not None and name not in wanted:
            raise ValueError(
                f"`{name}` is a setting of activation={'jumprelu' if name != 'l1_coefficient' else 'relu'!r}; this "
                f"{type(dictionary).__name__} has activation={activation!r}: leave it out"
            )
        if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value < 0):
            raise ValueError(f"`{name}` must be a non-negative number; got {value!r}")
    if bandwidth is not None and bandwidth <= 0:
        raise ValueError(f"`bandwidth` must be positive; got {bandwidth!r}")
    needed = PENALTIES.get(activation)
    if needed is not None and given[needed] is None:
        what = "L1 penalty on the features" if activation == "relu" else "L0 penalty (active features per row)"
        raise ValueError(
            f"activation={activation!r} trains with an {what} whose weight depends on the activations' scale: give "
            f"`{needed}` (SAELens's default is 1.0; larger is sparser)"
        )
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"`sparsity_warmup` must be a non-negative int; got {warmup!r}")
    if warmup and needed is None:
        raise ValueError(
            f"`sparsity_warmup` warms up the penalty of activation='relu' or 'jumprelu'; this "
            f"{type(dictionary).__name__} has activation={activation!r}, whose sparsity is set by k: leave it out"
        )
    settings: dict[str, Any] = {"l1_coefficient": None, "l0_coefficient": None, "bandwidth": None}
    if needed is None:
        return {**settings, "sparsity_warmup": None}
    settings[needed] = float(given[needed])  # type: ignore[arg-type]
    if activation == "jumprelu":
        settings["bandwidth"] = float(bandwidth if bandwidth is not None else 0.05)
    return {**settings, "sparsity_warmup": warmup}


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


def _planned(
    dictionary: Dictionary,
    rows: Rows,
    tokens: int | None,
    batch: int,
    lr: float | None,
    seed: int,
    penalties: dict[str, Any],
) -> _Plan:
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
        **penalties,
    )


@dataclass
class _State:
    """What a checkpoint holds besides the dictionary."""

    step: int
    optimizer: torch.optim.Adam
    last_fired: torch.Tensor  # (n_features,) the token count at which each feature last fired
    log_threshold: torch.Tensor | None  # (n_features,) JumpReLU's trained parameter; threshold = exp(log_threshold)


def _resume(out: Path, plan: _Plan, dictionary: Dictionary, rank: int = 0) -> _State:
    """A fresh state, or the checkpoint's after checking that ``out`` holds the same run (rank 0 writes)."""
    out.mkdir(parents=True, exist_ok=True)
    settings = out / SETTINGS
    stored = json.loads(settings.read_text()) if settings.is_file() else None
    now = asdict(plan)
    if stored is not None and any(stored.get(k) != v for k, v in now.items()):  # a key older runs lack reads None
        differ = "; ".join(f"{k}: {stored.get(k)!r} there, {v!r} now" for k, v in now.items() if stored.get(k) != v)
        raise ValueError(
            f"`out` {str(out)!r} holds a training run with other settings ({differ}): use another folder, or delete "
            f"{settings.name} and {CHECKPOINT} there to start over"
        )
    _parallel.barrier()  # every process has read the settings before rank 0 rewrites them
    if rank == 0:
        _atomic(settings, lambda tmp: tmp.write_text(json.dumps(now, indent=1)))
    device = dictionary.W_enc.device
    log_threshold = None
    if dictionary.activation == "jumprelu":
        start = torch.where(dictionary.threshold > 0, dictionary.threshold, torch.full_like(dictionary.threshold, 0.01))
        log_threshold = start.log().detach().requires_grad_(True)
    parameters = [*dictionary.parameters(), *([log_threshold] if log_threshold is not None else [])]
    optimizer = torch.optim.Adam(parameters, lr=plan.lr)
    state = _State(0, optimizer, torch.zeros(dictionary.n_features, dtype=torch.long, device=device), log_threshold)
    if (out / CHECKPOINT).is_file():
        saved = torch.load(out / CHECKPOINT, map_location=device, weights_only=True)
        dictionary.load_state_dict(saved["dictionary"])
        optimizer.load_state_dict(saved["optimizer"])
        state.step, state.last_fired = int(saved["step"]), saved["last_fired"]
        if log_threshold is not None:
            with torch.no_grad():
                log_threshold.copy_(saved["log_threshold"])
    _parallel.broadcast([*dictionary.state_dict().values(), *([log_threshold] if log_threshold is not None else [])])
    if log_threshold is not None:
        with torch.no_grad():
            dictionary.threshold.copy_(log_threshold.exp())
    return state


def _loop(
    dictionary: Dictionary,
    rows: Rows,
    plan: _Plan,
    state: _State,
    out: Path,
    every: int,
    progress: bool,
    rank: int = 0,
    world: int = 1,
) -> None:
    """Steps ``state.step .. plan.steps - 1``, a checkpoint every ``every`` steps and at the end (by rank 0)."""
    device = dictionary.W_enc.device
    for step in progress_bar(range(state.step, plan.steps), desc="train_dictionary", enabled=progress and rank == 0):
        order = _order(plan, step)
        batch = rows.take(_parallel.share(order, rank, world)).to(device=device, dtype=dictionary.W_enc.dtype)
        source, target = _split(dictionary, batch)
        if step == 0 and not dictionary.b_dec.any():
            with torch.no_grad():
                dictionary.b_dec.copy_(_parallel.all_sum(target.sum(0)) / len(order))
        _step(dictionary, state, source, target, plan, step, len(order))
        state.step = step + 1
        if rank == 0 and (state.step % every == 0 or state.step == plan.steps):
            _checkpoint(out, dictionary, state)
    _parallel.barrier()  # the last checkpoint is written before any process returns


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


def _decodes_sparsely(dictionary: Dictionary) -> bool:
    """TopK and BatchTopK train on sparse codes (:mod:`._sparse`); ReLU and JumpReLU, whose codes are wider, densely."""
    return dictionary.activation in ("topk", "batchtopk")


def _batch_kth(pre: torch.Tensor, k: int, total: int) -> torch.Tensor:
    """BatchTopK over every process's rows: the ``(k x total)``-th largest ``relu(pre)`` of all processes."""
    keep = k * total
    flat = torch.relu(pre).detach().reshape(-1)
    mine = flat.topk(min(keep, flat.numel())).values
    mine = torch.cat([mine, mine.new_zeros(keep - len(mine))])
    return _parallel.gather(mine).topk(keep).values[-1]


def _features(
    dictionary: Dictionary, pre: torch.Tensor, state: _State, plan: _Plan, total: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training activations of ``pre`` (over the whole batch of ``total`` rows) and JumpReLU's thresholds."""
    activation = dictionary.activation
    if activation == "relu":
        return _math.relu(pre), None
    if activation == "jumprelu":
        assert state.log_threshold is not None
        assert plan.bandwidth is not None
        threshold = state.log_threshold.exp()
        return _math.jumprelu_ste(pre, threshold, plan.bandwidth), threshold
    if activation == "topk":
        return _math.topk(pre, dictionary.k), None
    if not _parallel.active():
        return _math.batch_topk(pre, dictionary.k), None
    positive = torch.relu(pre)
    return positive * (positive >= _batch_kth(pre, dictionary.k, total)).to(pre.dtype), None


def _pattern(dictionary: Dictionary, pre: torch.Tensor, total: int) -> _sparse.Pattern:
    """The active entries of TopK or BatchTopK (over the whole batch of ``total`` rows)."""
    if dictionary.activation == "topk":
        return _sparse.topk_pattern(pre, dictionary.k)
    if not _parallel.active():
        return _sparse.batch_topk_pattern(pre, dictionary.k)
    return _sparse.at_least_pattern(pre, _batch_kth(pre, dictionary.k, total))


@dataclass
class _Forward:
    """One step's forward: the loss, the activations, what fired, the error, and AuxK's prediction of the error."""

    loss: torch.Tensor
    values: torch.Tensor  # the training activations: (rows, n_features) dense, or (nnz,) of the sparse pattern
    fired: torch.Tensor  # (n_features,) bool: positive in some row of this process
    error: torch.Tensor  # target - reconstruction
    aux: Callable[[torch.Tensor], torch.Tensor]  # dead (n_features,) -> AuxK's prediction of the error


def _loss(
    dictionary: Dictionary,
    state: _State,
    source: torch.Tensor,
    target: torch.Tensor,
    plan: _Plan,
    step: int,
    total: int,
) -> _Forward:
    """This process's part of the loss (over the batch's ``total`` rows), computed densely."""
    pre = dictionary.pre(source)
    f, threshold = _features(dictionary, pre, state, plan, total)
    error = target - reconstruct(dictionary, f, source)
    loss = error.pow(2).sum() / total
    if plan.l1_coefficient is not None:
        coefficient = _math.warmed_up(plan.l1_coefficient, step, plan.sparsity_warmup or 0)
        loss = loss + coefficient * _math.l1_penalty(f, dictionary.W_dec).sum() / total
    if threshold is not None:
        assert plan.l0_coefficient is not None
        assert plan.bandwidth is not None
        coefficient = _math.warmed_up(plan.l0_coefficient, step, plan.sparsity_warmup or 0)
        loss = loss + coefficient * _math.step_ste(pre, threshold, plan.bandwidth).sum() / total

    def aux(dead: torch.Tensor) -> torch.Tensor:
        return _math.auxiliary_topk(pre, dead, dictionary.d_in // 2) @ dictionary.W_dec

    return _Forward(loss, f, (f > 0).any(0), error, aux)


def _sparse_loss(dictionary: Dictionary, source: torch.Tensor, target: torch.Tensor, total: int) -> _Forward:
    """This process's part of TopK's or BatchTopK's loss, with sparse codes: equal to :func:`_loss` to rounding."""
    x = dictionary.encoder_input(source)
    with torch.no_grad():  # the one dense product; the graph starts at the active entries
        pre = x @ dictionary.W_enc + dictionary.b_enc

    def active(pattern: _sparse.Pattern) -> torch.Tensor:
        return torch.relu(_sparse.gathered(pre, x, dictionary.W_enc, dictionary.b_enc, pattern))

    pattern = _pattern(dictionary, pre, total)
    values = active(pattern)
    out = _sparse.decode(values, pattern, dictionary.W_dec) + dictionary.b_dec
    skip = dictionary.skip_term(source) if isinstance(dictionary, Transcoder) else None
    error = target - (out if skip is None else out + skip)

    def aux(dead: torch.Tensor) -> torch.Tensor:
        dead_pattern = _sparse.dead_topk_pattern(pre, dead, dictionary.d_in // 2)
        return _sparse.decode(active(dead_pattern), dead_pattern, dictionary.W_dec)

    return _Forward(error.pow(2).sum() / total, values, _sparse.fired(values, pattern), error, aux)


def _step(
    dictionary: Dictionary,
    state: _State,
    source: torch.Tensor,
    target: torch.Tensor,
    plan: _Plan,
    step: int,
    total: int,
) -> None:
    """One optimizer step: loss, gradients summed over the processes, Adam, the activation's bookkeeping."""
    if _decodes_sparsely(dictionary):
        forward = _sparse_loss(dictionary, source, target, total)
    else:
        forward = _loss(dictionary, state, source, target, plan, step, total)
    loss = forward.loss
    fired = _parallel.any_over_processes(forward.fired)
    now = step * plan.batch_size + total
    state.last_fired = torch.where(fired, torch.full_like(state.last_fired, now), state.last_fired)
    unit_rows = dictionary.activation in ("topk", "batchtopk")
    dead = (now - state.last_fired) >= plan.dead_after
    if unit_rows and bool(dead.any()):
        aux = forward.aux(dead)
        residual = forward.error.detach()
        mean = _parallel.all_sum(residual.sum(0)) / total
        scale = _parallel.all_sum((residual - mean).pow(2).sum()) / total
        if bool(scale > 0):  # a batch of one row has no variance to normalise by (the same in every process)
            loss = loss + AUX_ALPHA * (residual - aux).pow(2).sum() / total / scale
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    parameters = [p for group in state.optimizer.param_groups for p in group["params"]]
    _parallel.sum_gradients(parameters)
    with torch.no_grad():
        if unit_rows:
            assert dictionary.W_dec.grad is not None
            dictionary.W_dec.grad.copy_(_math.without_parallel_gradient(dictionary.W_dec, dictionary.W_dec.grad))
        state.optimizer.step()
        if unit_rows:
            dictionary.W_dec.copy_(_math.unit_rows(dictionary.W_dec))
        if dictionary.activation == "batchtopk":
            kept = forward.values[forward.values > 0]
            mine = kept.min() if kept.numel() else torch.full((), math.inf, device=kept.device, dtype=kept.dtype)
            smallest = _parallel.min_over_processes(mine)
            smallest = torch.where(torch.isinf(smallest), torch.zeros_like(smallest), smallest)
            first = step == 0
            dictionary.threshold.copy_(
                smallest if first else THRESHOLD_BETA * dictionary.threshold + (1 - THRESHOLD_BETA) * smallest
            )
        if state.log_threshold is not None:
            dictionary.threshold.copy_(state.log_threshold.exp())


def _checkpoint(out: Path, dictionary: Dictionary, state: _State) -> None:
    payload = {
        "step": state.step,
        "dictionary": dictionary.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "last_fired": state.last_fired,
        **({"log_threshold": state.log_threshold.detach()} if state.log_threshold is not None else {}),
    }
    _atomic(out / CHECKPOINT, lambda tmp: torch.save(payload, tmp))


def _atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename over ``path``: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
