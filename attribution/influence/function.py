"""Influence functions: ``g_test^T (H + lambda I)^-1 g_train``, the curvature exact, diagonal, (EK-)FAC or Arnoldi."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hooks import ModuleTarget

from .. import _distributed as dist
from .._progress import progress
from ..datasets import Results, model_digest, tensor_digest
from . import _curvature as cv
from ._arnoldi import arnoldi, check_dimensions, top_eigenpairs
from ._batches import Loss, batches, check_loss, labels_of, per_example_losses
from ._exact import exact_hessian, hessian_vector_products
from ._fisher import SampleLabels, check_fisher, fisher_batch
from ._kronecker import from_block, has_block, input_rows, output_rows, to_block
from ._passes import BatchSums, Checkpoint, accumulate, batch_digest, check_digests
from ._signals import hooked_signals
from ._stream import stream_rows
from .gradients import per_example_gradients, select_modules

Finish = Callable[[dict[str, Tensor]], dict[str, Tensor]]
METHODS = ("identity", "diagonal", "kfac", "ekfac", "exact", "arnoldi")


class InfluenceFunction:
    """Influence of training examples on test examples through the (approximate) inverse curvature of the loss.

    ``scores[i, j] = g_test_i^T P g_train_j`` with ``P`` the damped inverse of the curvature of the mean training
    loss with respect to the chosen modules' parameters: positive when training on example ``j`` lowers test example
    ``i``'s loss (a proponent); no division by the training set size. ``method``:

    - ``"identity"``: ``P = I`` (gradient similarity).
    - ``"diagonal"``: the Fisher's diagonal ``E[g^2]`` per parameter.
    - ``"kfac"``: per module ``A (x) S`` (the docs page states the factors).
    - ``"ekfac"``: K-FAC's eigenbases with the eigenvalues refit to ``E[(Q_S^T G Q_A)^2]`` (George et al. 2018,
      Grosse et al. 2023).
    - ``"exact"``: the Hessian of the mean training loss over all chosen parameters jointly (small models).
    - ``"arnoldi"``: that Hessian's ``projection_dim`` largest eigenpairs, found by ``arnoldi_dim`` steps of Arnoldi
      iteration on Hessian-vector products from a random start drawn with ``seed`` (Schioppa et al. 2022,
      https://arxiv.org/abs/2112.03052, captum's ``ArnoldiInfluenceFunction``); ``P`` is the damped inverse in
      their span and zero outside it.

    K-FAC and EK-FAC take the modules whose parameters form one Kronecker block (``nn.Linear``, HuggingFace
    ``Conv1D``, ``nn.Conv1d``/``nn.Conv2d`` with ``groups=1``); the others any module :func:`per_example_gradients`
    handles. ``damping=None`` is 0.1 times the mean eigenvalue of each module's curvature (of the whole Hessian for
    ``"exact"``, of the kept eigenvalues for ``"arnoldi"``), as Kronfluence sets it.

    Args:
        model: the trained model.
        loss: per-example loss, as :func:`per_example_gradients` takes it.
        modules: names, globs or modules; default every supported module with trainable parameters.
        method: one of ``"identity"``, ``"diagonal"``, ``"kfac"``, ``"ekfac"``, ``"exact"``, ``"arnoldi"``.
        damping: added to every eigenvalue (to the diagonal, to the Hessian); ``None``: 0.1 x the mean eigenvalue.
        fisher: ``"sampled"`` (labels drawn from the model, see the docs page) or
            ``"empirical"`` (the true labels) for the diagonal, K-FAC and EK-FAC curvature.
        sample_labels: ``(outputs, batch, generator) -> labels`` for a loss whose distribution is not known.
        seed: the seed of the sampled labels, and of Arnoldi's start vector.
        progress: progress bars over the batches of long passes (shown on a terminal after a second).
        arnoldi_dim: the Krylov space's dimension (Hessian-vector products, each one pass over ``train``).
        projection_dim: how many of the largest eigenpairs ``"arnoldi"`` keeps (at most ``arnoldi_dim``).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> train = (torch.randn(16, 3), torch.randint(0, 2, (16,)))
        >>> test = (torch.randn(2, 3), torch.tensor([0, 1]))
        >>> influence = InfluenceFunction(model, torch.nn.CrossEntropyLoss(reduction="none")).fit(train)
        >>> influence.scores(test, train).shape
        torch.Size([2, 16])
    """

    def __init__(
        self,
        model: nn.Module,
        loss: Loss,
        modules: ModuleTarget | None = None,
        method: str = "ekfac",
        damping: float | None = None,
        fisher: str = "sampled",
        sample_labels: SampleLabels | None = None,
        seed: int = 0,
        progress: bool = True,
        arnoldi_dim: int = 200,
        projection_dim: int = 50,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}; got {method!r}")
        check_loss(loss)
        if method in ("diagonal", "kfac", "ekfac"):
            check_fisher(fisher, loss, sample_labels)
        check_dimensions(arnoldi_dim, projection_dim)
        self.arnoldi_dim, self.projection_dim = arnoldi_dim, projection_dim
        self.model, self.loss, self.modules, self.method = model, loss, modules, method
        self.damping, self.fisher, self.sample_labels, self.seed = damping, fisher, sample_labels, seed
        self.progress = progress
        self.chosen = self._chosen()
        self.state: dict[str, Tensor] = {}
        self.train_digests: list[str] = []
        self._source: Any = None

    def _chosen(self) -> list[tuple[str, nn.Module]]:
        chosen = select_modules(self.model, self.modules)
        if self.method in ("kfac", "ekfac"):
            without = [f"{name!r} ({type(m).__name__})" for name, m in chosen if not has_block(m)]
            if without:
                raise ValueError(
                    f"method={self.method!r} needs modules whose weight is one Kronecker block (nn.Linear, "
                    f"HuggingFace Conv1D, a Conv1d/Conv2d with groups=1); {', '.join(without[:5])} are not. Choose "
                    "modules with `modules=` (e.g. '*.mlp.*'), or use method='diagonal'"
                )
        return chosen

    # -- fitting -------------------------------------------------------------------------------------------------
    def fit(
        self, train: Any, checkpoint: str | Path | None = None, checkpoint_every: float = 60.0
    ) -> InfluenceFunction:
        """Estimate the curvature on ``train`` (a batch or a DataLoader of batches); returns ``self``.

        Under ``torchrun`` every process passes the whole source and computes its share of the batches; the sums
        are added over the processes (the diagonal, K-FAC and EK-FAC passes). ``checkpoint``: a file written at most
        every ``checkpoint_every`` seconds and after each pass (one per process under torchrun; for Arnoldi, after a
        step: each step is a pass); a fit killed before the end and called again with the same arguments resumes
        from it, to the same factors (or eigenpairs) bitwise. It applies to every method but ``"exact"`` and
        ``"identity"`` (no pass to resume).
        """
        if checkpoint is not None and self.method in ("exact", "identity"):
            raise ValueError(
                f"`checkpoint` applies to the diagonal, K-FAC, EK-FAC and Arnoldi fits, not method={self.method!r}"
            )
        saver = Checkpoint(checkpoint, self._settings(), checkpoint_every) if checkpoint is not None else None
        saved = saver.load() if saver is not None else {"finished": {}, "running": None}
        self.state, digests = {}, []
        for stage, (what, sums, finish) in enumerate(self._passes()):
            if stage in saved["finished"]:
                done = saved["finished"][stage]
                self.state.update(done["state"])
                digests = done["digests"]
                continue
            totals, digests = accumulate(
                train, stage, sums, seed=self.seed, what=what, show=self.progress, checkpoint=saver, saved=saved
            )
            self.state.update(finish(totals))
            saved["finished"][stage] = {"state": {k: v for k, v in self.state.items()}, "digests": digests}
            if saver is not None:
                saver.save({"finished": saved["finished"], "running": None}, force=True)
        if self.method == "exact":
            hessian = exact_hessian(self.model, train, self.loss, self._parameters())
            self.state = {"inverse": self._damped_inverse(hessian)}
        elif self.method == "arnoldi":
            self.state = self._arnoldi(train, saver)
        self.state["fitted"] = torch.ones(())
        self.train_digests, self._source = digests, train
        return self

    def _settings(self) -> dict[str, Any]:
        """What a checkpoint must have been written with."""
        return {
            "method": self.method,
            "damping": self.damping,
            "fisher": self.fisher,
            "seed": self.seed,
            "modules": [n for n, _ in self.chosen],
            "model": model_digest(self.model),
            **(self._dimensions() if self.method == "arnoldi" else {}),
        }

    def _dimensions(self) -> dict[str, int]:
        return {"arnoldi_dim": self.arnoldi_dim, "projection_dim": self.projection_dim}

    def _passes(self) -> list[tuple[str, BatchSums, Finish]]:
        """The fit's passes: what each sums per batch and how its sums become state."""
        if self.method == "diagonal":
            return [("diagonal Fisher", self._diagonal_sums, self._means)]
        if self.method in ("kfac", "ekfac"):
            passes: list[tuple[str, BatchSums, Finish]] = [("K-FAC factors", self._factor_sums, self._factors)]
            if self.method == "ekfac":
                passes.append(("EK-FAC eigenvalues", self._refit_sums, self._means))
            return passes
        return []

    def _fisher_loss(self, generator: torch.Generator) -> Loss:
        """The per-example loss at the Fisher's labels (the true ones, or drawn from the model per call)."""
        loss, fisher, sample = self.loss, self.fisher, self.sample_labels

        def at_fisher_labels(outputs: Any, batch: Any) -> Tensor:
            chosen = fisher_batch(batch, outputs, loss, fisher, sample, generator)
            return per_example_losses(loss, outputs, chosen, labels_of(batch).shape[0])

        return at_fisher_labels

    def _diagonal_sums(self, batch: Any, generator: torch.Generator) -> dict[str, Tensor]:
        grads = per_example_gradients(self.model, batch, self._fisher_loss(generator), self.modules)
        count = torch.tensor(labels_of(batch).shape[0], dtype=torch.float64)
        return {"count": count, **{f"diagonal/{name}": (g**2).sum(0) for name, g in grads.items()}}

    def _factor_sums(self, batch: Any, generator: torch.Generator) -> dict[str, Tensor]:
        """Per batch: ``sum a a^T``, ``sum_t delta delta^T`` and the positions per module, and the examples."""
        sums: dict[str, Tensor] = {}
        by_id = {id(m): name for name, m in self.chosen}

        def on_signal(module: nn.Module, a: Tensor, delta: Tensor) -> None:
            name = by_id[id(module)]
            rows_a, rows_s = input_rows(module, a), output_rows(module, delta)
            pair = {f"a/{name}": cv.second_moment(rows_a), f"s/{name}": torch.einsum("bto,btp->op", rows_s, rows_s)}
            pair[f"positions/{name}"] = torch.tensor(rows_a.shape[0] * rows_a.shape[1], dtype=torch.float64)
            for key, value in pair.items():
                sums[key] = sums[key] + value if key in sums else value

        hooked_signals(self.model, batch, self._fisher_loss(generator), self.chosen, on_signal)
        return {"count": torch.tensor(labels_of(batch).shape[0], dtype=torch.float64), **sums}

    def _factors(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """Pass 1's end: ``A`` and ``S`` per module, then their eigenbases."""
        state: dict[str, Tensor] = {}
        examples = totals["count"]
        for name, _ in self.chosen:
            big_a, big_s = totals[f"a/{name}"], totals[f"s/{name}"]
            positions = totals[f"positions/{name}"].to(big_a.dtype)
            (l_a, q_a), (l_s, q_s) = cv.eigenbasis(big_a / positions), cv.eigenbasis(big_s / examples.to(big_s.dtype))
            state.update({f"q_a/{name}": q_a, f"q_s/{name}": q_s, f"lambda/{name}": cv.kfac_eigenvalues(l_s, l_a)})
        return state

    def _refit_sums(self, batch: Any, generator: torch.Generator) -> dict[str, Tensor]:
        """Pass 2 (EK-FAC) per batch: the squared rotated per-example gradients, summed."""
        sums = {"count": torch.tensor(labels_of(batch).shape[0], dtype=torch.float64)}
        for name, _, block in self._blocks(batch, self._fisher_loss(generator)):
            rotated = cv.rotate(block, self.state[f"q_s/{name}"], self.state[f"q_a/{name}"])
            sums[f"lambda/{name}"] = (rotated**2).sum(0)
        return sums

    @staticmethod
    def _means(totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """The end of the diagonal's pass and of EK-FAC's second: each sum over the examples divided by their count."""
        count = totals.pop("count")
        return {key: value / count.to(value.dtype) for key, value in totals.items()}

    def _blocks(self, batch: Any, loss: Loss) -> Iterator[tuple[str, nn.Module, Tensor]]:
        """Each chosen module's per-example gradient as a block ``(batch, d_out, d_in)``."""
        grads = per_example_gradients(self.model, batch, loss, self.modules)
        names = {id(p): name for name, p in self.model.named_parameters()}
        for name, module in self.chosen:
            own = {key: grads[names[id(p)]] for key, p in module.named_parameters(recurse=False) if p.requires_grad}
            yield name, module, to_block(module, own)

    def _parameters(self) -> list[tuple[str, Tensor]]:
        seen = {id(p) for _, m in self.chosen for p in m.parameters(recurse=False) if p.requires_grad}
        return [(name, p) for name, p in self.model.named_parameters() if id(p) in seen]

    def _damped_inverse(self, hessian: Tensor) -> Tensor:
        values, vectors = torch.linalg.eigh(hessian)
        damping = self._eigen_damping(values)
        return vectors @ torch.diag(1 / (values + damping)) @ vectors.T

    def _eigen_damping(self, values: Tensor) -> Tensor | float:
        """The damping added to the Hessian's (kept) eigenvalues, checked to make them all positive."""
        damping = self.damping if self.damping is not None else cv.default_damping(values)
        if (values + damping <= 0).any():
            hint = " or lower `projection_dim`" if self.method == "arnoldi" else ""
            raise ValueError(
                f"the damped Hessian is not positive definite (smallest eigenvalue {values.min().item():.3g}, damping "
                f"{float(damping):.3g}): the model is not at a minimum of the training loss; raise `damping`{hint}"
            )
        return damping

    def _arnoldi(self, train: Any, saver: Checkpoint | None) -> dict[str, Tensor]:
        """The top eigenpairs of the Hessian of the mean training loss, by Arnoldi iteration on its products.

        With a checkpoint, the iteration's progress is saved after each step (at most every ``checkpoint_every``
        seconds) and a saved one is resumed.
        """
        saved = saver.load().get("arnoldi") if saver is not None else None
        resume = (saved["rows"], saved["restricted"], int(saved["done"])) if saved is not None else None

        def keep(done: tuple[Tensor, Tensor, int]) -> None:
            assert saver is not None
            rows, restricted, steps = done
            saver.save({"finished": {}, "running": None, "arnoldi": {"rows": rows, "restricted": restricted,
                                                                     "done": steps}})  # fmt: skip

        params = self._parameters()
        hvp = hessian_vector_products(self.model, train, self.loss, params)
        generator = torch.Generator().manual_seed(self.seed)  # captum's start: randn per parameter, in order
        start = torch.cat([torch.randn(p.shape, generator=generator, dtype=p.dtype).flatten() for _, p in params])

        def loop(steps: Any) -> Any:
            return progress(steps, desc="Arnoldi iteration", enabled=self.progress, total=self.arnoldi_dim)

        basis, restricted = arnoldi(
            hvp, start.to(params[0][1].device), self.arnoldi_dim, loop=loop, resume=resume,
            after_step=keep if saver is not None else None,
        )  # fmt: skip
        values, vectors = top_eigenpairs(basis, restricted, self.projection_dim)
        self._eigen_damping(values)  # refuse a Hessian the damping leaves indefinite now, not when scoring
        return {"eigenvalues": values, "eigenvectors": vectors}

    # -- scoring -------------------------------------------------------------------------------------------------
    def preconditioned(self, batch: Any) -> Tensor:
        """``P g`` for each example of ``batch``, flattened in parameter order: ``(batch, n_parameters)``."""
        self._check_fitted()
        if self.method in ("kfac", "ekfac"):
            by_id: dict[int, Tensor] = {}
            for name, module, block in self._blocks(batch, self.loss):
                lam = self.state[f"lambda/{name}"]
                damping = self.damping if self.damping is not None else cv.default_damping(lam)
                out = cv.precondition_eigen(block, self.state[f"q_s/{name}"], self.state[f"q_a/{name}"], lam, damping)
                by_id.update({id(getattr(module, key)): g for key, g in from_block(module, out).items()})
            return torch.cat([by_id[id(p)].flatten(1) for _, p in self._parameters()], dim=1)
        grads = per_example_gradients(self.model, batch, self.loss, self.modules)
        if self.method == "diagonal":
            grads = {name: self._diagonal_precondition(name, g) for name, g in grads.items()}
        flat = torch.cat([g.flatten(1) for g in grads.values()], dim=1)
        if self.method == "arnoldi":
            values, vectors = self.state["eigenvalues"], self.state["eigenvectors"]
            return (flat @ vectors) / (values + self._eigen_damping(values)) @ vectors.T
        return flat @ self.state["inverse"] if self.method == "exact" else flat

    def _diagonal_precondition(self, name: str, g: Tensor) -> Tensor:
        diagonal = self.state[f"diagonal/{name}"]
        damping = self.damping if self.damping is not None else cv.default_damping(diagonal)
        return cv.precondition_diagonal(g, diagonal, damping)

    def gradients(self, batch: Any) -> Tensor:
        """Each example's plain gradient, flattened in parameter order (as :meth:`preconditioned`)."""
        grads = per_example_gradients(self.model, batch, self.loss, self.modules)
        return torch.cat([g.flatten(1) for g in grads.values()], dim=1)

    def scores(self, test: Any, train: Any) -> Tensor:
        """``(n_test, n_train)``: ``g_test^T P g_train`` (positive: training on the example lowers the test loss)."""
        left = torch.cat([self.preconditioned(batch) for batch in batches(test)])
        params = self._parameters()
        parts = [part.contiguous() for part in left.split([p.numel() for _, p in params], dim=1)]

        def columns(batch: Any) -> Tensor:  # per parameter: no copy of the batch's gradients into one row each
            grads = per_example_gradients(self.model, batch, self.loss, self.modules)
            pairs = zip(parts, (grads[name] for name, _ in params), strict=True)
            return torch.stack([part @ g.flatten(1).T for part, g in pairs]).sum(0)

        return self._by_training_example(train, "influence scores", columns)

    def self_influence(self, train: Any) -> Tensor:
        """``(n_train,)``: ``g^T P g`` of each training example with itself."""
        return self._by_training_example(
            train, "self-influence", lambda b: (self.preconditioned(b) * self.gradients(b)).sum(1)
        )

    def _by_training_example(self, train: Any, what: str, columns: Any) -> Tensor:
        """``columns(batch)`` of every training batch side by side on the last axis.

        Under ``torchrun`` each process computes its share of the batches (``i % world == rank``) and the others'
        columns are added in from the other processes, so every process returns the whole result. The source the
        fit read must give the same batches again (checked against the fit's fingerprints as it goes).
        """
        rank, world = dist.setup()
        fitted = self._source is train and bool(self.train_digests)
        own: dict[int, Tensor] = {}
        sizes: list[int] = []
        digests: list[str] = []
        for index, batch in enumerate(self._batches(train, what)):
            if fitted:
                digests.append(batch_digest(batch))
                check_digests(digests, self.train_digests, index)
            sizes.append(labels_of(batch).shape[0])
            if index % world == rank:
                own[index] = columns(batch)
        if fitted and len(digests) != len(self.train_digests):
            check_digests([*digests, ""], self.train_digests, len(digests))  # fewer or more batches than the fit's
        if len(sizes) < world:
            raise ValueError(f"{len(sizes)} training batches for {world} processes: each process needs one at least")
        template = own[rank]
        parts = [own[i] if i in own else template.new_zeros(*template.shape[:-1], n) for i, n in enumerate(sizes)]
        return dist.all_sum(torch.cat(parts, dim=-1))

    def stream_scores(
        self,
        test: Any,
        train: Any,
        out: str | Path,
        *,
        batch_size: int = 64,
        progress: bool | None = None,
        overwrite: bool = False,
    ) -> Results:
        """The scores of a large training set written to ``out`` by the dataset store, one row per training example.

        ``results.maps[j]`` is training example ``j``'s column of :meth:`scores`, ``(n_test,)``, stored as float32.
        Memory holds one training batch's gradients and the test examples' preconditioned ones; the rows go to disk
        in shards, each written atomically; a killed run called again resumes with the missing shards (only for the
        same fit, test examples and model); under ``torchrun`` each process computes its share of the shards.

        Args:
            test: the test batch (or batches).
            train: a map-style ``Dataset`` of ``(input, label)`` items (or dicts with ``labels``), or a
                ``DataLoader`` of one (its batch size and ``collate_fn`` are kept; items in index order).
            out: the output folder.
            batch_size: training examples per batch (for a ``Dataset``).
            progress: a progress bar (default: as the object was built).
            overwrite: delete results already in ``out`` and start over.

        Returns:
            The stored :class:`~attribution.datasets.Results` (read lazily).
        """
        self._check_fitted()
        left = torch.cat([self.preconditioned(batch) for batch in batches(test)])
        identity = [repr(self._settings()), tensor_digest(left), repr(sorted(self.state))]
        shown = self.progress if progress is None else progress
        return stream_rows(
            lambda batch: self.gradients(batch) @ left.T,
            train,
            out,
            identity,
            batch_size=batch_size,
            progress=shown,
            overwrite=overwrite,
        )

    def top(self, test: Any, train: Any, k: int = 10, proponents: bool = True) -> tuple[Tensor, Tensor]:
        """The ``k`` strongest proponents (largest scores) or opponents (smallest) per test example."""
        return self.scores(test, train).topk(k, dim=1, largest=proponents)

    def _batches(self, data: Any, what: str) -> Iterator[Any]:
        """The batches of ``data``, with a progress bar (when asked for) that counts them."""
        return progress(batches(data), desc=what, enabled=self.progress, unit="batch")

    def _check_fitted(self) -> None:
        if self.method != "identity" and "fitted" not in self.state:
            raise RuntimeError(f"call .fit(train) before scoring: method={self.method!r} needs the curvature")

    # -- saving --------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the fitted curvature and the settings to ``path`` (``torch.save``, written atomically)."""
        settings = {"method": self.method, "damping": self.damping, "fisher": self.fisher, "seed": self.seed}
        settings.update(self._dimensions())
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        torch.save({"settings": settings, "state": self.state, "modules": [n for n, _ in self.chosen]}, partial)
        partial.replace(target)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, loss: Loss, modules: ModuleTarget | None = None) -> Any:
        """An :class:`InfluenceFunction` with the curvature :meth:`save` wrote, for ``model``."""
        saved = torch.load(path, weights_only=True)
        settings = saved["settings"]
        dims = {key: settings[key] for key in ("arnoldi_dim", "projection_dim") if key in settings}
        made = cls(
            model,
            loss,
            modules,
            settings["method"],
            settings["damping"],
            settings["fisher"],
            seed=settings["seed"],
            **dims,
        )
        if [n for n, _ in made.chosen] != saved["modules"]:
            raise ValueError(
                f"{path} was fitted on modules {saved['modules'][:5]}, but this model and `modules` choose "
                f"{[n for n, _ in made.chosen][:5]}: load it with the model and modules it was fitted on"
            )
        made.state = saved["state"]
        return made
