"""SmoothGrad: any gradient method averaged over noisy copies of the input, with a generator of its own."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._run import warn
from ..targets import Target, check_target
from ._site import layer_outputs, repeat_target, resolved_target


def relative_noise(inputs: torch.Tensor, samples: int, noise: float, generator: torch.Generator) -> torch.Tensor:
    """Gaussian noise ``(batch, samples, ...)`` with standard deviation ``noise * (max - min)`` of each item.

    Drawn as one ``torch.normal`` call over ``(batch * samples, ...)``, item after item (captum's layout and draw).
    """
    batch = inputs.shape[0]
    flat = inputs.detach().reshape(batch, -1)  # 1-D inputs: a batch of scalars, each of range 0
    spread = (flat.amax(1) - flat.amin(1)) * noise
    shape = (batch * samples, *inputs.shape[1:])
    std = spread.repeat_interleave(samples).view(-1, *([1] * (inputs.dim() - 1))).expand(shape).contiguous()
    return torch.normal(0.0, std, generator=generator).view(batch, samples, *inputs.shape[1:])


def _warn_constant(inputs: torch.Tensor) -> None:
    """Warn about items of range 0 (all entries equal, or one number each): noise relative to it is 0."""
    flat = inputs.detach().reshape(len(inputs), -1)
    constant = (flat.amax(1) == flat.amin(1)).nonzero().flatten().tolist()
    if constant:
        items = f"item {constant[0]} is" if len(constant) == 1 else f"items {constant[:8]} are"
        warn(
            f"SmoothGrad: {items} constant (all entries equal; each item of 1-D inputs is one number), so the noise, "
            "relative to an item's range max - min, is 0 there and the result is the method's own. Give items "
            "with more than one value, or call the method alone"
        )


class SmoothGrad:
    """SmoothGrad (Smilkov et al., 2017, https://arxiv.org/abs/1706.03825) around any gradient method.

    ``SG(x) = 1/n sum_i M(x + e_i)``, ``e_i ~ N(0, s^2)``, ``s = noise * (max(x) - min(x))`` per item (the paper's
    relative noise level): the mean of ``method``'s attributions over ``samples`` noisy copies. The same as captum's
    ``NoiseTunnel(method).attribute(x, nt_type="smoothgrad", nt_samples=samples, stdevs=s)``, which takes the
    absolute ``s`` for the whole batch. The noise comes from a generator of its own (the global random state is not
    used): seeded with ``seed`` at each call (the same noise every call), or from fresh entropy when ``seed`` is
    ``None``. An item whose entries are all equal, such as each item of 1-D inputs (a batch of scalars), has range 0
    and so gets no noise (with a warning).

    ``target=None`` is each item's top class on the clean input (one extra forward), used for all its copies; an
    integer or one integer per item is repeated for the copies; a callable target is applied to the outputs of the
    noisy batches (``batch x samples`` rows, item after item), so it must score any batch size.

    Args:
        method: a gradient method (:class:`Saliency`, :class:`IntegratedGradients`, ...), or any callable
            ``(inputs, target=...) -> attributions`` with a ``model`` attribute.
        samples: the number of noisy copies per item.
        noise: the noise's standard deviation relative to each item's range ``max - min``.
        seed: the seed of the noise, or ``None``.
        batch_size: noisy copies per call of ``method`` (``None``: all at once).

    Example:
        >>> import torch
        >>> from attribution import Saliency, SmoothGrad
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
        >>> smooth = SmoothGrad(Saliency(model), samples=8, noise=0.1, seed=0)
        >>> x = torch.randn(2, 3)
        >>> a, b = smooth(x, target=1), smooth(x, target=1)
        >>> a.shape, torch.equal(a, b)
        (torch.Size([2, 3]), True)
    """

    def __init__(
        self,
        method: Callable[..., torch.Tensor],
        samples: int = 50,
        noise: float = 0.15,
        seed: int | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        if not callable(method):
            raise TypeError(f"`method` must be a gradient method such as Saliency(model); got {type(method).__name__}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"`samples` must be an integer of at least 1; got {samples!r}")
        if not noise >= 0:
            raise ValueError(f"`noise` must be a non-negative standard deviation (relative to the range); got {noise}")
        if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError(f"`batch_size` must be None or at least 1; got {batch_size!r}")
        self.method = method
        self.samples = samples
        self.noise = noise
        self.seed = seed
        self.batch_size = batch_size

    def __call__(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """The mean attribution over the noisy copies, shaped like ``method``'s attributions of ``inputs``."""
        if not isinstance(inputs, torch.Tensor) or not inputs.is_floating_point() or inputs.dim() == 0:
            got = f"{inputs.dtype} tensor" if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise TypeError(f"SmoothGrad adds noise to `inputs`: a floating-point tensor (batch, ...); got {got}")
        batch = inputs.shape[0]
        check_target(target, batch)
        if target is None:
            model = getattr(self.method, "model", None)
            if model is None:
                raise TypeError("`target=None` needs the method's `model` to find the top classes: pass a target")
            target = resolved_target(None, layer_outputs(model, "SmoothGrad", inputs, None)[0], batch)
        generator = torch.Generator(device=inputs.device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        if self.noise > 0:
            _warn_constant(inputs)
        noise = relative_noise(inputs, self.samples, self.noise, generator)
        per = self.samples if self.batch_size is None else self.batch_size
        total: torch.Tensor | None = None
        for first in range(0, self.samples, per):
            chunk = noise[:, first : first + per]
            k = chunk.shape[1]
            noisy = (inputs.detach()[:, None] + chunk).flatten(0, 1)  # item after item: (batch * k, ...)
            attributions = self.method(noisy, target=repeat_target(target, k, interleave=True))
            part = attributions.view(batch, k, *attributions.shape[1:]).sum(1)
            total = part if total is None else total + part
        assert total is not None
        return total / self.samples

    def __repr__(self) -> str:
        return f"SmoothGrad({self.method!r}, samples={self.samples}, noise={self.noise}, seed={self.seed})"
