"""The model randomisation test (Adebayo et al., 2018): a map that does not change with the weights explains nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks import resolve

from .._inputs import batched
from .._maps import minmax, spearman, unfinite_items
from .._progress import progress as progress_bar
from .._run import warn
from ._perturb import derived_seed
from ._scoring import Target, top_classes
from ._similarity import constant_items, ssim

Method = Callable[[nn.Module, Any, Target], torch.Tensor]
MODES = ("cascading", "independent")


@dataclass(frozen=True)
class RandomizationResult:
    """Maps of progressively randomised copies of a model, and how much they still resemble the original maps.

    Attributes:
        mode: ``"cascading"`` (stage ``s`` has the layers of stages ``0..s`` randomised) or ``"independent"``
            (stage ``s`` has only its own layer randomised).
        stages: the layer randomised at each stage, from the output towards the input.
        original: ``(B, H, W)`` the maps of the model as it is.
        maps: ``(S, B, H, W)`` the maps at each stage.
        spearman: ``(S, B)`` Spearman rank correlation of each stage's map with the original (1: same order of
            pixels; near 0: unrelated). NaN where a map is constant.
        ssim: ``(S, B)`` structural similarity of the min-max scaled maps (1: identical).
    """

    mode: str
    stages: list[str]
    original: torch.Tensor
    maps: torch.Tensor
    spearman: torch.Tensor
    ssim: torch.Tensor


def randomization_test(
    method: Method,
    model: nn.Module,
    inputs: Any,
    target: Target = None,
    *,
    mode: str = "cascading",
    layers: str | nn.Module | type | Sequence[Any] | None = None,
    seed: int = 0,
    progress: bool = False,
) -> RandomizationResult:
    """Model parameter randomisation test (Adebayo et al., *Sanity Checks for Saliency Maps*, NeurIPS 2018).

    The maps of ``method`` on the model are compared with its maps on copies of the model whose weights are
    re-initialised layer by layer, from the output down to the input: all layers up to the current one
    (``"cascading"``) or only the current one (``"independent"``). Re-initialising means what constructing the layer
    did: each submodule's own ``reset_parameters()`` (batch norm also forgets its running statistics); parameters of
    modules without one are redrawn from a normal distribution with their own mean and standard deviation. A method
    whose maps survive randomisation (Spearman and SSIM stay near 1) does not depend on what the model learned.

    The user's model is never modified: the copies are deep copies, and the global random state is left as it was
    (stage ``s`` draws from ``torch.manual_seed(stage_seed(seed, s))`` inside a forked random state, so it gets the
    same weights in both modes; the seeds are hashed so that they do not repeat a seed such as 0 that the model may
    have been built with, which would give back its own initial weights).

    Args:
        method: ``method(model, inputs, target) -> (B, H, W)`` maps, e.g.
            ``lambda m, x, t: GradCAM(m, "layer4")(x, t)``; it must use the model it is given.
        model: the network.
        inputs: what ``method`` takes, in the forms of the CAMs: images ``(B, C, H, W)``, one image ``(C, H, W)``
            (whose ``(H, W)`` maps count as a batch of one), a mapping with ``pixel_values``, a tuple...
        target: as for the CAMs. ``None`` is resolved once to each image's top class on the original model, and
            that class is explained on every randomised copy.
        mode: ``"cascading"`` or ``"independent"``.
        layers: the layers to randomise, one stage each: names, globs, modules, module types or a list of these
            (as ``hooks.resolve`` takes them), ordered from the output to the input whatever the order given.
            Default: every child module that holds parameters, with ``Sequential``/``ModuleList``/``ModuleDict``
            containers opened up (ResNet-50: ``fc``, ``layer4.2`` ... ``layer1.0``, ``bn1``, ``conv1``).
        seed: seed of the re-initialisation.
        progress: show a progress bar on a terminal over the stages.

    Returns:
        :class:`RandomizationResult`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Flatten(),
        ...                             torch.nn.Linear(4 * 16 * 16, 5)).eval()
        >>> def saliency(m, x, t):  # |input gradient| of the class score
        ...     x = x.clone().requires_grad_(True)
        ...     m(x)[torch.arange(len(x)), t].sum().backward()
        ...     return x.grad.abs().sum(dim=1)
        >>> result = randomization_test(saliency, model, torch.randn(2, 3, 16, 16), [0, 1])
        >>> result.stages, tuple(result.spearman.shape)
        (['2', '0'], (2, 2))
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be 'cascading' or 'independent'; got {mode!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}")
    stages = _stages(model, layers)
    single = batched(inputs, model, images=True).single  # one (C, H, W) image: its (H, W) maps are a batch of one
    if target is None:
        target = top_classes(model, inputs)
    kept = [(p, p.grad, p.requires_grad) for p in model.parameters()]
    try:  # a method that calls .backward() must not leave gradients on the user's model
        original = _maps(method, model, inputs, target, None, single)
    finally:
        for p, grad, requires_grad in kept:
            p.grad = grad
            p.requires_grad_(requires_grad)
    maps = []
    randomised = copy.deepcopy(model)
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        for s, name in enumerate(progress_bar(stages, desc="randomisation", enabled=progress)):
            module = randomised.get_submodule(name)
            torch.manual_seed(stage_seed(seed, s))
            _reinitialise(module, name)
            maps.append(_maps(method, randomised, inputs, target, original.shape, single))
            if mode == "independent":
                module.load_state_dict(model.get_submodule(name).state_dict())
    del randomised
    stacked = torch.stack(maps)
    return RandomizationResult(mode, stages, original, stacked, *_compare(original, stacked, stages))


