"""A CAM over a folder of images from the command line: maps on disk and overlay PNGs; runs under ``torchrun``.

One process (``...`` for any further options)::

    python -m attribution.cli IMAGES OUT --model resnet50 --layer layer4 --checkpoint weights.pt

Four processes on this machine (each takes its share; the results are the same)::

    torchrun --standalone --nproc_per_node=4 -m attribution.cli IMAGES OUT --model resnet50 --layer layer4 ...

``OUT`` receives the results of :func:`attribution.attribute_dataset` (read them with
:func:`attribution.open_results`), ``files.json`` (the image of each dataset index), ``summary.csv`` (target, top
class and its probability per image) and ``overlays/``: each image with its map, at the model's input size. An
interrupted run started again with the same arguments resumes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from .. import _distributed, _maps
from .._progress import progress as progress_bar
from .._run import warn
from ..cam import EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from . import _shipped
from ._lock import InUseError
from ._shards import META, SETTINGS, SHARDS, Results
from .runner import attribute_dataset

METHODS: dict[str, type[GradCAM] | type[Any]] = {
    "gradcam": GradCAM,
    "gradcam++": GradCAMPlusPlus,
    "xgradcam": XGradCAM,
    "hirescam": HiResCAM,
    "layercam": LayerCAM,
    "scorecam": ScoreCAM,
    "eigencam": EigenCAM,
}
EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"})
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageFolder(Dataset[torch.Tensor]):
    """Every image file under ``root`` (any depth), sorted by relative path; items are preprocessed tensors.

    Preprocessing, as for ImageNet models: resize the shorter side to ``size / crop`` (bicubic, antialiased, as
    timm's and TensorFlow's ImageNet evaluation and the examples do), centre-crop ``size``, scale to [0, 1],
    normalise with ``mean`` and ``std``. Files are read by ``read_rgb``; one that cannot be read is skipped
    with a warning naming it: its item is all NaN, so the run records it in ``results.failures``.
    """

    def __init__(self, root: Path, *, size: int, crop: float, mean: Sequence[float], std: Sequence[float]) -> None:
        from torchvision import transforms

        if not root.is_dir():
            raise FileNotFoundError(f"`images` {str(root)!r} is not a directory")
        self.root = root
        self.size = size
        self.files = sorted(
            p.relative_to(root) for p in root.rglob("*") if p.suffix.lower() in EXTENSIONS and p.is_file()
        )
        if not self.files:
            raise FileNotFoundError(f"no image under {root} (looked for {', '.join(sorted(EXTENSIONS))})")
        self.transform = transforms.Compose(
            [
                transforms.Resize(round(size / crop), interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize(mean, std),
            ]
        )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        """The preprocessed image; all NaN (a failure the run records) if the file cannot be read, with a warning."""
        path = self.root / self.files[index]
        try:
            image = read_rgb(path)
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
            warn(f"skipped {str(path)!r}, which cannot be read as an image ({type(exc).__name__}: {exc})")
            return torch.full((3, self.size, self.size), float("nan"))
        tensor: torch.Tensor = self.transform(image)
        return tensor


def read_rgb(path: Path) -> Any:
    """An image file as an 8-bit RGB PIL image, read as it is meant to be seen.

    EXIF orientation applied; 16-bit greyscale scaled to 8 bits (not clipped); palette and greyscale converted;
    transparency composited over white.

    Example:
        >>> import tempfile, numpy as np
        >>> from pathlib import Path
        >>> from PIL import Image
        >>> path = Path(tempfile.mkdtemp()) / "deep.png"
        >>> Image.fromarray(np.array([[0, 32896, 65535]], dtype=np.uint16)).save(path)
        >>> np.asarray(read_rgb(path))[0, :, 0].tolist()
        [0, 128, 255]
    """
    from PIL import Image, ImageOps

    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)
        image.load()
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 16-bit (or 32-bit) greyscale
        peak = 65535.0 if image.mode.startswith("I;16") or np.asarray(image).max() <= 65535 else 2.0**31 - 1
        grey = np.asarray(image, dtype=np.float64) / peak
        image = Image.fromarray(np.round(np.clip(grey, 0, 1) * 255).astype(np.uint8), mode="L")
    if image.mode == "P" or image.mode in ("LA", "PA", "La"):
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image)
    return image.convert("RGB")


def build_model(name: str, *, checkpoint: Path | None, pretrained: bool, num_classes: int | None) -> nn.Module:
    """A torchvision or timm (``timm:NAME``) model in eval mode, with the checkpoint's or the default weights."""
    import torchvision

    prefix, _, rest = name.partition(":")
    library, arch = (prefix, rest) if prefix in ("torchvision", "timm") else ("", name)
    options: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    if library == "torchvision" and arch not in torchvision.models.list_models():
        raise SystemExit(f"error: --model {name!r} is not a torchvision model; see torchvision.models.list_models()")
    if library != "timm" and arch in torchvision.models.list_models():
        weights = "DEFAULT" if pretrained else None
        try:
            model = torchvision.models.get_model(arch, weights=weights, **options)
        except Exception as exc:
            if not pretrained:
                raise
            raise SystemExit(_no_default_weights(name, exc)) from None
    else:
        try:
            import timm
        except ImportError:
            raise SystemExit(
                f"error: --model {name!r} is not a torchvision model and timm is not installed (pip install timm)"
            ) from None
        if not timm.is_model(arch):
            raise SystemExit(
                f"error: --model {name!r} is neither a torchvision nor a timm model; see "
                "torchvision.models.list_models() and timm.list_models()"
            )
        try:
            model = timm.create_model(arch, pretrained=pretrained, **options)
        except Exception as exc:
            if not pretrained:
                raise
            raise SystemExit(_no_default_weights(name, exc)) from None
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval()


