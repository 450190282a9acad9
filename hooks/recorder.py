"""Record module inputs, outputs and gradients, keyed by module name and call index.

The torchfunc recorders' features (condition, reduction, sample counts, save) on top of :class:`HookManager`:
records are detached copies (an in-place operation later cannot change them), optionally moved to a device,
and a module called several times in one forward gets one record per call. Calls that gradient checkpointing runs
again during the backward pass are not recorded again; their gradients are recorded under the call they replay.
"""

from __future__ import annotations

import inspect
import itertools
import json
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from . import _tree
from ._errors import HookError
from ._resolve import ModuleTarget
from ._runs import in_backward
from .manager import HookManager, Threads

Field = Literal["input", "output", "grad_input", "grad_output"]
FIELDS: tuple[str, ...] = ("input", "output", "grad_input", "grad_output")
Reduction = Literal["last", "list", "sum", "mean", "max", "min"] | Callable[[Any, Any], Any]
_BUILTIN_REDUCTIONS = ("last", "list", "sum", "mean", "max", "min")
_FORMAT = "hookscope-recording-1"


@dataclass
class Record:
    """What was recorded for one call of one module (``call`` counts the module's calls within one forward).

    Attributes:
        name: qualified module name.
        call: index of the call within one forward of the model (0 for the first call).
        input: the positional argument (or a tuple of them, plus a dict of keyword arguments if any).
        output: the module's output (tensor, or the tuple/dict it returned).
        grad_input: gradient of each input tensor, through this call (a tensor, or a tuple for several inputs).
        grad_output: gradient of each output tensor (a tensor, or a tuple for several outputs).
        samples: how many forward calls were recorded (after ``condition``).
        grad_samples: how many backward calls were recorded.
    """

    name: str
    call: int
    input: Any = None
    output: Any = None
    grad_input: Any = None
    grad_output: Any = None
    samples: int = 0
    grad_samples: int = 0
    _counts: dict[str, int] = field(default_factory=dict, repr=False, compare=False)


