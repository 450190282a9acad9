"""``python -m attribution.cli``: the command line of :mod:`attribution.datasets.cli`, kept at its documented path."""

from __future__ import annotations

from .datasets.cli import ImageFolder, blend, build_model, load_checkpoint, main, write_overlays

__all__ = ["ImageFolder", "blend", "build_model", "load_checkpoint", "main", "write_overlays"]

if __name__ == "__main__":
    raise SystemExit(main())