def _no_default_weights(name: str, exc: Exception) -> str:
    return (
        f"error: the default weights of {name!r} could not be loaded ({type(exc).__name__}: {exc}). They are read "
        "from the torch hub / Hugging Face cache, and downloaded only where the machine may; pass --checkpoint PATH "
        "with a state dict instead"
    )


def load_checkpoint(model: nn.Module, path: Path) -> None:
    """Load a state dict (or a dict holding one under ``state_dict``/``model``; DDP's ``module.`` prefix dropped)."""
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SystemExit(f"error: --checkpoint {str(path)!r} does not exist") from None
    except Exception as exc:
        raise SystemExit(
            f"error: --checkpoint {str(path)!r} could not be read as a state dict ({exc}); save it with "
            "torch.save(model.state_dict(), path)"
        ) from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SystemExit(f"error: --checkpoint {str(path)!r} holds no state dict (a dict of tensors)")
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    hint = "another architecture, or another number of classes (--num-classes)?"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that differ
        mismatches = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        raise SystemExit(
            f"error: --checkpoint {str(path)!r} does not fit {type(model).__name__}: {'; '.join(mismatches[:3])} "
            f"({hint})"
        ) from None
    if result.missing_keys or result.unexpected_keys:
        raise SystemExit(
            f"error: --checkpoint {str(path)!r} does not fit {type(model).__name__}: missing "
            f"{_few(result.missing_keys)}, unexpected {_few(result.unexpected_keys)} ({hint})"
        )


