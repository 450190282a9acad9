"""Where things are in a decoder-only language model: layers, heads, projections, MLP neurons, norms, unembedding.

:func:`lm_layout` reads a HuggingFace causal LM (Llama, Qwen2/3, Mistral, Gemma, Phi, GPT-2, GPT-NeoX and
models named like them) from its config and its module names, and returns an :class:`LMLayout` of qualified module
names that every language-model method hooks (the lens, circuits, generation, AttnLRP and RelP's rules, the sweeps'
``heads=`` check). Anything it cannot find is named in the error together with the keyword that passes it
explicitly. It reads names and the config only, never a weight, so it works on a model whose weights accelerate
offloaded.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from .._run import eager_module
from .norms import NormKind, norm_kind

QKVOrder = Literal["separate", "blocks", "per_head"]
MLPKind = Literal["gated", "plain"]

_LAYER_LISTS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "transformer.layers")
_CHILDREN: dict[str, tuple[str, ...]] = {
    "attention": ("self_attn", "attn", "attention", "self_attention"),
    "out_proj": ("o_proj", "c_proj", "dense", "out_proj", "wo"),
    "q": ("q_proj", "query", "wq"),
    "k": ("k_proj", "key", "wk"),
    "v": ("v_proj", "value", "wv"),
    "qkv": ("qkv_proj", "c_attn", "query_key_value", "Wqkv"),
    "mlp": ("mlp", "feed_forward", "block_sparse_moe"),
    "attn_norm": ("input_layernorm", "ln_1", "attention_norm", "ln_attn"),
    "mlp_norm": ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "ffn_norm", "ln_mlp"),
    "gate": ("gate_proj",),
    "up": ("up_proj",),
    "down": ("down_proj",),
    "fc": ("c_fc", "fc1", "dense_h_to_4h", "fc_in"),
    "proj": ("c_proj", "fc2", "dense_4h_to_h", "fc_out"),
    "act": ("act_fn", "act", "activation_fn", "activation"),
}
_MLP_KEYS = ("gate", "up", "down", "fc", "proj", "act")
_GATED_KEYS = ("gate", "up", "down", "act")
_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")
_PARALLEL_TYPES = ("phi", "gptj", "falcon", "cohere")


@dataclass(frozen=True)
class AttentionLayout:
    """Qualified names of one attention module and its projections.

    ``q``/``k``/``v`` are set for separate projections; ``qkv`` for a fused one, whose output features are ordered
    as ``qkv_order`` says: ``"blocks"`` (all queries, then all keys, then all values: GPT-2, Phi-3) or
    ``"per_head"`` (query, key and value of head 0, then of head 1, ...: GPT-NeoX).
    """

    module: str
    out_proj: str
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_order: QKVOrder = "separate"


@dataclass(frozen=True)
class MLPLayout:
    """Qualified names of one MLP's parts.

    ``"gated"``: ``down(act(gate(x)) * up(x))`` (Llama, Qwen2, Mistral, Gemma); ``"plain"``: ``down(act(up(x)))``
    (GPT-2's ``c_fc``/``c_proj``, Phi's ``fc1``/``fc2``, GPT-NeoX's ``dense_h_to_4h``/``dense_4h_to_h``). ``act`` is the
    activation module (``None`` where the MLP applies a function that is not a module).
    """

    module: str
    kind: MLPKind
    up: str
    down: str
    act: str | None
    gate: str | None = None

    @property
    def neurons(self) -> str:
        """The module whose input holds the MLP's neuron activations (``act(gate) * up``, or ``act(fc)``).

        A neuron's write to the residual stream is its activation times that module's column.
        """
        return self.down


@dataclass(frozen=True)
class LayerLayout:
    """One decoder layer: its module, attention, MLP and the norms in front of them.

    ``parallel``: attention and MLP read the same residual stream (GPT-J, GPT-NeoX's parallel residual, Phi).
    ``sandwich``: the attention and MLP outputs pass through a norm before they join the residual stream
    (Gemma 2/3), so they are not linear writers.
    """

    index: int
    module: str
    attention: AttentionLayout
    mlp: str
    attn_norm: str | None
    mlp_norm: str | None
    parallel: bool = False
    sandwich: bool = False
    mlp_parts: MLPLayout | None = None
    """The MLP's projections and activation; ``None`` where they are not found (a mixture of experts)."""


@dataclass(frozen=True)
class LMLayout:
    """Module names and sizes of a decoder-only language model (see :func:`lm_layout`)."""

    embed: str
    position: str | None
    layers: tuple[LayerLayout, ...]
    final_norm: str
    unembed: str | None
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    norms: tuple[tuple[str, NormKind], ...] = ()
    """Every LayerNorm and RMSNorm of the model with its kind, in model order (the layers' and the final one)."""
    softcap: float | None = None
    """Gemma 2's ``final_logit_softcapping`` (logits ``c * tanh(logits / c)``), else ``None``."""
    cache_keyword: str | None = None
    """The keyword by which the forward takes a key/value cache of a prefix (``past_key_values``, or ``cache`` in
    recent transformers), ``None`` where it takes none."""

    @property
    def takes_past_key_values(self) -> bool:
        """Whether the forward takes a key/value cache (under :attr:`cache_keyword`)."""
        return self.cache_keyword is not None

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads


def lm_layout(
    model: nn.Module,
    *,
    layers: str | None = None,
    final_norm: str | None = None,
    unembed: str | None = None,
    embed: str | None = None,
    children: Mapping[str, str] | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
) -> LMLayout:
    """Find the modules of a decoder-only language model.

    Args:
        model: a HuggingFace causal LM (or a model with the same module names).
        layers: qualified name of the ``nn.ModuleList`` of decoder layers (found when ``None``).
        final_norm: qualified name of the norm before the unembedding.
        unembed: qualified name of the unembedding (``model.get_output_embeddings()`` when ``None``).
        embed: qualified name of the token embedding (``model.get_input_embeddings()`` when ``None``).
        children: names inside a decoder layer, relative to it, for any of the keys ``attention``, ``out_proj``,
            ``q``, ``k``, ``v``, ``qkv``, ``mlp``, ``attn_norm``, ``mlp_norm`` (``out_proj`` and ``q``... are
            relative to the attention module), ``gate``, ``up``, ``down``, ``fc``, ``proj``, ``act`` (relative to
            the MLP).
        n_heads: query heads (from the config when ``None``).
        n_kv_heads: key/value heads (from the config when ``None``; equal to ``n_heads`` without GQA).

    Returns:
        The layout, with qualified module names.

    Raises:
        ValueError: a module or a size that could not be found, with the keyword that passes it.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> layout = lm_layout(transformers.LlamaForCausalLM(config))
        >>> layout.layers[1].attention.out_proj, layout.final_norm, layout.n_kv_heads, layout.head_dim
        ('model.layers.1.self_attn.o_proj', 'model.norm', 2, 4)
        >>> layout.layers[0].mlp_parts.neurons, layout.takes_past_key_values
        ('model.layers.0.mlp.down_proj', True)
    """
    model = eager_module(model)  # a compiled model's modules; TorchScript refused with hooks' error
    modules = dict(model.named_modules())
    config = getattr(model, "config", None)
    layer_list = layers or _find_layer_list(modules, config)
    if not isinstance(modules.get(layer_list), nn.ModuleList):
        raise ValueError(
            f"`layers` {layer_list!r} is not an nn.ModuleList of the model (see hooks.module_names(model))"
        )
    names = _children(modules, layer_list, children or {})
    layer_layouts = tuple(_layer(modules, layer_list, i, names, config) for i in range(len(modules[layer_list])))
    heads = n_heads or _config_int(config, ("num_attention_heads", "n_head", "num_heads"), "n_heads") or 0
    kv = n_kv_heads or _config_int(config, ("num_key_value_heads", "num_kv_heads"), None) or heads
    embed = embed or _name_of(modules, _call(model, "get_input_embeddings"), "embed", "the token embedding")
    hidden = _config_int(config, ("hidden_size", "n_embd", "d_model"), None) or _embedding_dim(modules.get(embed))
    head_dim = _config_int(config, ("head_dim",), None) or hidden // heads
    if heads % kv:
        raise ValueError(f"`n_kv_heads` ({kv}) must divide `n_heads` ({heads})")
    return LMLayout(
        embed=embed,
        position=_qualified(_base(layer_list), _child(modules, _base(layer_list), ("wpe", "embed_positions"))),
        layers=layer_layouts,
        final_norm=final_norm or _final_norm(modules, layer_list),
        unembed=unembed or _unembed(modules, model),
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=head_dim,
        hidden=hidden,
        norms=tuple((name, kind) for name, module in modules.items() if (kind := norm_kind(module)) is not None),
        softcap=logit_softcap(model),
        cache_keyword=cache_keyword(model),
    )


def _find_layer_list(modules: dict[str, nn.Module], config: object) -> str:
    """The decoder layers: a known name, else the one ``ModuleList`` as long as the config's layer count."""
    for name in _LAYER_LISTS:
        if isinstance(modules.get(name), nn.ModuleList):
            return name
    count = _config_int(config, ("num_hidden_layers", "n_layer", "num_layers"), None)
    lists = [n for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(lists) == 1:
        return lists[0]
    raise ValueError(
        f"could not find the decoder layers (looked for {', '.join(_LAYER_LISTS)} and for one ModuleList of "
        f"config.num_hidden_layers={count} modules, found {lists or 'none'}): pass `layers='<name of the "
        "ModuleList>'`"
    )


def _children(modules: dict[str, nn.Module], layer_list: str, overrides: Mapping[str, str]) -> dict[str, str]:
    """The child names inside the first decoder layer: the overrides, else the first known spelling found."""
    first = f"{layer_list}.0"
    found = dict(overrides)
    for key in ("attention", "mlp", "attn_norm", "mlp_norm"):
        if key not in found and (name := _child(modules, first, _CHILDREN[key])) is not None:
            found[key] = name
    for parent, keys in (("attention", ("out_proj", "q", "k", "v", "qkv")), ("mlp", _MLP_KEYS)):
        if parent in found:
            for key in keys:
                if key not in found and (name := _child(modules, f"{first}.{found[parent]}", _CHILDREN[key])):
                    found[key] = name
    return found


def _layer(
    modules: dict[str, nn.Module], layer_list: str, i: int, names: Mapping[str, str], config: object
) -> LayerLayout:
    """The layout of decoder layer ``i`` from the child names."""
    prefix = f"{layer_list}.{i}"
    attention = f"{prefix}.{names.get('attention')}"
    for key, where, hint in (
        ("attention", prefix, "the attention module"),
        ("out_proj", attention, "the attention's output projection"),
        ("mlp", prefix, "the MLP"),
    ):
        if f"{where}.{names.get(key)}" not in modules:
            raise ValueError(
                f"could not find {hint} in {where!r} (looked for {', '.join(_CHILDREN[key])}): pass "
                f"`children={{'{key}': '<name>'}}`"
            )
    if all(k in names for k in ("q", "k", "v")):
        projections: dict = {k: f"{attention}.{names[k]}" for k in ("q", "k", "v")}
    elif "qkv" in names:
        projections = {"qkv": f"{attention}.{names['qkv']}", "qkv_order": _qkv_order(names["qkv"])}
    else:
        raise ValueError(
            f"could not find the query/key/value projections of {attention!r} (looked for q_proj/k_proj/v_proj and "
            f"the fused {', '.join(_CHILDREN['qkv'])}): pass `children={{'q': ..., 'k': ..., 'v': ...}}` or "
            "`children={'qkv': ...}`"
        )
    mlp_norm = f"{prefix}.{names.get('mlp_norm')}"
    model_type = getattr(config, "model_type", "")
    return LayerLayout(
        index=i,
        module=prefix,
        attention=AttentionLayout(module=attention, out_proj=f"{attention}.{names['out_proj']}", **projections),
        mlp=f"{prefix}.{names['mlp']}",
        attn_norm=f"{prefix}.{names['attn_norm']}" if "attn_norm" in names else None,
        mlp_norm=mlp_norm if mlp_norm in modules else None,
        parallel=bool(getattr(config, "use_parallel_residual", False)) or model_type in _PARALLEL_TYPES,
        sandwich=f"{prefix}.post_feedforward_layernorm" in modules,
        mlp_parts=_mlp(modules, f"{prefix}.{names['mlp']}", names),
    )


def _mlp(modules: dict[str, nn.Module], mlp: str, names: Mapping[str, str]) -> MLPLayout | None:
    """The MLP's parts: gated (gate, up, down) or plain (fc, proj), with the activation module where there is one."""
    found = {key: f"{mlp}.{names[key]}" for key in _MLP_KEYS if key in names and f"{mlp}.{names[key]}" in modules}
    act = found.get("act")
    if all(key in found for key in ("gate", "up", "down")):
        return MLPLayout(mlp, "gated", found["up"], found["down"], act, gate=found["gate"])
    if "fc" in found and "proj" in found:
        return MLPLayout(mlp, "plain", found["fc"], found["proj"], act)
    return None


def gated_mlps(model: nn.Module) -> tuple[MLPLayout, ...]:
    """Every gated MLP of any model: a module with ``gate_proj``, ``up_proj`` and ``down_proj`` children.

    The product ``act(gate(x)) * up(x)`` happens inside such a module's ``forward``; rules that need both factors
    (DeepLIFT's average rule) hook the activation module (``act`` here, one of the spellings :func:`lm_layout`
    knows; ``None`` where the MLP calls a function), the up projection, and the down projection's input.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> mlp = gated_mlps(transformers.LlamaForCausalLM(config))[1]
        >>> mlp.act, mlp.up, mlp.down
        ('model.layers.1.mlp.act_fn', 'model.layers.1.mlp.up_proj', 'model.layers.1.mlp.down_proj')
    """
    modules = dict(eager_module(model).named_modules())
    found = []
    for name in modules:
        gate, up, down, act = (_qualified(name, _child(modules, name, _CHILDREN[key])) for key in _GATED_KEYS)
        if gate and up and down:
            found.append(MLPLayout(name, "gated", up, down, act, gate=gate))
    return tuple(found)


def _qkv_order(name: str) -> QKVOrder:
    """GPT-NeoX interleaves query, key and value per head; GPT-2's and Phi-3's fused projections are in blocks."""
    return "per_head" if name == "query_key_value" else "blocks"


def _final_norm(modules: dict[str, nn.Module], layer_list: str) -> str:
    """The norm beside the layer list (``model.norm``, ``transformer.ln_f``, ...)."""
    name = _child(modules, _base(layer_list), _FINAL_NORMS)
    if name is None:
        raise ValueError(
            f"could not find the final norm beside {layer_list!r} (looked for {', '.join(_FINAL_NORMS)}): pass "
            "`final_norm='<qualified name>'`"
        )
    return _qualified(_base(layer_list), name) or name


def _qualified(parent: str, child: str | None) -> str | None:
    """``parent.child`` (``child`` at the root when ``parent`` is empty), ``None`` for no child."""
    if child is None:
        return None
    return f"{parent}.{child}" if parent else child


def _unembed(modules: dict[str, nn.Module], model: nn.Module) -> str | None:
    """The output embedding's name, or ``None`` for a model without one (a base model)."""
    head = _call(model, "get_output_embeddings")
    return _name_of(modules, head, "unembed", "the unembedding") if head is not None else None


def _call(model: nn.Module, method: str) -> nn.Module | None:
    """``model.<method>()`` where the model has it and it answers, else ``None``."""
    get = getattr(model, method, None)
    try:
        return get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None


def _name_of(modules: dict[str, nn.Module], module: nn.Module | None, keyword: str, what: str) -> str:
    """The qualified name of ``module`` inside the model."""
    for name, m in modules.items():
        if m is module and module is not None:
            return name
    raise ValueError(f"could not find {what} (the model has no get_{keyword}... method): pass `{keyword}='<name>'`")


def _child(modules: dict[str, nn.Module], parent: str, spellings: tuple[str, ...]) -> str | None:
    """The first of ``spellings`` that is a direct child of ``parent``."""
    for spelling in spellings:
        if (f"{parent}.{spelling}" if parent else spelling) in modules:
            return spelling
    return None


def _base(layer_list: str) -> str:
    """The module that holds the layer list (``model`` for ``model.layers``)."""
    return layer_list.rpartition(".")[0]


def _config_int(config: object, keys: tuple[str, ...], keyword: str | None) -> int | None:
    """The first of ``keys`` that the config sets to an integer."""
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if keyword is None:
        return None
    raise ValueError(
        f"could not read the number of heads from the model's config (looked for {keys}): pass `{keyword}`"
    )


def cache_keyword(model: nn.Module) -> str | None:
    """The keyword of a causal LM's forward for a key/value cache: ``"past_key_values"``, ``"cache"`` or ``None``.

    ``cache`` is recent transformers' spelling. ``None`` unless the forward also takes ``input_ids`` and
    ``use_cache`` (a HuggingFace causal LM). Read from the class's ``forward`` (accelerate wraps the instance's).

    Example:
        >>> import torch
        >>> cache_keyword(torch.nn.Linear(2, 2)) is None
        True
    """
    parameters = _forward_parameters(model)
    if "input_ids" not in parameters or "use_cache" not in parameters:
        return None
    return next((key for key in ("past_key_values", "cache") if key in parameters), None)


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the forward can compute the logits of the last positions only (``logits_to_keep=1``)."""
    return "logits_to_keep" in _forward_parameters(model)


def _forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The parameters of the class's ``forward`` (empty where it has no readable signature)."""
    try:
        return dict(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return {}


def logit_softcap(model: nn.Module) -> float | None:
    """Gemma 2's ``config.final_logit_softcapping`` (logits ``c * tanh(logits / c)``), else ``None``."""
    value = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _embedding_dim(embed: nn.Module | None) -> int:
    """The width of the token embedding."""
    if isinstance(embed, nn.Embedding):
        return embed.embedding_dim
    raise ValueError("could not read the hidden size from the config or the input embedding (pass `embed=`)")


def heads_at(layout: LMLayout, name: str, site: str) -> tuple[int, str] | None:
    """How many heads the activation at ``site`` (``"output"`` or ``"input"``) of module ``name`` holds, and why.

    Known for an attention's projections: query outputs and the output projection's input hold the query heads;
    key and value outputs hold the key/value heads (fewer under grouped-query attention). ``None`` elsewhere.
    """
    for layer in layout.layers:
        attention = layer.attention
        query = f"{layout.n_heads} query heads (config.num_attention_heads)"
        kv = f"{layout.n_kv_heads} key/value heads (config.num_key_value_heads)"
        if (name, site) in ((attention.q, "output"), (attention.out_proj, "input")):
            return layout.n_heads, query
        if site == "output" and name in (attention.k, attention.v):
            return layout.n_kv_heads, kv
    return None


def check_heads(model: nn.Module, names: list[str], heads: int, site: str) -> None:
    """Refuse a ``heads`` count that does not match an LM's attention projection (silently wrong slices on GQA).

    Models that :func:`lm_layout` cannot read are not checked (``heads`` must then only divide the activation).

    Raises:
        ValueError: naming the module, the number given and the number its activation holds.
    """
    try:
        layout = lm_layout(model)
    except ValueError:
        return
    for name in names:
        known = heads_at(layout, name, site)
        if known is not None and known[0] != heads:
            raise ValueError(
                f"`heads`={heads} does not match the {site} of {name!r}, which holds {known[1]}; the model has "
                f"{layout.n_heads} query heads and {layout.n_kv_heads} key/value heads. Pass heads={known[0]} "
                "(query heads for q_proj and the output projection's input, key/value heads for k_proj and v_proj)"
            )
