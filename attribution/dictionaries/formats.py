"""Dictionaries on disk: hookscope's own format, and the peers' folders read without importing the peers.

The peers are SAELens, sparsify, dictionary_learning and circuit-tracer.

hookscope's format is a folder of two files, written atomically (each to a temporary name, then renamed; the JSON
last, so that a folder with ``dictionary.json`` is complete):

* ``weights.safetensors``: the module's ``state_dict`` (``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``, and
  ``threshold`` or ``W_skip`` where the dictionary has them), in the module's dtype;
* ``dictionary.json``: ``{"format": "hookscope-dictionary", "version": 1, "kind": "SAE" | "Transcoder", "d_in",
  "d_out", "n_features", "activation", "k", "subtract_b_dec" | "skip", "files": {"weights.safetensors": {"size",
  "sha256"}}}``; the checksum is checked on reading.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .modules import SAE, Dictionary, Transcoder

FORMAT, VERSION = "hookscope-dictionary", 1
OURS = ("dictionary.json", "weights.safetensors")
SAELENS = ("cfg.json", "sae_weights.safetensors")
SPARSIFY = ("cfg.json", "sae.safetensors")
DICTIONARY_LEARNING = ("config.json", "ae.pt")
NEEDS = (
    "hookscope: dictionary.json + weights.safetensors (Dictionary.save); SAELens: cfg.json + "
    "sae_weights.safetensors; sparsify: cfg.json + sae.safetensors (one folder per hookpoint); dictionary_learning: "
    "config.json + ae.pt; circuit-tracer: one layer_<i>.safetensors file per layer (pass the file)"
)
Weights = dict[str, torch.Tensor]


def save_dictionary(dictionary: Dictionary, path: str | Path) -> Path:
    """Write ``dictionary`` to the folder ``path`` in hookscope's format (see the module documentation)."""
    save_file = _safetensors().save_file
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / OURS[1]
    tmp = weights.with_name(f"{weights.name}.tmp-{os.getpid()}")
    save_file({k: v.detach().cpu().contiguous() for k, v in dictionary.state_dict().items()}, str(tmp))
    os.replace(tmp, weights)
    config: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "kind": type(dictionary).__name__,
        "d_in": dictionary.d_in,
        "d_out": dictionary.d_out,
        "n_features": dictionary.n_features,
        "activation": dictionary.activation,
        "k": dictionary.k,
        "dtype": str(dictionary.W_enc.dtype).removeprefix("torch."),
        "files": {OURS[1]: {"size": weights.stat().st_size, "sha256": _sha256(weights)}},
    }
    if isinstance(dictionary, SAE):
        config["subtract_b_dec"] = dictionary.subtract_b_dec
    else:
        config["skip"] = dictionary.skip
    tmp = folder / f"{OURS[0]}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, folder / OURS[0])
    return folder