class Recording(Mapping[tuple[str, int], Record]):
    """A read-only mapping ``(name, call) -> Record``; ``recording[name]`` works for modules called once.

    Example:
        >>> import torch
        >>> from hooks import Recorder
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(inplace=True))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.eye(3))
        >>> with Recorder(model, "0") as rec:
        ...     y = model(torch.tensor([[1.0, -2.0, 3.0]]) - model[0].bias)
        >>> bool((rec["0"].output >= 0).all())  # recorded before the in-place ReLU ran
        False
        >>> rec["0"].samples, list(rec)
        (1, [('0', 0)])
    """

    def __init__(self, records: Iterable[Record] = ()) -> None:
        self._records: dict[tuple[str, int], Record] = {(r.name, r.call): r for r in records}

    def _key(self, key: str | tuple[str, int]) -> tuple[str, int]:
        if isinstance(key, tuple):
            return key
        calls = self.calls(key)
        if len(calls) == 1:
            return (key, calls[0])
        if not calls:
            names = sorted({n for n, _ in self._records})
            raise KeyError(f"nothing was recorded for {key!r}; recorded modules: {names}")
        raise KeyError(f"{key!r} was called {len(calls)} times per forward; ask for rec[{key!r}, i] with i in {calls}")

    def __getitem__(self, key: str | tuple[str, int]) -> Record:
        k = self._key(key)
        if k not in self._records:
            raise KeyError(f"nothing was recorded for module {k[0]!r}, call {k[1]}; recorded: {list(self._records)}")
        return self._records[k]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            return any(n == key for n, _ in self._records)
        return key in self._records

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(list(self._records))

    def __len__(self) -> int:
        return len(self._records)

    def calls(self, name: str) -> list[int]:
        """The call indices recorded for module ``name``."""
        return sorted(c for n, c in self._records if n == name)

    @property
    def names(self) -> list[str]:
        """The recorded module names, in the order they were first recorded."""
        return list(dict.fromkeys(n for n, _ in self._records))

    def samples(self, name: str, call: int = 0) -> int:
        """How many forward calls of ``(name, call)`` were recorded (torchfunc's ``samples``)."""
        return self[name, call].samples

    def save(self, folder: str | Path) -> Path:
        """Write every record to ``folder`` (created if needed): ``index.json`` and one ``.pt`` file per record."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        index = []
        for i, record in enumerate(self._records.values()):
            filename = f"record_{i:05d}.pt"
            torch.save({f: getattr(record, f) for f in FIELDS}, folder / filename)
            index.append(
                {
                    "file": filename,
                    "name": record.name,
                    "call": record.call,
                    "samples": record.samples,
                    "grad_samples": record.grad_samples,
                }
            )
        (folder / "index.json").write_text(json.dumps({"format": _FORMAT, "records": index}, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Recording:
        """Read a recording written by :meth:`save` (tensors are loaded with ``weights_only=True``)."""
        folder = Path(folder)
        index_file = folder / "index.json"
        if not index_file.is_file():
            raise FileNotFoundError(
                f"{folder} holds no recording: {index_file.name} is missing (write one with .save())"
            )
        meta = json.loads(index_file.read_text())
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{index_file} has format {meta.get('format')!r}; this version reads {_FORMAT!r}")
        records = []
        for entry in meta["records"]:
            values = torch.load(folder / entry["file"], weights_only=True)
            records.append(
                Record(
                    entry["name"], entry["call"], samples=entry["samples"], grad_samples=entry["grad_samples"], **values
                )
            )
        return cls(records)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {len(self)} record(s): {self.names}>"


def _one_target(target: ModuleTarget | None, targets: ModuleTarget | None) -> ModuleTarget:
    """The modules of a :class:`Recorder`: ``target``, or the deprecated ``targets=`` (warned); exactly one of them."""
    if targets is None:
        if target is None:
            raise TypeError("Recorder needs `target`: the modules to record (names, globs, modules or types)")
        return target
    if target is not None:
        raise TypeError("give the modules once, as `target` (`targets` is its deprecated name)")
    warnings.warn(
        "Recorder's `targets=` is deprecated: pass `target=` (or the modules positionally)",
        DeprecationWarning,
        stacklevel=3,
    )
    return targets


class Recorder(Recording):
    """Record inputs, outputs and gradients of chosen modules while it is open.

    The hooks are registered on construction and removed by :meth:`remove` or at the end of a ``with`` block;
    what was recorded stays readable afterwards.

    Args:
        model: the model.
        target: the modules: names, globs, modules or types, or a list of them (a :data:`ModuleTarget`, as for
            :meth:`HookGroup.forward`).
        targets: the earlier name of ``target``; still accepted, with a ``DeprecationWarning``.
        capture: any of ``"input"``, ``"output"``, ``"grad_input"``, ``"grad_output"``.
        reduction: how a new sample combines with what is stored: ``"last"`` (keep the latest), ``"list"``
            (keep all, in order), ``"sum"``, ``"mean"`` (running mean), ``"max"``, ``"min"`` (elementwise), or a
            callable ``(stored, new) -> stored`` as in torchfunc.
        condition: a callable with no arguments; a sample is recorded only when it returns True.
        device: where recorded tensors are moved (default: where they are).
        manager: a :class:`HookManager` of ``model`` to register in (default: a private one).
        threads: ``"all"`` records forwards run by any thread (a thread pool, a web handler); by default only
            the forwards of the thread that created the recorder are recorded (see :meth:`HookManager.group`).

    Example:
        >>> import torch
        >>> from hooks import Recorder
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())
        >>> with Recorder(model, ["0", "1"], capture=("output", "grad_output"), reduction="sum") as rec:
        ...     for _ in range(3):
        ...         model(torch.randn(4, 3)).sum().backward()
        >>> rec["1"].samples, rec["1"].grad_samples, tuple(rec["1"].grad_output.shape)
        (3, 3, (4, 2))
    """

    _ids = itertools.count()

    def __init__(
        self,
        model: nn.Module,
        target: ModuleTarget | None = None,
        *,
        targets: ModuleTarget | None = None,
        capture: Iterable[str] = ("output",),
        reduction: Reduction = "last",
        condition: Callable[[], bool] | None = None,
        device: torch.device | str | None = None,
        manager: HookManager | None = None,
        threads: Threads | None = None,
    ) -> None:
        super().__init__()
        target = _one_target(target, targets)
        capture = (capture,) if isinstance(capture, str) else tuple(capture)
        unknown = [c for c in capture if c not in FIELDS]
        if unknown or not capture:
            raise ValueError(f"`capture` must be a non-empty selection of {FIELDS}; got {capture!r}")
        if not callable(reduction) and reduction not in _BUILTIN_REDUCTIONS:
            raise ValueError(
                f"`reduction` must be one of {_BUILTIN_REDUCTIONS} or a callable (stored, new) -> stored; "
                f"got {reduction!r}"
            )
        if condition is not None:
            _check_condition(condition)
        self.capture = capture
        self.reduction = reduction
        self.condition = condition
        self.device = torch.device(device) if device is not None else None
        self._own_manager = manager is None
        self.manager = manager if manager is not None else HookManager(model)
        self._pending = threading.local()
        self._lock = threading.Lock()
        self.group = self.manager.group(f"recorder-{next(self._ids)}", threads=threads)
        try:
            if "input" in capture:
                self.group.forward_pre(target, self._on_pre, with_kwargs=True)
            if "output" in capture or "input" in capture:
                self.group.forward(target, self._on_forward)
            if "grad_input" in capture or "grad_output" in capture:
                self.group.backward(target, self._on_backward)
        except BaseException:
            self.remove()
            raise

    # -- hooks ---------------------------------------------------------------------------------------------
    def _on_pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str, call: int
    ) -> None:
        if in_backward():  # a checkpointed segment computed again: recorded when it first ran
            return
        accepted = self.condition is None or bool(self.condition())
        self._pending.__dict__.setdefault("accepted", {})[name, call] = accepted
        if accepted:
            value = args[0] if len(args) == 1 and not kwargs else (*args, dict(kwargs)) if kwargs else tuple(args)
            self._store(name, call, "input", value)

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any, *, name: str, call: int) -> None:
        if in_backward():
            return
        pending = self._pending.__dict__.get("accepted", {})
        accepted = (
            pending.pop((name, call)) if (name, call) in pending else (self.condition is None or bool(self.condition()))
        )
        if not accepted:
            return
        if "output" in self.capture:
            self._store(name, call, "output", output)
        self._record(name, call).samples += 1

    def _on_backward(
        self, module: nn.Module, grad_input: tuple[Any, ...], grad_output: tuple[Any, ...], *, name: str, call: int
    ) -> None:
        if self.condition is not None and not self.condition():
            return
        if "grad_input" in self.capture:
            self._store(name, call, "grad_input", grad_input[0] if len(grad_input) == 1 else grad_input)
        if "grad_output" in self.capture:
            self._store(name, call, "grad_output", grad_output[0] if len(grad_output) == 1 else grad_output)
        self._record(name, call).grad_samples += 1

    # -- storage -------------------------------------------------------------------------------------------
    def _record(self, name: str, call: int) -> Record:
        record = self._records.get((name, call))
        if record is None:
            record = self._records[name, call] = Record(name, call)
        return record

    def _store(self, name: str, call: int, what: str, value: Any) -> None:
        value = _detached_copy(value, self.device)
        with self._lock:
            record = self._record(name, call)
            n = record._counts[what] = record._counts.get(what, 0) + 1
            setattr(record, what, _reduce(self.reduction, getattr(record, what), value, n))

    def clear(self) -> None:
        """Forget everything recorded so far (the hooks stay)."""
        with self._lock:
            self._records.clear()

    def remove(self) -> None:
        """Remove the recorder's hooks; the records stay readable."""
        self.group.remove()
        if self._own_manager:
            self.manager.remove_all()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _check_condition(condition: Callable[[], bool]) -> None:
    if not callable(condition):
        raise TypeError(f"`condition` must be a callable with no arguments; got {type(condition).__name__}")
    try:
        inspect.signature(condition).bind()
    except TypeError:
        raise TypeError(
            "`condition` is called with no arguments (as in torchfunc); read external state inside it"
        ) from None
    except ValueError:
        pass


