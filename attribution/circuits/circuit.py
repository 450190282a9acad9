"""A circuit: a set of ``(writer, reader)`` edges of a transformer's graph."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path


class Circuit:
    """A set of edges ``(writer, reader)``, in the order they were given (duplicates dropped).

    Node names are those of :class:`attribution.circuits.Graph`; they are checked against a model's graph when the
    circuit is used (:func:`attribution.evaluate`), not here.

    Example:
        >>> a = Circuit(edges=[("embed", "a0.h1.q"), ("a0.h1", "logits")])
        >>> b = Circuit(edges=[("a0.h1", "logits")])
        >>> len(a), ("embed", "a0.h1.q") in a, list(a & b), len(a | b), len(Circuit(edges=[]))
        (2, True, [('a0.h1', 'logits')], 2, 0)
    """

    def __init__(self, edges: Iterable[tuple[str, str]] = ()) -> None:
        checked: dict[tuple[str, str], None] = {}
        for edge in edges:
            if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(n, str) for n in edge)):
                raise TypeError(f"`edges` must hold (writer, reader) pairs of node names; got {edge!r}")
            checked[edge[0], edge[1]] = None
        self._edges = checked

    def __len__(self) -> int:
        return len(self._edges)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._edges)

    def __contains__(self, edge: object) -> bool:
        return isinstance(edge, tuple) and edge in self._edges

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Circuit) and set(self._edges) == set(other._edges)

    def __hash__(self) -> int:
        return hash(frozenset(self._edges))

    def __repr__(self) -> str:
        shown = ", ".join(repr(e) for e in list(self._edges)[:3])
        return f"Circuit({len(self)} edges: [{shown}{', ...' if len(self) > 3 else ''}])"

    def union(self, other: Circuit) -> Circuit:
        """The edges of either circuit (this one's first)."""
        return Circuit(edges=[*self, *other])

    def intersection(self, other: Circuit) -> Circuit:
        """The edges of both circuits, in this one's order."""
        return Circuit(edges=[e for e in self if e in other])

    __or__ = union
    __and__ = intersection

    @property
    def nodes(self) -> list[str]:
        """The writers and readers the edges join, in order of first appearance."""
        return list(dict.fromkeys(n for edge in self for n in edge))

    def to_json(self) -> str:
        """``{"edges": [[writer, reader], ...]}``."""
        return json.dumps({"edges": [list(e) for e in self]})

    @classmethod
    def from_json(cls, text: str) -> Circuit:
        """The circuit written by :meth:`to_json`."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("edges"), list):
            raise ValueError('a circuit\'s JSON must be {"edges": [[writer, reader], ...]}')
        return cls(edges=[tuple(e) for e in data["edges"]])

    def save(self, path: str | Path) -> None:
        """Write the circuit as JSON."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Circuit:
        """Read a circuit written by :meth:`save`."""
        return cls.from_json(Path(path).read_text())