def load_dictionary(path: str | Path) -> Dictionary:
    """Read a dictionary from disk; the format is found from the files present.

    Reads hookscope's own folders (``SAE.save``, bitwise), SAELens folders (``cfg.json`` +
    ``sae_weights.safetensors``: ``standard``, ``topk``, ``jumprelu``, ``batchtopk``, ``transcoder``,
    ``skip_transcoder`` and ``jumprelu_transcoder``), sparsify hookpoint folders (``cfg.json`` + ``sae.safetensors``,
    SAEs and transcoders), dictionary_learning folders (``config.json`` + ``ae.pt``: ``AutoEncoder``,
    ``AutoEncoderTopK``, ``BatchTopKSAE``, ``JumpReluAutoEncoder``) and circuit-tracer's per-layer transcoder files
    (``layer_<i>.safetensors``); none of those packages is imported. The weights keep the file's dtype.

    Three conventions are mapped exactly: a JumpReLU stored as ``relu(pre) * (pre > t)`` (SAELens,
    dictionary_learning) becomes ``pre * (pre > max(t, 0))``, the same function; an SAE that does not subtract
    ``b_dec`` before encoding gets ``subtract_b_dec=False``; a SAELens TopK or BatchTopK folder with
    ``rescale_acts_by_decoder_norm`` (as SAELens's training runner saves them) gets the decoder norms ``n`` folded in,
    ``W_enc * n``, ``b_enc * n``, ``W_dec / n`` per feature, the same features and reconstruction. Configurations
    from before SAELens 6 are read as SAELens migrates them (``normalize_activations: false`` is ``"none"``).
    circuit-tracer's ``TopK`` keeps the ``k`` largest pre-activations even when negative; ours keeps the ``k`` largest
    of ``relu(pre)``: the two agree wherever a vector has ``k`` positive pre-activations.

    Args:
        path: a folder (or circuit-tracer's ``.safetensors`` file).

    Returns:
        An :class:`~attribution.SAE` or :class:`~attribution.Transcoder`.

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no format (the message lists what each one needs).
        ValueError: a damaged or incomplete file (named), a configuration this library does not compute (gated SAEs,
            activation normalisation, ...), or weights of the wrong shapes.
        ModuleNotFoundError: ``safetensors`` is not installed (``pip install safetensors``).

    Example:
        >>> import tempfile
        >>> sae = SAE(4, 8, activation="relu")
        >>> again = load_dictionary(sae.save(tempfile.mkdtemp()))
        >>> bool(torch.equal(again.W_dec, sae.W_dec)), again.activation
        (True, 'relu')
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"`path` {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix == ".safetensors":
            return _circuit_tracer(path)
        raise FileNotFoundError(f"`path` {str(path)!r} is a file of no known format; the formats read: {NEEDS}")
    readers: list[tuple[tuple[str, str], Callable[[Path], Dictionary]]] = [
        (OURS, _ours),
        (SAELENS, _saelens),
        (SPARSIFY, _sparsify),
        (DICTIONARY_LEARNING, _dictionary_learning),
    ]
    for files, reader in readers:
        if all((path / name).is_file() for name in files):
            return reader(path)
    raise FileNotFoundError(_nothing_found(path))


def _nothing_found(path: Path) -> str:
    """The error for a folder that matches no format: what is there, and what each format needs."""
    inner = sorted(
        str(p.parent.relative_to(path)) for p in path.glob("*/cfg.json") if (p.parent / SPARSIFY[1]).is_file()
    )
    layers = sorted(p.name for p in path.glob("*.safetensors"))
    hint = f" It holds sparsify hookpoints: pass one of {inner}." if inner else ""
    hint += f" It holds circuit-tracer layer files: pass one of {layers}." if layers else ""
    present = sorted(p.name for p in path.iterdir())[:10]
    return f"`path` {str(path)!r} holds no dictionary format (files: {present}).{hint} The formats read: {NEEDS}"


# -- the readers ----------------------------------------------------------------------------------------------------
def _ours(path: Path) -> Dictionary:
    config = _json(path / OURS[0])
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ValueError(f"{path / OURS[0]} is not a {FORMAT} version {VERSION} file")
    file = path / OURS[1]
    record = config.get("files", {}).get(OURS[1], {})
    if file.stat().st_size != record.get("size") or _sha256(file) != record.get("sha256"):
        raise ValueError(
            f"{file} does not match the size and checksum recorded in {path / OURS[0]}: it is damaged or was written "
            "by an interrupted save; save the dictionary again"
        )
    weights = _read_safetensors(file)
    options = {"activation": config["activation"], "k": config["k"]}
    dictionary: Dictionary
    if config["kind"] == "SAE":
        dictionary = SAE(config["d_in"], config["n_features"], subtract_b_dec=config["subtract_b_dec"], **options)
    else:
        dictionary = Transcoder(config["d_in"], config["d_out"], config["n_features"], skip=config["skip"], **options)
    return _fill(dictionary, weights, file)


def _saelens(path: Path) -> Dictionary:
    cfg, file = _json(path / SAELENS[0]), path / SAELENS[1]
    weights = _read_safetensors(file)
    arch = cfg.get("architecture") or {"relu": "standard", "topk": "topk"}.get(
        str(cfg.get("activation_fn_str", "relu"))
    )
    norm = _saelens_normalization(cfg.get("normalize_activations", "none"))
    if norm != "none":
        raise ValueError(
            f"{path / SAELENS[0]}: normalize_activations={norm!r} rescales the input at run time, which this library "
            "does not do; fold the scaling into the weights first (SAELens: sae.fold_activation_norm_scaling_factor)"
        )
    k = int(cfg.get("k") or (cfg.get("activation_fn_kwargs") or {}).get("k") or 1)
    subtract = bool(cfg.get("apply_b_dec_to_input", True))
    if "log_threshold" in weights:
        weights["threshold"] = weights.pop("log_threshold").exp()
    if "topk_threshold" in weights:  # a BatchTopK training checkpoint
        weights["threshold"] = weights.pop("topk_threshold").reshape(())
        arch = "batchtopk"
    activation = {"standard": "relu", "topk": "topk", "jumprelu": "jumprelu", "batchtopk": "batchtopk"}.get(str(arch))
    if cfg.get("rescale_acts_by_decoder_norm") and activation in ("topk", "batchtopk"):
        weights = _folded_decoder_norms(weights, file)  # SAELens's other architectures drop the flag
    if arch in ("transcoder", "skip_transcoder", "jumprelu_transcoder"):
        tc = Transcoder(
            cfg["d_in"], cfg["d_out"], cfg["d_sae"], activation="jumprelu" if "jumprelu" in arch else "relu",
            skip=arch == "skip_transcoder",
        )  # fmt: skip
        return _fill(tc, _clamped(_transposed(weights, "W_skip")), file)
    if activation is None:
        raise ValueError(
            f"{path / SAELENS[0]}: architecture {arch!r} is not computed by this library (it reads standard, topk, "
            "jumprelu, batchtopk, transcoder, skip_transcoder and jumprelu_transcoder)"
        )
    sae = SAE(cfg["d_in"], cfg["d_sae"], activation=activation, k=k, subtract_b_dec=subtract)  # type: ignore[arg-type]
    return _fill(sae, _clamped(weights), file)


def _sparsify(path: Path) -> Dictionary:
    cfg, file = _json(path / SPARSIFY[0]), path / SPARSIFY[1]
    weights = _read_safetensors(file)
    if cfg.get("activation", "topk") != "topk":
        raise ValueError(f"{path / SPARSIFY[0]}: activation {cfg['activation']!r} is not computed by this library")
    renamed = {"W_enc": _take(weights, "encoder.weight", file).T, "b_enc": _take(weights, "encoder.bias", file)}
    renamed.update({key: weights[key] for key in ("W_dec", "b_dec", "W_skip") if key in weights})
    n, d_out = renamed["W_dec"].shape if "W_dec" in renamed else (0, 0)
    k = int(cfg["k"])
    if cfg.get("transcode") or "W_skip" in renamed:
        if not cfg.get("transcode"):
            raise ValueError(f"{path / SPARSIFY[0]}: a skip connection without transcode=True is not read")
        tc = Transcoder(cfg["d_in"], d_out, n, activation="topk", k=k, skip="W_skip" in renamed)
        return _fill(tc, _transposed(renamed, "W_skip"), file)
    return _fill(SAE(cfg["d_in"], n, activation="topk", k=k), renamed, file)


def _dictionary_learning(path: Path) -> Dictionary:
    config, file = _json(path / DICTIONARY_LEARNING[0]), path / DICTIONARY_LEARNING[1]
    trainer = config.get("trainer", config)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{file} cannot be read ({type(exc).__name__}: {exc}): it is damaged or incomplete") from None
    kind = trainer.get("dict_class") or ("JumpReluAutoEncoder" if "W_enc" in state else "AutoEncoder")
    if kind == "JumpReluAutoEncoder":
        n = state["b_enc"].shape[0] if "b_enc" in state else 0
        sae = SAE(trainer["activation_dim"], n, activation="jumprelu", subtract_b_dec=False)
        return _fill(sae, _clamped(dict(state)), file)
    if kind not in ("AutoEncoder", "AutoEncoderTopK", "BatchTopKSAE"):
        raise ValueError(
            f"{path / DICTIONARY_LEARNING[0]}: dict_class {kind!r} is not read (this library reads AutoEncoder, "
            "AutoEncoderTopK, BatchTopKSAE and JumpReluAutoEncoder)"
        )
    weights = {
        "W_enc": _take(state, "encoder.weight", file).T,
        "b_enc": _take(state, "encoder.bias", file),
        "W_dec": _take(state, "decoder.weight", file).T,
        "b_dec": _take(state, "bias" if kind == "AutoEncoder" else "b_dec", file),
    }
    activation = {"AutoEncoder": "relu", "AutoEncoderTopK": "topk", "BatchTopKSAE": "batchtopk"}[kind]
    if kind == "BatchTopKSAE":
        weights["threshold"] = _take(state, "threshold", file).reshape(())
    k = int(state["k"]) if "k" in state else int(trainer.get("k", 1))
    n, d = weights["W_dec"].shape
    return _fill(SAE(d, n, activation=activation, k=k), weights, file)  # type: ignore[arg-type]


def _circuit_tracer(file: Path) -> Dictionary:
    weights = _read_safetensors(file)
    n, d_in = _take(weights, "W_enc", file).shape
    renamed = {"W_enc": weights["W_enc"].T, **{k: _take(weights, k, file) for k in ("b_enc", "W_dec", "b_dec")}}
    activation, k = "relu", 1
    if "activation_function.threshold" in weights:
        activation, renamed["threshold"] = "jumprelu", weights["activation_function.threshold"]
    elif "k" in weights:
        activation, k = "topk", int(weights["k"])
    if "W_skip" in weights:
        renamed["W_skip"] = weights["W_skip"].T
    tc = Transcoder(d_in, renamed["W_dec"].shape[1], n, activation=activation, k=k, skip="W_skip" in weights)  # type: ignore[arg-type]
    return _fill(tc, renamed, file)


# -- helpers ----------------------------------------------------------------------------------------------------------
def _saelens_normalization(given: object) -> object:
    """``normalize_activations`` as SAELens reads it: before SAELens 6 a bool (``False`` is ``"none"``), or null."""
    if given is None or given is False:
        return "none"
    return "expected_average_only_in" if given is True else given


def _folded_decoder_norms(weights: Weights, file: Path) -> Weights:
    """SAELens's ``rescale_acts_by_decoder_norm`` folded into the weights, exactly (the same features and output).

    SAELens encodes ``act((x W_enc + b_enc) * n)`` and decodes ``(f / n) W_dec + b_dec``, ``n`` the norms of the
    decoder's rows; with ``W_enc * n``, ``b_enc * n`` and ``W_dec / n`` (per feature) the plain encode and decode
    compute the same. The fold is done in float64 and stored in the file's dtype. A row of norm 0 stays 0 (its
    feature's pre-activation is 0 either way; SAELens's decode would divide 0 by 0).
    """
    w_dec = _take(weights, "W_dec", file)
    n = w_dec.double().norm(dim=-1)
    if n.shape != _take(weights, "b_enc", file).shape:
        raise ValueError(
            f"{file}: W_dec has shape {tuple(w_dec.shape)} and b_enc {tuple(weights['b_enc'].shape)}; SAELens's "
            "decoder is (d_sae, d_in), one row per feature: the file is of another kind or damaged"
        )
    folded = dict(weights)
    folded["W_enc"] = (_take(weights, "W_enc", file).double() * n).to(w_dec.dtype)
    folded["b_enc"] = (weights["b_enc"].double() * n).to(weights["b_enc"].dtype)
    folded["W_dec"] = (w_dec.double() / n.where(n > 0, 1.0)[:, None]).to(w_dec.dtype)
    return folded


def _fill(dictionary: Dictionary, weights: Mapping[str, torch.Tensor], file: Path) -> Dictionary:
    """Copy ``weights`` into ``dictionary`` (every entry of its state dict, shapes checked), in the file's dtype."""
    state = dictionary.state_dict()
    missing = [key for key in state if key not in weights]
    if missing:
        raise ValueError(f"{file} lacks {missing} (it holds {sorted(weights)}): it is incomplete or of another kind")
    for key, value in state.items():
        given = weights[key]
        if tuple(given.shape) != tuple(value.shape):
            raise ValueError(
                f"{file}: {key!r} has shape {tuple(given.shape)}; the configuration needs {tuple(value.shape)}"
            )
    dtype = weights["W_enc"].dtype
    dictionary.to(dtype)
    dictionary.load_state_dict({key: weights[key].to(dtype).contiguous() for key in state})
    return dictionary