def _detached_copy(value: Any, device: torch.device | None) -> Any:
    def copy(x: torch.Tensor) -> torch.Tensor:
        if _transformed(x):
            raise HookError(
                "a Recorder cannot keep a tensor from inside a torch.func transform (vmap, grad, jacrev...): it "
                "would escape the transform and be unusable. Record a forward run outside the transform, or return "
                "what you need from the transformed function."
            )
        return x.detach().to(device=device if device is not None else x.device, copy=True)

    return _tree.map_tensors(copy, value)


def _transformed(x: torch.Tensor) -> bool:
    """Whether ``x`` is a functorch wrapper (a batched or grad-tracking tensor of ``torch.func``)."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(x)) if check is not None else False


def _reduce(reduction: Reduction, stored: Any, new: Any, n: int) -> Any:
    """Combine a new sample with what is stored (``n`` counts samples including the new one)."""
    if reduction == "last":
        return new
    if reduction == "list":
        return [*(stored or []), new]
    if stored is None:
        return new
    if callable(reduction):
        return reduction(stored, new)
    ops: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "sum": torch.add,
        "mean": lambda a, b: a + (b - a) / n,
        "max": torch.maximum,
        "min": torch.minimum,
    }
    return _zip_map(ops[reduction], stored, new)


def _zip_map(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: Any, b: Any) -> Any:
    leaves_a, spec_a = _tree.flatten(a)
    leaves_b, _ = _tree.flatten(b)
    if len(leaves_a) != len(leaves_b) or any(
        isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor)
        or (isinstance(x, torch.Tensor) and x.shape != y.shape)
        for x, y in zip(leaves_a, leaves_b, strict=False)
    ):
        raise ValueError(
            "cannot reduce a sample into a record of another structure or shape (a module whose output changes from "
            "call to call); use reduction='list'"
        )
    out = [
        op(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else y
        for x, y in zip(leaves_a, leaves_b, strict=True)
    ]
    return _tree.unflatten(out, spec_a)
