"""Perturbing a module's output (``layer=``): the model runs up to the layer once, later runs replay that part.

The unperturbed run is traced by the kernel's :class:`attribution._replay.CallLog` and records the layer's output,
the activation ``(batch, *item)`` that the perturbations then act on. Every later forward runs on the inputs
repeated ``k`` times (item after item, as the perturbed rows), and the module calls that end by the layer's output
(the layer's own call included) are replayed by :class:`attribution._replay.Replay` from the traced run instead of
running: their recorded tensors whose first axis is the batch are repeated ``k`` times in a row, others copied. The
layer's output is then replaced by the perturbed rows, so only what follows the layer runs per perturbation batch.

Replay is used only where the kernel allows it (no global hooks, no random numbers drawn, no hooks of the user's
on the replayed calls, see ``_replay.py``), and only once a check run of two unperturbed copies per item gave the
unperturbed scores back (to float rounding: a different batch size may sum in another order); else a warning says
why and every forward runs the whole model, with the layer's output replaced all the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from hooks import global_hooks_registered, map_tensors, resolve

from .._replay import CallLog, Plan, Replay, plan_sites
from .._run import HookedRun, SiteTypeError, SiteValueError, did_not_run, hook_site, warn


def repeated(value: Any, batch: int, times: int) -> Any:
    """A fresh copy of a recorded output for ``times`` rows per item: first axes of size ``batch`` repeated in a row.

    Example:
        >>> repeated((torch.tensor([[1, 2], [3, 4]]), torch.tensor([7])), batch=2, times=2)
        (tensor([[1, 2],
                [1, 2],
                [3, 4],
                [3, 4]]), tensor([7]))
    """

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(times, 0) if t.dim() and t.shape[0] == batch else t.clone()

    return map_tensors(one, value)


def close_scores(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether two score tensors agree to the float rounding of another batch size (``sqrt(eps)`` relative)."""
    tolerance = math.sqrt(torch.finfo(expected.dtype).eps) if expected.is_floating_point() else 0.0
    scale = float(expected.abs().nan_to_num(0, 0, 0).max()) if expected.numel() else 0.0
    return bool(torch.allclose(got, expected, rtol=tolerance, atol=tolerance * max(scale, 1e-30), equal_nan=True))


class LayerSite:
    """The output of module ``name``: recorded in the unperturbed run, replaced by the perturbed rows after it.

    Args:
        run: the evaluator's run; the hook at the layer goes into its group.
        name: the layer's qualified name.
        hooked: ids of the modules that carried the user's hooks before ours (never replayed).
        method: the method's name, for errors and warnings.
    """

    def __init__(self, run: HookedRun, name: str, hooked: set[int], method: str) -> None:
        self.run, self.name, self.hooked, self.method = run, name, hooked, method
        self.activation: torch.Tensor | None = None  # (batch, *item): the layer's unperturbed output
        self.rows: torch.Tensor | None = None  # what the layer's output becomes in the forward under way
        self.plan: Plan | None = None
        self.replay: Replay | None = None
        hook_site(run.group, [name], "output", None, self._at_layer)

    def _at_layer(self, output: torch.Tensor, name: str, call: int) -> torch.Tensor | None:
        if call > 0:
            raise SiteValueError(
                f"{self.method}: `layer` {name!r} runs more than once in one forward of the model; its output is "
                "perturbed at one call: choose a module the model calls once"
            )
        if self.rows is None:  # the unperturbed run
            if not output.is_floating_point():
                raise SiteTypeError(
                    f"{self.method}: the output of `layer` {name!r} is {output.dtype}; a perturbed layer must output "
                    "floating-point activations (choose the embedding's output rather than its input ids)"
                )
            self.activation = output.detach().clone()
            return None
        if output.shape != self.rows.shape:
            raise SiteValueError(
                f"{self.method}: the output of `layer` {name!r} has shape {tuple(output.shape)} in a perturbed "
                f"forward, not {tuple(self.rows.shape)} (the inputs repeated {len(self.rows) // len(output)} times "
                "per item): the layer's output must keep the batch axis first"
            )
        return self.rows.to(output.dtype)

    def trace(self, forward: Callable[[Any], Any], inputs: Any, stack: ExitStack) -> Any:
        """The unperturbed run of ``inputs``, traced: which calls to replay later; returns the model's output."""
        log = CallLog(self.run.model, forward, inputs)
        if self.activation is None:
            raise did_not_run("`layer`", self.name)
        time = log.site(self.name, "output")
        if log.calls and time is not None and not log.random and not global_hooks_registered():
            plan = plan_sites(log, [time], self.hooked)[0]
            modules = [c.module for c in log.calls if (id(c.module), c.index) in plan]
            if modules:
                self.plan = plan
                self.replay = stack.enter_context(Replay(self.run.model, modules))
        del log.calls  # only the planned outputs stay alive
        return log.output

    def forward(self, forward: Callable[[Any], Any], inputs: torch.Tensor, rows: torch.Tensor, k: int) -> Any:
        """One forward of ``inputs`` repeated ``k`` times per item, the layer's output replaced by ``rows``."""
        batch = len(inputs)
        self.rows = rows
        if self.replay is not None and self.plan is not None:
            self.replay.use(self.plan, lambda value: repeated(value, batch, k))
        try:
            return forward(inputs.repeat_interleave(k, 0))
        finally:
            self.rows = None
            if self.replay is not None:
                self.replay.use({})

    def stop_replay(self, why: str) -> None:
        """Run the whole model from now on, with a warning that says why."""
        warn(
            f"{self.method}: replaying the model up to `layer` {self.name!r} {why}: a module with state or side "
            "effects, or one that mixes the items of a batch? Every forward runs the whole model instead",
            RuntimeWarning,
        )
        self.plan = None
        self.replay = None  # the Replay stays entered (its modules restored at exit) but chooses nothing


def check_layer(model: nn.Module, layer: str | nn.Module | None, method: str) -> str | None:
    """The qualified name of the one module ``layer`` names, or ``None``."""
    if layer is None:
        return None
    found = resolve(model, layer, what="`layer`")
    if len(found) != 1:
        names = [name for name, _ in found]
        raise ValueError(f"{method}: `layer` must name one module; {layer!r} matched {len(found)}: {names[:6]}")
    return found[0][0]