def stage_seed(seed: int, stage: int) -> int:
    """The seed of the re-initialisation at ``stage``: a hash of ``(seed, stage)``, the same in every process."""
    return derived_seed(seed, stage)


def default_layers(model: nn.Module) -> list[str]:
    """The model's layers from the output to the input: children holding parameters, containers opened up."""

    def walk(module: nn.Module, prefix: str) -> Iterator[str]:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                yield from walk(child, full)
            elif any(True for _ in child.parameters()):
                yield full

    return list(walk(model, ""))[::-1]


def _stages(model: nn.Module, layers: str | nn.Module | type | Sequence[Any] | None) -> list[str]:
    if layers is None:
        names = default_layers(model)
        if not names:
            raise ValueError("`model` has no child module with parameters to randomise; pass `layers`")
        return names
    names = [name for name, _ in resolve(model, layers, what="`layers`")][::-1]
    for name in names:
        if not any(True for _ in model.get_submodule(name).parameters()):
            raise ValueError(f"`layers` {name!r} has no parameters to randomise")
    return names


def _reinitialise(module: nn.Module, name: str) -> None:
    """Re-initialise every parameter of ``module`` (in place, on the copy) as its construction did."""
    done: set[int] = set()
    with torch.no_grad():
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
                done.update(id(p) for p in sub.parameters(recurse=False))
        for p in module.parameters():
            if id(p) not in done and p.numel():
                std = float(p.float().std()) if p.numel() > 1 else 0.0
                p.normal_(float(p.float().mean()), std if std > 0 else 1.0)


def _maps(
    method: Method, model: nn.Module, inputs: Any, target: Target, shape: torch.Size | None, single: bool
) -> torch.Tensor:
    maps = method(model, inputs, target)
    if single and isinstance(maps, torch.Tensor) and maps.dim() == 2:
        maps = maps[None]
    if not isinstance(maps, torch.Tensor) or maps.dim() != 3 or (shape is not None and maps.shape != shape):
        got = tuple(maps.shape) if isinstance(maps, torch.Tensor) else type(maps).__name__
        expected = tuple(shape) if shape is not None else "(B, H, W)"
        raise ValueError(f"`method` must return maps of shape {expected}; got {got}")
    return maps.detach()


def _compare(original: torch.Tensor, maps: torch.Tensor, stages: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Spearman ``(S, B)`` and SSIM ``(S, B)`` of every stage's maps against the original ones."""
    if all(torch.equal(m, original) for m in maps):
        warn(
            "the maps did not change at any stage of the randomisation: either they do not depend on these layers "
            "(Eigen-CAM ignores the classifier), or `method` does not use the model it is given",
        )
    rho = torch.stack([spearman(original, m) for m in maps]).float()
    if min(original.shape[-2:]) >= 11:
        scaled = minmax(original.double())
        similarity = torch.stack([ssim(scaled, minmax(m.double())) for m in maps]).float()
    else:
        similarity = torch.full(rho.shape, float("nan"))
        warn(
            f"the maps are {tuple(original.shape[-2:])}, smaller than SSIM's 11x11 window: SSIM is NaN (return "
            "upsampled maps from `method`)",
        )
    unfinite = sorted({i for m in (original, *maps) for i in unfinite_items(m).nonzero().flatten().tolist()})
    if unfinite:
        warn(
            f"the maps of item(s) {unfinite} hold NaN or inf (at the original or some stage): their Spearman "
            "correlations are NaN, not a verdict. Check the inputs and the method's output for those items"
        )
    finite = [i for i in range(rho.shape[1]) if i not in unfinite]
    constant = constant_items(original)
    if constant:
        warn(
            f"the original map of item(s) {constant} is constant (e.g. all zero): its Spearman correlations are NaN",
        )
    elif rho[:, finite].isnan().any():
        where = [stages[s] for s in range(len(maps)) if rho[s, finite].isnan().any()]
        warn(
            f"some maps are constant (e.g. all zero) at stage(s) {where}: their Spearman correlation is NaN",
        )
    return rho, similarity


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
