"""TackleBox's module tracking (``tacklebox.hooks.model_tracking``): buffers of module inputs, outputs and gradients.

:class:`ModuleTracker` registers a forward and a backward hook (inactive) on its modules in a
:class:`~hooks.tacklebox.HookManager` and fills per-module buffers while :meth:`ModuleTracker.track` is entered.
:class:`TrackingProtocol` says which of ``inp``, ``out``, ``inp_grad`` and ``out_grad`` to keep, how often and how
many. The tracker prints the gradient types it sees, as TackleBox 1.0.3 does.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .context import HookContext
from .manager import HookManager

ALL_VARS = ("inp", "out", "inp_grad", "out_grad")
DEFAULT_TRACKING_PROTOCOL: dict[str, Any] = {
    **{f"track_{v}": True for v in ALL_VARS},
    **{f"record_every_{v}": 1 for v in ALL_VARS},
    **{f"buffer_len_{v}": 1 for v in ALL_VARS},
    "save": False,
    "save_protocol": "npz",
    "save_file_base": "",
    **{f"suffix_{v}": v for v in ALL_VARS},
}


def _check_vars(names: Iterable[str]) -> None:
    bad = [v for v in names if v not in ALL_VARS]
    if bad:
        raise ValueError(f"invalid var {bad[0]!r} passed to tracker; use one of {', '.join(ALL_VARS)}")


class TrackingProtocol:
    """Which module variables to track, how often and how many to keep; readable as a dict or by attribute.

    Args:
        *vars_: track only these of ``inp``, ``out``, ``inp_grad``, ``out_grad`` (default: all).
        record_every: record every n-th pass, for every variable.
        buffer_len: how many records to keep, for every variable.
        protocol_json: a JSON file of protocol entries.
        namespace: an ``argparse.Namespace`` whose matching attributes are taken.
        **overwrite_protocol: single entries, e.g. ``record_every_out=2``.
    """

    DEFAULT_PROTOCOL = DEFAULT_TRACKING_PROTOCOL

    def __init__(
        self,
        *vars_: str,
        record_every: int | None = None,
        buffer_len: int | None = None,
        protocol_json: str | None = None,
        namespace: Any = None,
        **overwrite_protocol: Any,
    ) -> None:
        _check_vars(vars_)
        self.__dict__["proto_dict"] = dict(self.DEFAULT_PROTOCOL)
        if vars_:
            for var in ALL_VARS:
                if var not in vars_:
                    self.proto_dict[f"track_{var}"] = False
        for prefix, value in (("record_every", record_every), ("buffer_len", buffer_len)):
            if value:
                for key in self.proto_dict:
                    if key.startswith(prefix):
                        self.proto_dict[key] = value
        if protocol_json:
            with open(protocol_json) as f:
                self.proto_dict.update(json.load(f))
        if namespace is not None:
            self.proto_dict.update({k: v for k, v in vars(namespace).items() if k in self.proto_dict})
        self.overwrite_protocol(**overwrite_protocol)
        self.proto_dict["track_forward"] = True
        self.proto_dict["track_backward"] = bool(self.track_inp_grad or self.track_out_grad)

    def overwrite_protocol(self, **overwrite_protocol: Any) -> None:
        """Set single entries; each must exist."""
        for key, value in overwrite_protocol.items():
            if key not in self.proto_dict:
                raise KeyError(f"cannot overwrite protocol {key!r}: it is not a protocol entry")
            self.proto_dict[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.proto_dict[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.proto_dict[key] = value

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["proto_dict"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        if key in self.proto_dict:
            self.proto_dict[key] = value
        else:
            self.__dict__[key] = value

    def __iter__(self) -> Any:
        return iter(self.proto_dict)

    def keys(self) -> Any:
        """The protocol's entries."""
        return self.proto_dict.keys()

    def values(self) -> Any:
        """The protocol's values."""
        return self.proto_dict.values()

    def items(self) -> Any:
        """The protocol's ``(entry, value)`` pairs."""
        return self.proto_dict.items()


