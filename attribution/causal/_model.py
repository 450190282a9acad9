"""A small high-level causal model: variables with parents and functions; runs, counterfactuals and DAS triples."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


class CausalModel:
    """Variables computed from their parents, in the order given (inputs are variables without a function).

    Args:
        variables: ``{name: (parents, function)}`` in topological order; ``function(*parent_values)`` returns the
            variable's batch of values; an input has ``([], None)``.

    Example:
        >>> m = CausalModel({"a": ([], None), "b": ([], None), "same": (["a", "b"], lambda a, b: a == b)})
        >>> m.run({"a": torch.tensor([1, 2]), "b": torch.tensor([1, 3])})["same"].tolist()
        [True, False]
    """

    def __init__(self, variables: Mapping[str, tuple[Sequence[str], Callable[..., torch.Tensor] | None]]) -> None:
        seen: set[str] = set()
        for name, (parents, _) in variables.items():
            missing = [p for p in parents if p not in seen]
            if missing:
                raise ValueError(f"variable {name!r} has parents {missing} not defined before it; list parents first")
            seen.add(name)
        self.variables = dict(variables)
        self.inputs = [name for name, (_, fn) in self.variables.items() if fn is None]
        self.output = list(self.variables)[-1]

    def run(self, inputs: Mapping[str, torch.Tensor], fixed: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Every variable's values; ``fixed`` variables take the given values instead of their function's."""
        absent = [name for name in self.inputs if name not in inputs]
        if absent:
            raise KeyError(f"`inputs` lacks {absent}; the model's inputs are {self.inputs}")
        values: dict[str, Any] = {}
        for name, (parents, fn) in self.variables.items():
            if fixed is not None and name in fixed:
                values[name] = fixed[name]
            else:
                values[name] = inputs[name] if fn is None else fn(*(values[p] for p in parents))
        return values

    def counterfactual(
        self, base: Mapping[str, torch.Tensor], source: Mapping[str, torch.Tensor], variables: Sequence[str]
    ) -> torch.Tensor:
        """The output of the base's run with ``variables`` taken from the source's run."""
        unknown = [v for v in variables if v not in self.variables]
        if unknown:
            raise KeyError(f"`variables` {unknown} are not in the model; it has {list(self.variables)}")
        from_source = self.run(source)
        return self.run(base, {v: from_source[v] for v in variables})[self.output]

    def sample_triples(
        self, n: int, sampler: Callable[[int, torch.Generator], dict], variables: Sequence[str], seed: int = 0
    ) -> tuple[dict, dict, torch.Tensor]:
        """``(base inputs, source inputs, counterfactual labels)``; ``sampler(n, generator)`` draws ``n`` inputs."""
        g = torch.Generator().manual_seed(seed)
        base, source = sampler(n, g), sampler(n, g)
        return base, source, self.counterfactual(base, source, variables)
