"""Model inputs of any form: a tensor, a tuple of positional inputs, a mapping of keyword inputs, a list of images."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hooks import flatten

_FORMS = (
    "a tensor (model(x)), a tuple of positional inputs (model(*x)), a dict or any Mapping such as a HuggingFace "
    "BatchFeature (model(**x)), or a list of (C, H, W) images (torchvision detection models)"
)


def is_image_list(inputs: Any) -> bool:
    """A list of ``(C, H, W)`` images, passed to the model as one argument (torchvision detection models)."""
    return (
        isinstance(inputs, list)
        and len(inputs) > 0
        and all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in inputs)
    )


def call(model: nn.Module, inputs: Any) -> Any:
    """``model(**x)`` for a mapping, ``model(x)`` for a list of images, ``model(*x)`` for a tuple or other list."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if is_image_list(inputs):
        return model(inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _leaves(inputs: Any) -> list[Any]:
    return flatten(dict(inputs) if isinstance(inputs, Mapping) else inputs)[0]


def batches(data: Any, batch_size: int) -> Iterator[Any]:
    """A tensor or a mapping of tensors cut into batches along axis 0; anything else iterated as batches.

    Example:
        >>> [tuple(b.shape) for b in batches(torch.zeros(5, 2), 2)]
        [(2, 2), (2, 2), (1, 2)]
    """
    if isinstance(data, torch.Tensor):
        yield from data.split(batch_size)
    elif isinstance(data, Mapping):  # HF keyword inputs: tensors cut, other values (use_cache=False) passed on
        tensors = [v for v in data.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not tensors:
            raise TypeError(f"`data` is a mapping without a tensor to cut into batches: keys {list(data)}")
        for start in range(0, len(tensors[0]), batch_size):
            yield {k: _cut(v, start, batch_size) for k, v in data.items()}
    elif isinstance(data, Iterable):
        yield from data
    else:
        raise TypeError(f"`data` must be a tensor, a mapping of tensors or an iterable of batches; got {type(data)}")


def _cut(value: Any, start: int, size: int) -> Any:
    return value[start : start + size] if isinstance(value, torch.Tensor) and value.dim() > 0 else value


def batch_size(inputs: Any) -> int:
    """The number of items: the images of a list of images, else the first axis of the first tensor."""
    if is_image_list(inputs):
        return len(inputs)
    tensors = [x for x in _leaves(inputs) if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors:
        raise TypeError(f"`inputs` must hold a tensor with a batch axis: {_FORMS}; got {type(inputs).__name__}")
    return int(tensors[0].shape[0])


def device_of(inputs: Any) -> torch.device:
    """The device of the first tensor in ``inputs`` (the CPU when there is none)."""
    tensors = [x for x in _leaves(inputs) if isinstance(x, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def find_images(inputs: Any) -> tuple[str | int | None, Any]:
    """Where the images of model inputs are, and what is there: ``(key, value)``.

    ``("pixel_values", inputs.get("pixel_values"))`` for a mapping, ``(i, inputs[i])`` for a tuple or list whose
    first 4-D tensor is at ``i`` (``(None, None)`` without one), ``(None, inputs)`` for anything else.
    """
    if isinstance(inputs, Mapping):
        return "pixel_values", inputs.get("pixel_values")
    if isinstance(inputs, (tuple, list)):
        key = next((i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.dim() == 4), None)
        return key, None if key is None else inputs[key]
    return None, inputs


def image_size(inputs: Any) -> tuple[int, int] | None:
    """The ``(H, W)`` of the images in ``inputs``, or ``None`` (no images, or a list of images of several sizes).

    Images are a 4-D tensor, ``pixel_values``, the first 4-D tensor of a tuple, or the images of a list.
    """
    if is_image_list(inputs):
        sizes = {tuple(x.shape[-2:]) for x in inputs}
        return (int(next(iter(sizes))[0]), int(next(iter(sizes))[1])) if len(sizes) == 1 else None
    _, images = find_images(inputs)
    if isinstance(images, torch.Tensor) and images.dim() == 4:
        return int(images.shape[-2]), int(images.shape[-1])
    return None


@dataclass
class Batched:
    """Inputs with a batch axis, and whether one was added to a single ``(C, H, W)`` image."""

    inputs: Any
    single: bool


def batched(inputs: Any, model: nn.Module, *, images: bool) -> Batched:
    """Add a batch axis to a single image: a 3-D tensor, or 3-D ``pixel_values``.

    A 3-D tensor is an image when ``images`` says so (the CAMs), or when the model has an image stem of as many
    channels (timm ``patch_embed``, torchvision ``conv_proj``, a HuggingFace config with ``num_channels``).
    """
    refuse_integer_images(inputs if not isinstance(inputs, Mapping) else inputs.get("pixel_values"), images)
    if isinstance(inputs, Mapping):
        pixels = inputs.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.dim() == 3:
            return Batched({**inputs, "pixel_values": pixels[None]}, True)
        return Batched(inputs, False)
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 3 and inputs.is_floating_point():
        if images or _takes_images(model, inputs):
            return Batched(inputs[None], True)
    if not isinstance(inputs, (torch.Tensor, tuple, list)):
        raise TypeError(f"`inputs` must be {_FORMS}; got {type(inputs).__name__}")
    return Batched(inputs, False)


def refuse_integer_images(x: Any, images: bool) -> None:
    """Integer images (``torchvision.io.read_image`` gives uint8 ``(3, H, W)``) get an error saying how to convert."""
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.dim() not in (3, 4):
        return
    channels = x.shape[0] if x.dim() == 3 else x.shape[1]
    if images or (x.dtype == torch.uint8 and channels in (1, 3, 4)):
        raise TypeError(
            f"`inputs` are {x.dtype} images of shape {tuple(x.shape)}: the model needs floating-point images. "
            "Convert with `images.float() / 255` (then normalise them as the model was trained, e.g. "
            "torchvision.transforms.Normalize(mean, std))"
        )


def _takes_images(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether a 3-D tensor is a ``(C, H, W)`` image for this model rather than a batch of token embeddings."""
    channels = int(x.shape[0])
    stem = getattr(model, "patch_embed", None)
    proj = getattr(stem, "proj", None)
    if isinstance(proj, nn.Conv2d):
        return proj.in_channels == channels
    conv = getattr(model, "conv_proj", None)
    if isinstance(conv, nn.Conv2d):
        return conv.in_channels == channels
    config = getattr(model, "config", None)
    return getattr(config, "num_channels", None) == channels and hasattr(config, "image_size")


def describe(inputs: Any) -> str:
    """A short description of model inputs for error messages: shapes and dtypes."""

    def one(x: Any) -> str:
        return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__

    if isinstance(inputs, Mapping):
        return "{" + ", ".join(f"{k!r}: {one(v)}" for k, v in inputs.items()) + "}"
    if isinstance(inputs, (tuple, list)):
        kind = "list" if isinstance(inputs, list) else "tuple"
        shown = ", ".join(one(x) for x in inputs[:4]) + (", ..." if len(inputs) > 4 else "")
        return f"{kind} of {len(inputs)}: [{shown}]"
    if isinstance(inputs, torch.Tensor):
        return f"of shape {tuple(inputs.shape)} ({inputs.dtype})"
    return one(inputs)


# -- token ids -------------------------------------------------------------------------------------------------
def vocab_size(model: nn.Module) -> int:
    """The number of rows of the input embedding (``model.get_input_embeddings()``), else ``config.vocab_size``."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        raise ValueError(
            "cannot tell the vocabulary size: the model has no get_input_embeddings() nor config.vocab_size"
        )
    return int(size)


def token_ids(model: nn.Module, input_ids: Any, what: str = "input_ids") -> torch.Tensor:
    """``input_ids`` as a ``(B, T)`` integer tensor (a ``(T,)`` one gets a batch axis) whose ids are in the vocabulary.

    Raises:
        TypeError: not an integer tensor.
        ValueError: empty, more than two axes, or an id outside ``[0, vocab)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"`{what}` must be an integer tensor of token ids (B, T) or (T,); got {kind_of(input_ids)}")
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"`{what}` must be a non-empty (B, T) or (T,) tensor of token ids; got shape "
                         f"{tuple(input_ids.shape)}")  # fmt: skip
    vocab = vocab_size(model)
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        raise ValueError(
            f"`{what}` holds token ids outside the vocabulary [0, {vocab}): {sorted(set(ids[bad].tolist()))[:5]}; "
            "encode the text with the model's own tokenizer"
        )
    return ids.long()


def kind_of(x: Any) -> str:
    """``a <dtype> tensor`` or the type's name, for error messages."""
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def decoder(tokenizer: Any) -> Callable[[int], str]:
    """A function from a token id to its text: a tokenizer's ``decode``, a function, or ``[id]``.

    Example:
        >>> decoder(None)(5)
        '[5]'
    """
    if tokenizer is None:
        return lambda i: f"[{i}]"
    decode = getattr(tokenizer, "decode", None)
    if callable(decode):
        return lambda i: str(decode([i]))
    if callable(tokenizer):
        return lambda i: str(tokenizer(i))
    raise TypeError(f"`tokenizer` must be a tokenizer or a function from a token id to text; got {type(tokenizer)}")


# -- tensors that are perturbed (the metrics' infidelity and sensitivity, the attacks) --------------------------
Tensors = tuple[torch.Tensor, ...]


def as_tensors(value: Any, what: str) -> Tensors:
    """A tensor, or a tuple or list of tensors, as a tuple of tensors; anything else is a ``TypeError``."""
    parts = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError(
            f"{what} must be a tensor (batch, ...) or a tuple of such tensors (one per model input); got "
            f"{describe(value)}"
        )
    return parts


def check_inputs(inputs: Any) -> Tensors:
    """The model inputs as a tuple of floating-point tensors sharing a non-empty batch axis."""
    parts = as_tensors(inputs, "`inputs`")
    for i, part in enumerate(parts):
        if part.dim() == 0 or not part.is_floating_point():
            raise TypeError(
                f"`inputs` must be floating-point tensors with a batch axis, to be perturbed; input {i} is "
                f"{describe(part)}: convert it with .float(), or close over inputs that are not perturbed in `model`"
            )
    batch = parts[0].shape[0]
    if batch == 0 or any(p.shape[0] != batch for p in parts):
        raise ValueError(
            f"`inputs` must share one non-empty batch axis; got {describe(inputs)}: give every tensor the same "
            "first axis"
        )
    return parts


def as_given(parts: Tensors, single: bool) -> Any:
    """The tensors in the form the user gave them: the tensor itself, or the tuple."""
    return parts[0] if single else parts
