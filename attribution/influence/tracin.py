"""TracIn over checkpoints (Pruthi et al. 2020; captum's ``TracInCP``): ``sum_k lr_k g_k(test) . g_k(train)``."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import reduce
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hooks import ModuleTarget

from ..datasets import Results, tensor_digest
from ._batches import batches, check_loss
from ._stream import stream_rows
from .gradients import select_modules, session
from .projection import RandomProjection

Checkpoint = tuple[Mapping[str, Tensor] | str | Path, float]


class TracIn:
    """TracInCP: the influence of each training example on each test example, summed over checkpoints.

    ``scores[i, j] = sum_k lr_k g_k(test_i) . g_k(train_j)``, where ``g_k`` is an example's loss gradient for the
    chosen modules' parameters with checkpoint ``k`` loaded and ``lr_k`` the learning rate it was trained with
    (captum's ``TracInCP``, exact per-example gradients, no projection unless asked). Positive: a proponent
    (a gradient step on ``train_j`` lowers the loss of ``test_i``); negative: an opponent. Gradients come from
    :func:`per_example_gradients`, one forward and backward per batch, optionally projected. Each call loads every
    checkpoint into the model in turn and gives the model its own parameters and buffers back afterwards, also on
    errors.

    Args:
        model: the model the checkpoints belong to.
        checkpoints: ``(state_dict or path, learning_rate)`` pairs; a path is read with
            ``torch.load(weights_only=True)``.
        loss: a callable ``(outputs, batch) -> (batch,)`` or an ``nn.Module`` with ``reduction="none"``.
        modules: which modules' parameters (names, globs, modules); default every supported trainable module.
        projection: a :class:`RandomProjection` applied to every gradient (TRAK-style TracIn).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> loss = torch.nn.MSELoss(reduction="none")
        >>> tracin = TracIn(model, [({"weight": torch.tensor([[2.0]])}, 0.5)], loss)
        >>> x = torch.tensor([[1.0], [2.0]])
        >>> tracin.scores((x, x), (x, x))   # 0.5 * 2 x_i^2 (w - 1) * 2 x_j^2 (w - 1)
        tensor([[ 2.,  8.],
                [ 8., 32.]])
    """

    def __init__(
        self,
        model: nn.Module,
        checkpoints: Sequence[tuple[Mapping[str, Tensor] | str | Path, float]],
        loss: Callable[[Any, Any], Tensor] | nn.Module,
        modules: ModuleTarget | None = None,
        projection: RandomProjection | None = None,
    ) -> None:
        check_loss(loss)
        select_modules(model, modules)  # an unsupported module is named now, not after the first checkpoint
        self.checkpoints = _checked_checkpoints(checkpoints)
        self.model, self.loss, self.modules, self.projection = model, loss, modules, projection

    def scores(self, test: Any, train: Any) -> Tensor:
        """``(n_test, n_train)`` TracIn scores; ``test``/``train``: a batch or an iterable of batches (a DataLoader)."""
        total: Tensor | None = None
        for state, rate in self.checkpoints:
            with self._loaded(state), self._session() as run:
                tests = _cat([_flat(run(batch)) for batch in batches(test)])
                block = torch.cat([_dot(tests, _flat(run(batch))) for batch in batches(train)], dim=1)
            total = rate * block if total is None else total + rate * block
        assert total is not None
        return total

    def self_influence(self, train: Any) -> Tensor:
        """``(n_train,)``: ``sum_k lr_k |g_k(train_j)|^2``, each example's influence on itself."""
        total: Tensor | None = None
        for state, rate in self.checkpoints:
            with self._loaded(state), self._session() as run:
                squares = torch.cat([_square_norms(_flat(run(batch))) for batch in batches(train)])
            total = rate * squares if total is None else total + rate * squares
        assert total is not None
        return total

    def top(self, test: Any, train: Any, k: int = 10, proponents: bool = True) -> tuple[Tensor, Tensor]:
        """The ``k`` largest (proponents) or most negative (opponents) scores of each test example.

        Returns:
            ``(values, indices)``, both ``(n_test, k)`` (``k`` capped at ``n_train``), indices into the training set.
        """
        scores = self.scores(test, train)
        values, indices = scores.topk(min(k, scores.shape[1]), dim=1, largest=proponents)
        return values, indices

    def stream_scores(
        self, test: Any, train: Any, out: str | Path, *, batch_size: int = 64, progress: bool = False,
        overwrite: bool = False,
    ) -> Results:  # fmt: skip
        """The scores of a large training set written to ``out`` by the dataset store, one row per training example.

        ``results.maps[j]`` is training example ``j``'s column of :meth:`scores`, ``(n_test,)``, stored as float32.
        The test examples' gradients are computed once per checkpoint and held (use ``projection`` for large
        models); each training batch then runs once per checkpoint (path checkpoints are read once). The rows go to
        disk in shards, each written atomically; a killed run called again resumes with the missing shards (only for
        the same checkpoints, learning rates, test examples and settings); under ``torchrun`` each process computes
        its share of the shards. The arguments are those of
        :meth:`attribution.InfluenceFunction.stream_scores` (``train``: a map-style ``Dataset`` or a ``DataLoader`` of
        one; ``progress``: a progress bar).

        Returns:
            The stored :class:`~attribution.datasets.Results` (read lazily).
        """
        states = [(self._read(state), rate) for state, rate in self.checkpoints]
        for state, _ in states:
            _check_matches(state, self.model.state_dict())
        # the model's own state kept and the hooks registered once for the whole run, not per training batch
        with self._own_state_kept(), self._session() as run:
            tests = []
            for state, _ in states:
                self.model.load_state_dict(state)
                tests.append(_cat([_flat(run(batch)) for batch in batches(test)]))
            identity = [repr((self.modules, self.projection, [rate for _, rate in states]))]
            identity += ["/".join(f"{k}:{tensor_digest(v)}" for k, v in state.items()) for state, _ in states]
            identity += [tensor_digest(torch.cat([g.reshape(-1) for g in grads.values()])) for grads in tests]

            def rows(batch: Any) -> Tensor:
                total: Tensor | None = None
                for (state, rate), grads in zip(states, tests, strict=True):
                    self.model.load_state_dict(state)
                    block = rate * _dot(grads, _flat(run(batch))).T
                    total = block if total is None else total + block
                assert total is not None
                return total

            return stream_rows(
                rows, train, out, identity, batch_size=batch_size, progress=progress, overwrite=overwrite
            )  # fmt: skip

    @staticmethod
    def _read(state: Mapping[str, Tensor] | str | Path) -> Mapping[str, Tensor]:
        return state if isinstance(state, Mapping) else torch.load(state, map_location="cpu", weights_only=True)

    def _session(self) -> AbstractContextManager[Callable[[Any], dict[str, Tensor]]]:
        """The model hooked once for a pass over the data (see :func:`per_example_gradients`)."""
        return session(self.model, self.loss, self.modules, self.projection)

    @contextmanager
    def _loaded(self, state: Mapping[str, Tensor] | str | Path) -> Iterator[None]:
        """Load a checkpoint for the body; then put the model's own parameters and buffers back, also on errors."""
        values = self._read(state)
        _check_matches(values, self.model.state_dict())
        with self._own_state_kept():
            self.model.load_state_dict(values)
            yield

    @contextmanager
    def _own_state_kept(self) -> Iterator[None]:
        """The model's own parameters and buffers put back after the body, also on errors."""
        saved = {key: value.detach().clone() for key, value in self.model.state_dict().items()}
        try:
            yield
        finally:
            self.model.load_state_dict(saved)


def _checked_checkpoints(checkpoints: Sequence[Checkpoint]) -> list[Checkpoint]:
    """``checkpoints`` as a list of ``(state, float)`` pairs, or a ``TypeError``/``ValueError`` saying what came."""
    if isinstance(checkpoints, (str, Path, Mapping)) or not checkpoints:
        raise ValueError(
            "`checkpoints` must be a non-empty list of (state_dict or path, learning_rate) pairs; got "
            f"{type(checkpoints).__name__}. Pass e.g. [(torch.load(path), 0.01)]"
        )
    out = []
    for item in checkpoints:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], (int, float))):
            raise TypeError(f"each checkpoint must be a (state_dict or path, learning_rate) pair; got {item!r:.80}")
        if not isinstance(item[0], (Mapping, str, Path)):
            raise TypeError(f"a checkpoint's state must be a state_dict or a path; got {type(item[0]).__name__}")
        out.append((item[0], float(item[1])))
    return out


def _check_matches(state: Mapping[str, Tensor], own: Mapping[str, Tensor]) -> None:
    """A checkpoint must hold exactly the model's parameters and buffers, with the model's shapes."""
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [
        f"{k}: {tuple(state[k].shape)} vs the model's {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"a checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, shapes "
            f"{shapes[:5]}. Pass the model's own state_dict() saved during training (the model it came from)"
        )


def _flat(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-example gradients flattened to ``(batch, size)``."""
    return {name: g.reshape(g.shape[0], -1) for name, g in grads.items()}


def _cat(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-parameter gradients of several batches, one after the other."""
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def _square_norms(grads: dict[str, Tensor]) -> Tensor:
    """``(n_batch,)`` squared norms of flattened gradients, summed over parameters."""
    return reduce(operator.add, (g.square().sum(1) for g in grads.values()))


def _dot(tests: dict[str, Tensor], train: dict[str, Tensor]) -> Tensor:
    """``(n_test, n_batch)`` inner products of flattened gradients, summed over parameters."""
    return reduce(operator.add, (tests[name] @ train[name].T for name in tests))
