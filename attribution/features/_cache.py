"""The sites' activations of the first pass, kept on disk for the second: ``feature_statistics(..., cache=folder)``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .report import read_verified, write_verified

Sites = dict[tuple[str, str], torch.Tensor]


def _ids_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


class SiteCache:
    """One file per batch in ``folder``: the tensors the sites gave, tagged with the run's settings and the batch's ids.

    A file is used only when its tag and ids match (so another run's files, or another data's, are never mixed in) and
    its digest verifies; otherwise the batch is run again. The files this run read are removed at the end.
    """

    def __init__(self, folder: str | Path, settings: dict[str, Any], rank: int) -> None:
        self.folder = Path(folder)
        self.tag = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.rank = rank
        self.used: list[Path] = []

    def _path(self, index: int) -> Path:
        return self.folder / f"sites-{self.tag}-{index:08d}.pt"

    def write(self, index: int, ids: torch.Tensor, sites: Sites) -> None:
        """Keep one batch's site tensors (atomically)."""
        tensors = {f"{module}\n{side}": x.detach().cpu().contiguous() for (module, side), x in sites.items()}
        write_verified(self._path(index), {"tag": self.tag, "ids": _ids_digest(ids), "sites": tensors})

    def read(self, index: int, ids: torch.Tensor) -> Sites | None:
        """One batch's site tensors, or ``None`` where there is no matching, intact file."""
        path = self._path(index)
        if not path.is_file():
            return None
        try:
            state = read_verified(path)
        except (ValueError, OSError, RuntimeError):
            return None
        if state.get("tag") != self.tag or state.get("ids") != _ids_digest(ids):
            return None
        self.used.append(path)
        sites: Sites = {}
        for key, x in state["sites"].items():
            module, side = key.split("\n", 1)
            sites[(module, side)] = x
        return sites

    def clear(self) -> None:
        """Remove the files this run read."""
        for path in self.used:
            path.unlink(missing_ok=True)
        self.used.clear()