class ModuleTracker:
    """Track module variables over passes, for a group of modules sharing one protocol.

    Args:
        *modules: modules to track, named ``repr(module)``.
        protocol: what to track (default: everything, every pass, buffers of one).
        hook_manager: the :class:`HookManager` to register in (default: a new one).
        network: the whole network, for :meth:`collect_vars` and :meth:`aggregate_vars`.
        **named_modules: modules to track, by name.
    """

    def __init__(
        self,
        *modules: nn.Module,
        protocol: TrackingProtocol | None = None,
        hook_manager: HookManager | None = None,
        network: nn.Module | None = None,
        **named_modules: Any,
    ) -> None:
        self.protocol = protocol if protocol is not None else TrackingProtocol()
        self.network = network
        self.hook_manager = hook_manager if hook_manager is not None else HookManager()
        self.modules: dict[str, Any] = dict(named_modules)
        for m in modules:
            self.modules[repr(m)] = m
        self.module_names = list(self.modules)
        self.pass_count = 0
        self.modules_passed = dict.fromkeys(self.module_names, False)
        self.register_all()
        self.data_buffer: dict[str, dict[str, list[torch.Tensor]]] = {
            name: {var: [] for var in ALL_VARS if self.protocol[f"track_{var}"]} for name in self.module_names
        }
        for module in self.modules.values():
            module.__dict__["tracker"] = self

    # -- pass bookkeeping --------------------------------------------------------------------------------------
    def _complete_module_pass(self, module_name: str) -> None:
        if self.modules_passed[module_name]:
            raise RuntimeError("some modules are not being tracked; check usage")
        self.modules_passed[module_name] = True
        if all(self.modules_passed.values()):
            self.pass_count += 1
            self.modules_passed = dict.fromkeys(self.module_names, False)

    def _cleanup_tracking(self) -> None:
        self.pass_count = 0
        self.modules_passed = dict.fromkeys(self.module_names, False)

    def _insert(self, module_name: str, var: str, data: torch.Tensor) -> None:
        buffer = self.data_buffer[module_name][var]
        max_len = self.protocol[f"buffer_len_{var}"]
        if len(buffer) >= max_len:
            warnings.warn(
                f"Cached {var} data for module {module_name} exceeded buffer length of {max_len}. "
                "Discarding earliest cached data.",
                stacklevel=3,
            )
            del buffer[: len(buffer) - max_len + 1]
        buffer.append(data)

    def _collects(self, var: str) -> bool:
        return bool(self.protocol[f"track_{var}"]) and self.pass_count % self.protocol[f"record_every_{var}"] == 0

    # -- hooks -------------------------------------------------------------------------------------------------
    def forward_hook(self, module: nn.Module, inputs: tuple[Any, ...], outputs: tuple[Any, ...]) -> None:
        """Record the first input and output (copies on the CPU)."""
        inp, *_ = inputs
        out, *_ = outputs
        if self._collects("inp"):
            self._insert(module.name, "inp", inp.detach().cpu().clone())  # type: ignore[arg-type]
        if self._collects("out"):
            self._insert(module.name, "out", out.detach().cpu().clone())  # type: ignore[arg-type]
        if not self.protocol.track_backward:
            self._complete_module_pass(module.name)  # type: ignore[arg-type]

    def backward_hook(self, module: nn.Module, grad_in: list[Any], grad_out: list[Any]) -> None:
        """Record the first input and output gradients (printing their types, as TackleBox does)."""
        print("in grads: ", [type(grad) for grad in grad_in])
        print("out grads: ", [type(grad) for grad in grad_out])
        first_in, *_ = grad_in
        first_out, *_ = grad_out
        if self._collects("inp_grad") and first_in is not None:
            self._insert(module.name, "inp_grad", first_in.cpu())  # type: ignore[arg-type]
        if self._collects("out_grad") and first_out is not None:
            self._insert(module.name, "out_grad", first_out.cpu())  # type: ignore[arg-type]
        self._complete_module_pass(module.name)  # type: ignore[arg-type]

    def register_forward(self) -> None:
        """Register the (inactive) forward hook on every tracked module."""
        self.hook_manager.register_forward_hook(
            self.forward_hook, hook_fn_name="ModuleTracker.forward_hook", activate=False, **self.modules
        )

    def register_backward(self) -> None:
        """Register the (inactive) backward hook on every tracked module."""
        self.hook_manager.register_backward_hook(
            self.backward_hook, hook_fn_name="ModuleTracker.backward_hook", activate=False, **self.modules
        )

    def register_all(self) -> None:
        """Register the hooks the protocol needs."""
        if self.protocol.track_forward:
            self.register_forward()
        if self.protocol.track_backward:
            self.register_backward()

    # -- buffers -----------------------------------------------------------------------------------------------
    def clear_data_buffer_module(self, *module_names: str, vars_: list[str] | None = None) -> None:
        """Empty the buffers of some modules (all their variables, or ``vars_``)."""
        _check_vars(vars_ or ())
        for name in module_names:
            for var in vars_ or list(self.data_buffer[name]):
                self.data_buffer[name][var] = []

    def clear_data_buffer_all(self, vars_: list[str] | None = None) -> None:
        """Empty every buffer."""
        self.clear_data_buffer_module(*self.module_names, vars_=vars_)

    def gather_module_var(self, module_name: str, var: str) -> torch.Tensor:
        """One module's records of one variable, concatenated along axis 0."""
        _check_vars([var])
        return torch.cat(self.data_buffer[module_name][var], dim=0)

    def gather_module(self, module_name: str) -> dict[str, torch.Tensor]:
        """One module's records, per variable."""
        return {
            var: torch.cat(data, dim=0) if data else torch.FloatTensor()
            for var, data in self.data_buffer[module_name].items()
        }

    def gather_var(self, var_name: str) -> dict[str, torch.Tensor]:
        """One variable's records, per module."""
        return {name: torch.cat(self.data_buffer[name][var_name], dim=0) for name in self.data_buffer}

    def gather(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every record, per module and variable."""
        return {name: self.gather_module(name) for name in self.data_buffer}

    # -- running -----------------------------------------------------------------------------------------------
    def track(self, clear_on_exit: bool = True) -> HookContext:
        """A context in which the tracker's hooks are active; the buffers are emptied on exit unless told not to."""
        exit_fns = [self._cleanup_tracking] + ([self.clear_data_buffer_all] if clear_on_exit else [])
        return self.hook_manager.hook_all_context(
            hook_types=[self.forward_hook, self.backward_hook], add_exit_fns=exit_fns
        )

    def collect_vars(self, dataloader: Iterable[Any], network: nn.Module | None = None, device: Any = None) -> None:
        """Run ``network`` over batches ``(index, x, y)`` (with a cross-entropy backward when gradients are tracked).

        ``device``: where the batches go (default: where the network's parameters are; TackleBox's default is
        CUDA device 0).
        """
        network = network if network is not None else self.network
        if network is None:
            raise ValueError("network must be passed to collect_vars if one was not passed to ModuleTracker")
        if device is None:
            device = next((p.device for p in network.parameters()), torch.device("cpu"))
        loss = torch.nn.CrossEntropyLoss() if self.protocol.track_backward else None
        with self.track(clear_on_exit=False), torch.set_grad_enabled(loss is not None):
            for _, x, y in dataloader:
                out = network(x.to(device))
                if loss is not None:
                    loss(out, y.to(device)).backward()
                    network.zero_grad()

    def aggregate_vars(
        self, dataloader: Iterable[Any], network: nn.Module | None = None, device: Any = None, clear: bool = True
    ) -> dict[str, dict[str, torch.Tensor]]:
        """:meth:`collect_vars`, then :meth:`gather` (and empty the buffers unless ``clear=False``)."""
        self.collect_vars(dataloader, network=network, device=device)
        gathered = self.gather()
        if clear:
            self.clear_data_buffer_all()
        return gathered