def _take(weights: Mapping[str, torch.Tensor], key: str, file: Path) -> torch.Tensor:
    if key not in weights:
        raise ValueError(f"{file} lacks {key!r} (it holds {sorted(weights)}): it is incomplete or of another kind")
    return weights[key]


def _clamped(weights: Weights) -> Weights:
    """``relu(pre) * (pre > t)`` is ``pre * (pre > max(t, 0))``: the threshold clamped at zero."""
    if "threshold" in weights and weights["threshold"].dim() == 1:
        weights["threshold"] = weights["threshold"].clamp(min=0)
    return weights


def _transposed(weights: Weights, key: str) -> Weights:
    """``W_skip`` stored ``(d_out, d_in)`` and applied as ``x @ W_skip.T``: ours is ``(d_in, d_out)``."""
    if key in weights:
        weights[key] = weights[key].T
    return weights


def _json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file} cannot be read ({exc}): it is damaged or incomplete") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a {type(data).__name__}, not a JSON object")
    return data


def _read_safetensors(file: Path) -> Weights:
    load_file = _safetensors().load_file
    try:
        return dict(load_file(str(file)))
    except Exception as exc:  # safetensors raises its own SafetensorError on a truncated or damaged file
        raise ValueError(f"{file} cannot be read ({type(exc).__name__}: {exc}): it is damaged or incomplete") from None


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "reading and writing dictionaries needs safetensors: pip install safetensors (or hookscope[dictionaries])"
        ) from None
    return safetensors.torch


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