def _few(keys: Sequence[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "") if keys else "none"


def blend(rgb: np.ndarray, saliency: torch.Tensor, *, cmap: str = "jet", alpha: float = 0.5) -> np.ndarray:
    """``rgb`` ``(H, W, 3)`` in [0, 1] with ``saliency`` coloured over it (0 to its maximum), as ``uint8``."""
    import matplotlib

    heat = _maps.map_array(saliency, rgb.shape[:2])
    heat = np.clip(heat / max(float(heat.max()), 1e-12), 0, 1)
    colours = matplotlib.colormaps[cmap](heat)[..., :3]
    mixed = (1 - alpha) * rgb + alpha * colours
    return np.asarray(np.round(mixed * 255), dtype=np.uint8)


def write_overlays(
    results: Results,
    images: ImageFolder,
    folder: Path,
    *,
    mean: Sequence[float],
    std: Sequence[float],
    cmap: str,
    alpha: float,
    progress: bool,
) -> int:
    """Write this process's share of the overlay PNGs (those not written yet); returns how many it wrote."""
    from PIL import Image

    rank, world = _distributed.setup()
    names = _overlay_names(images.files)
    written = 0
    mine = _distributed.share(len(results), rank, world)
    for i in progress_bar(mine, desc="overlays", enabled=progress and rank == 0, leave=True, dynamic_ncols=True):
        path = folder / names[i]
        if path.exists() or i in results.failures:  # an unreadable image has no overlay
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = blend(_maps.to_rgb(images[i], mean, std), results.maps[i], cmap=cmap, alpha=alpha)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        Image.fromarray(pixels).save(tmp, format="PNG")
        os.replace(tmp, path)
        written += 1
    return written


def _overlay_names(files: Sequence[Path]) -> list[Path]:
    """``a/b.jpg`` -> ``a/b.png``, or ``a/b.jpg.png`` for all when two images differ only in their extension."""
    names = [f.with_suffix(".png") for f in files]
    if len(set(names)) < len(names):
        names = [f.with_name(f"{f.name}.png") for f in files]
    return names


def _parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    p = argparse.ArgumentParser(
        prog="hookscope-cam",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Also python -m attribution.cli. Under torchrun: torchrun --standalone --nproc_per_node=N -m "
        "attribution.cli IMAGES OUT ...",
    )
    p.add_argument("images", type=Path, help="folder of images (searched recursively)")
    p.add_argument("out", type=Path, help="output folder (results, files.json, summary.csv, overlays/)")
    p.add_argument(
        "--model",
        required=True,
        help="torchvision model name (resnet50), timm:NAME, or efficientnet_lite0 (the shipped ImageNet weights, "
        "offline, with their normalisation; layer e.g. conv_head)",
    )
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", type=Path, help="state dict to load (torch.save(model.state_dict(), ...))")
    weights.add_argument("--pretrained", action="store_true", help="the library's default weights, from its cache")
    p.add_argument("--num-classes", type=int, help="classes of the checkpoint's head (default: the library's)")
    p.add_argument("--layer", required=True, help="layer to explain, e.g. layer4 (see hooks.module_names(model))")
    p.add_argument("--method", choices=sorted(METHODS), default="gradcam", help="default: gradcam")
    p.add_argument("--target", type=int, help="class to explain for every image (default: each image's top class)")
    p.add_argument("--batch-size", type=int, default=32, help="default: 32")
    p.add_argument("--size", type=int, default=224, help="input side after the centre crop (default: 224)")
    p.add_argument(
        "--crop",
        type=float,
        default=0.875,
        help="crop fraction: the shorter side is resized (bicubic) to size/crop (default: 0.875)",
    )
    p.add_argument("--mean", type=float, nargs=3, help="normalisation mean (ImageNet's; 0.5 for efficientnet_lite0)")
    p.add_argument("--std", type=float, nargs=3, help="normalisation std (ImageNet's; 0.5 for efficientnet_lite0)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="map storage (float16)")
    p.add_argument("--topk", type=int, default=5, help="top classes stored per image (default: 5)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per process (default: 0)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: this process's GPU if any, else cpu)")
    p.add_argument("--no-overlays", action="store_true", help="write the maps only")
    p.add_argument("--cmap", default="jet", help="matplotlib colour map of the overlays (default: jet)")
    p.add_argument("--alpha", type=float, default=0.5, help="opacity of the map in the overlays (default: 0.5)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--overwrite", action="store_true", help="delete the results already in OUT and start over")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``hookscope-cam --help``); returns the exit status.

    A user error (a wrong layer, target, model or folder; an ``OUT`` of other settings or in use) is one ``error:``
    line on stderr and exit status 2; Ctrl-C says how far the run got and exits with 130, ``SIGTERM`` with 143
    (the shard being written is removed first: a scheduler's kill leaves no temporary files).
    """
    args = _parser().parse_args(argv)
    try:
        with _terminate_as_exception():
            return _run(args)
    except (KeyboardInterrupt, _Terminated) as exc:
        verb, status = ("terminated", 143) if isinstance(exc, _Terminated) else ("interrupted", 130)
        print(f"{verb} after {_done(args.out)}; run the same command again to resume", file=sys.stderr)
        return status
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(_one_line(exc.code.removeprefix("error: ")), file=sys.stderr)
        return 2
    except _USER_ERRORS as exc:
        print(_one_line(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)), file=sys.stderr)
        return 2


_USER_ERRORS = (ValueError, KeyError, IndexError, TypeError, FileNotFoundError, PermissionError, InUseError)


class _Terminated(Exception):
    """``SIGTERM`` arrived (raised in the main thread, so that the run cleans up as after Ctrl-C)."""


@contextmanager
def _terminate_as_exception() -> Iterator[None]:
    """While the body runs, ``SIGTERM`` raises :class:`_Terminated` (in the main thread only; else nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _one_line(message: str) -> str:
    return "error: " + " ".join(message.split())


def _done(out: Path) -> str:
    """``N of M items`` stored in ``out`` (complete shards), as far as its files tell."""
    try:
        items = json.loads((out / SETTINGS).read_text())["items"]
    except (OSError, ValueError, KeyError):
        return "0 items"
    done = 0
    for meta in (out / SHARDS).glob(f"*/{META}"):
        try:
            done += int(json.loads(meta.read_text())["rows"])
        except (OSError, ValueError, KeyError):
            pass
    return f"{done} of {items} items"


def _warn_random(model: str) -> None:
    print(
        f"warning: --model {model} has RANDOM weights (no --checkpoint or --pretrained): its maps, classes and "
        "summary.csv explain an untrained network. Fine to test a pipeline; pass --checkpoint PATH or --pretrained "
        "for real explanations",
        file=sys.stderr,
    )


def _run(args: argparse.Namespace) -> int:
    """The command line's work, once its arguments are parsed."""
    rank, world = _distributed.setup()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shipped = args.model == _shipped.NAME
    mean = args.mean or (_shipped.MEAN if shipped else IMAGENET_MEAN)
    std = args.std or (_shipped.STD if shipped else IMAGENET_STD)
    try:
        images = ImageFolder(args.images, size=args.size, crop=args.crop, mean=mean, std=std)
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.checkpoint is None and not args.pretrained and not shipped and rank == 0:
        _warn_random(args.model)
    if shipped:
        try:
            model = _shipped.load_efficientnet_lite0()
        except ImportError as exc:
            raise SystemExit(f"error: --model {_shipped.NAME}: {exc}") from None
        if args.checkpoint is not None:
            load_checkpoint(model, args.checkpoint)
    else:
        model = build_model(
            args.model, checkpoint=args.checkpoint, pretrained=args.pretrained, num_classes=args.num_classes
        )
    model = model.to(device)
    options: dict[str, Any] = {"progress": False} if args.method == "scorecam" else {}
    method = METHODS[args.method](model, args.layer, **options)
    loader = torch.utils.data.DataLoader(images, batch_size=args.batch_size, num_workers=args.workers)
    results = attribute_dataset(
        method,
        loader,
        args.out,
        target=args.target,
        dtype=args.dtype,
        topk=args.topk,
        device=device,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    if rank == 0:
        _write_text(args.out / "files.json", json.dumps([f.as_posix() for f in images.files]))
        _write_summary(results, images, args.out / "summary.csv")
    if not args.no_overlays:
        write_overlays(
            results,
            images,
            args.out / "overlays",
            mean=mean,
            std=std,
            cmap=args.cmap,
            alpha=args.alpha,
            progress=not args.quiet,
        )
    _distributed.barrier()
    if rank == 0 and not args.quiet:
        print(f"{len(results)} maps in {args.out} ({world} process{'es' if world > 1 else ''})", file=sys.stderr)
    return 0


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8", errors="surrogateescape", newline="")
    os.replace(tmp, path)


def _write_summary(results: Results, images: ImageFolder, path: Path) -> None:
    """``summary.csv``: index, file, target, top class and its probability (when stored)."""
    top = "classes" in results.fields
    buffer = io.StringIO()
    rows = csv.writer(buffer)
    failed = results.failures
    rows.writerow(
        ["index", "file", "target", *(["top_class", "top_prob"] if top else []), *(["failure"] * bool(failed))]
    )
    targets = results.targets[:].tolist()
    classes = results.classes[:][:, 0].tolist() if top else []
    probs = results.probs[:][:, 0].tolist() if top else []
    for i, file in enumerate(images.files):
        extra = [classes[i], f"{probs[i]:.6f}"] if top else []
        rows.writerow([i, file.as_posix(), targets[i], *extra, *([failed.get(i, "")] if failed else [])])
    _write_text(path, buffer.getvalue())


__all__ = ["ImageFolder", "blend", "build_model", "load_checkpoint", "main", "write_overlays"]

if __name__ == "__main__":
    raise SystemExit(main())
