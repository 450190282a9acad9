"""A report's units as the peers read them: circuit-tracer's feature files, Neuronpedia's export, ``NeuronRecord``.

Each writer follows the peer's own definition, read at these commits (tests check the output against pydantic models
written from them, with no key left over or missing):

- circuit-tracer: ``circuit_tracer/frontend/feature_models.py`` (``Model``, ``ExamplesQuantile``, ``Example``) and the
  viewer that loads it, ``frontend/assets/feature_examples/init-feature-examples.js`` (a feature is
  ``<scan>/<featureIndex>.json``) and ``frontend/graph_models.py`` (a graph node's ``feature`` is the Cantor pairing
  of its layer and index), decoderesearch/circuit-tracer 4bb8c0ea10bde09727e14565ec8469656880da53.
- Neuronpedia: ``utils/neuronpedia-utils/neuronpedia_utils/db_models/feature.py`` and ``activation.py`` (the rows of
  its export) and ``apps/webapp/app/api/admin/import/route.ts`` (the folders it imports),
  hijohnnylin/neuronpedia ebb8426fc550ad5d1f76d52c271a624af3c08a57.
- OpenAI automated-interpretability: ``neuron-explainer/neuron_explainer/activations/activations.py``
  (``NeuronRecord``, ``NeuronId``, ``ActivationRecord``), openai/automated-interpretability
  e4aa21bc8baf26ff141ccf2e6f4444dcf120193f.

Units are placed by what ``UnitReport.sources`` says: a neuron, feature or direction ``index`` of decoder layer
``layer``. Units that were never non-zero (``UnitReport.dead``) get no file and no row.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import _logits, _math

if TYPE_CHECKING:
    from .report import Example, Unit, UnitReport

NEURONPEDIA_CREATOR = "clkht01d40000jv08hvalcvly"
"""The user Neuronpedia's converters write by default: the one its ``prisma/seed.ts`` creates on a local instance."""

PERCENTILES = 100
"""circuit-tracer's ``quantile_values``: the value at each percentile 1..100, its viewer's "Act: x (n pct)"."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class _Place:
    """Where a unit comes from: its kind, module, decoder layer and index there."""

    kind: str
    module: str
    layer: int
    index: int


# -- circuit-tracer -------------------------------------------------------------------------------------------------


def cantor(layer: int, index: int) -> int:
    """circuit-tracer's feature number of ``(layer, index)``: the Cantor pairing (``graph_models.py``).

    Example:
        >>> cantor(0, 0), cantor(1, 0), cantor(0, 1), cantor(2, 3)
        (0, 1, 2, 18)
    """
    return (layer + index) * (layer + index + 1) // 2 + index


def to_circuit_tracer(
    report: UnitReport, folder: str | Path, *, transcoder_id: str | None = None, logits: int = 10
) -> list[Path]:
    """Write one circuit-tracer feature file per live unit: ``folder/<cantor(layer, index)>.json``.

    The file is the ``Model`` of circuit-tracer's ``frontend/feature_models.py``, named as its viewer loads a graph
    node's feature (``<scan>/<featureIndex>.json``, the node's ``feature`` being the Cantor pairing of its layer and
    index, as ``attribution.graphs`` numbers neurons and features too). Examples come as ``examples_quantiles``:
    "Top activations" first (value descending), then the non-empty equal-width bands of ``(0, max]`` from the highest
    down (Anthropic's intervals), an example that already appeared marked ``is_repeated_datapoint``;
    ``train_token_ind`` is the example's token in its context. ``top_logits`` and ``bottom_logits`` are the texts of
    the tokens the unit raises most (largest first) and lowers most (most negative first); ``act_min``/``act_max``
    the unit's smallest and largest value; ``quantile_values`` the value at each percentile 1..100 of all its values
    (from the sketch); ``histogram`` the counts of ``UnitReport.histogram`` (40 bins from ``act_min`` to
    ``act_max``); ``activation_frequency`` the density.

    To show them in circuit-tracer's viewer, serve the folder where its graph's ``scan`` points (a scan starting with
    ``./`` is read as ``<scan>/<featureIndex>.json``).

    Args:
        report: the report.
        folder: where the files go (made if missing).
        transcoder_id: the files' ``transcoder_id`` (default: the module the unit is read at).
        logits: how many top and bottom tokens to write (at most the 20 the report keeps).

    Returns:
        The files written, in the order of the units.

    Raises:
        ValueError: a unit outside the decoder layers (circuit-tracer numbers features by layer), two units that
            would share a file, a report without sources, or ``logits`` out of range.

    Example:
        >>> import tempfile, transformers
        >>> from attribution.features import Neurons, feature_statistics
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(3, 50, (6, 12)), Neurons(1, indices=[5, 2]), k=3,
        ...     bands=2, context=(2, 2), progress=False)
        >>> with tempfile.TemporaryDirectory() as folder:  # layer 1: neuron 5 is (1 + 5)(1 + 5 + 1) / 2 + 5
        ...     [path.name for path in to_circuit_tracer(report, folder)]
        ['26.json', '8.json']
    """
    report = _checked(report)
    kept = _logits.KEPT if report.logits is None else int(report.logits["top_ids"].shape[1])
    if not isinstance(logits, int) or not 0 <= logits <= kept:
        raise ValueError(
            f"`logits` must be an integer in [0, {kept}] (the logit effects the report keeps); got {logits!r}"
        )
    live = _live(report)
    places = _places(report, live, "circuit-tracer numbers a feature by its layer and index")
    names = _unique(report, places, lambda p: f"{cantor(p.layer, p.index)}.json", "file")
    levels = torch.arange(1, PERCENTILES + 1, dtype=torch.float64) / PERCENTILES
    quantiles = report.quantile(levels)
    density, low, high = report.density, report.min, report.max
    written = []
    for i in live:
        place = places[i]
        top, bottom = _logit_texts(report, i, logits)
        data = {
            "transcoder_id": place.module if transcoder_id is None else str(transcoder_id),
            "index": place.index,
            "examples_quantiles": _quantile_groups(report, i),
            "top_logits": top,
            "bottom_logits": bottom,
            "act_min": float(low[i]),
            "act_max": float(high[i]),
            "quantile_values": quantiles[i].tolist(),
            "histogram": [float(c) for c in report.histogram(i)[1].tolist()],
            "activation_frequency": float(density[i]),
        }
        written.append(_write(Path(folder) / names[i], _json(data)))
    return written


def _quantile_groups(report: UnitReport, i: int) -> list[dict[str, Any]]:
    """Top examples, then the non-empty interval bands from the highest, as circuit-tracer's ``ExamplesQuantile``."""
    groups: list[tuple[str, list[Example]]] = [("Top activations", report.top(i))]
    if report.band_samples is not None:
        edges = report.band_edges(i, "interval")
        bands = report.bands(i, "interval")
        for j in reversed(range(len(bands))):
            if bands[j]:
                groups.append((f"Interval {j + 1} of {len(bands)}: ({edges[j]:.4g}, {edges[j + 1]:.4g}]", bands[j]))
    seen: set[tuple[int, int]] = set()
    out = []
    for name, examples in groups:
        rows = []
        for e in examples:
            rows.append(
                {
                    "tokens_acts_list": list(e.activations),
                    "train_token_ind": e.offset,
                    "is_repeated_datapoint": (e.document, e.position) in seen,
                    "tokens": _token_texts(report, e.tokens),
                }
            )
            seen.add((e.document, e.position))
        out.append({"quantile_name": name, "examples": rows})
    return out


# -- Neuronpedia ----------------------------------------------------------------------------------------------------


def to_neuronpedia(
    report: UnitReport,
    folder: str | Path,
    *,
    model_id: str,
    source_set: str | None = None,
    creator_id: str = NEURONPEDIA_CREATOR,
) -> list[Path]:
    """Write the live units as Neuronpedia's export: ``Feature`` and ``Activation`` rows, as its importer reads them.

    Each decoder layer's units become the source ``<layer>-<source_set>`` of model ``model_id``, in
    ``folder/<model_id>/<layer>-<source_set>/features/batch-0.jsonl.gz`` (one ``Feature`` per line) and
    ``.../activations/batch-0.jsonl.gz`` (one ``Activation`` per line), the layout of Neuronpedia's exports and of
    its ``/api/admin/import``. A ``Feature`` carries ``maxActApprox`` (the maximum), ``frac_nonzero`` (the density),
    ``pos_str``/``pos_values`` and ``neg_str``/``neg_values`` (the top 10 and bottom 10 logit effects: largest first,
    most negative first) and ``freq_hist_data_bar_values``/``_heights`` (the centres and counts of
    ``UnitReport.histogram``); ``logits_hist_data_*`` and the neighbour lists are left at their defaults (the
    report keeps no histogram of the whole vocabulary). The ``Activation`` rows are the top examples (``binMin`` -1
    and ``binMax`` the maximum: SAEDashboard's "top activations"), then the samples of the equal-width bands of
    ``(0, max]`` from the highest (``binMin``/``binMax`` the band's edges, ``binContains`` its share of the positive
    values, from the sketch); ``maxValue``/``maxValueTokenIndex``/``minValue`` are over the context as Neuronpedia's
    converter computes them, ``qualifyingTokenIndex`` the example's own token, ``dataIndex`` its document. Row ids are
    digests of the report and the example, so a second import of the same export adds nothing.

    Neuronpedia's importer also reads ``model.jsonl``, ``sourceset.jsonl`` and ``source.jsonl`` beside these folders:
    they describe the model (its layer count, width, owner), which the report does not know, and are not written.

    Args:
        report: the report.
        folder: where the export goes.
        model_id: Neuronpedia's id of the model, e.g. ``"gpt2-small"``.
        source_set: the source set's name (default ``hookscope-neurons``, ``-features`` or ``-directions`` by kind).
        creator_id: the user the rows belong to (default: the user a local Neuronpedia is seeded with).

    Returns:
        The files written.

    Raises:
        ValueError: a malformed ``model_id``/``source_set``, a unit outside the decoder layers, two units that would
            be the same feature, or a report without sources.

    Example:
        >>> import tempfile, transformers
        >>> from attribution.features import Neurons, feature_statistics
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(3, 50, (6, 12)), Neurons(1, indices=[5, 2]), k=3,
        ...     bands=2, context=(2, 2), progress=False)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     [path.relative_to(folder).as_posix() for path in to_neuronpedia(report, folder, model_id="tiny")]
        ['tiny/1-hookscope-neurons/features/batch-0.jsonl.gz', 'tiny/1-hookscope-neurons/activations/batch-0.jsonl.gz']
    """
    report = _checked(report)
    for name, value in (("model_id", model_id), ("source_set", source_set), ("creator_id", creator_id)):
        if value is not None and (not isinstance(value, str) or not _NAME.fullmatch(value)):
            raise ValueError(f"`{name}` must be letters, digits, '.', '_' or '-' (e.g. 'gpt2-small'); got {value!r}")
    live = _live(report)
    places = _places(report, live, "Neuronpedia names a source by its layer")

    def source_of(p: _Place) -> str:
        return f"{p.layer}-{source_set or f'hookscope-{p.kind}s'}"

    _unique(report, places, lambda p: f"{source_of(p)}/{p.index}", "feature")
    features: dict[str, list[bytes]] = {}
    activations: dict[str, list[bytes]] = {}
    density, high = report.density, report.max
    digest = hashlib.sha256(json.dumps(report.settings, sort_keys=True).encode()).hexdigest()[:16]
    for i in live:
        place = places[i]
        source = source_of(place)
        key = {"modelId": model_id, "layer": source, "index": str(place.index)}
        top, bottom = (
            ([], []) if report.logits is None else report.logit_effects(i, min(10, report.logits["top_ids"].shape[1]))
        )
        edges, counts = report.histogram(i)
        feature = {
            **key,
            "creatorId": creator_id,
            "maxActApprox": float(high[i]),
            "neg_str": _token_texts(report, [t for t, _ in bottom]),
            "neg_values": [v for _, v in bottom],
            "pos_str": _token_texts(report, [t for t, _ in top]),
            "pos_values": [v for _, v in top],
            "frac_nonzero": float(density[i]),
            "freq_hist_data_bar_heights": [float(c) for c in counts.tolist()],
            "freq_hist_data_bar_values": ((edges[:-1] + edges[1:]) / 2).tolist(),
        }
        features.setdefault(source, []).append(_json(feature, indent=None))
        rows = activations.setdefault(source, [])
        for n, (example, bin_min, bin_max, contains) in enumerate(_neuronpedia_examples(report, i)):
            values = list(example.activations)
            largest = max(values)
            row = {
                "id": "hs"
                + hashlib.sha256(f"{digest}/{model_id}/{source}/{place.index}/{n}".encode()).hexdigest()[:23],
                "tokens": _token_texts(report, example.tokens),
                **key,
                "maxValue": largest,
                "maxValueTokenIndex": values.index(largest),
                "minValue": min(values),
                "values": values,
                "creatorId": creator_id,
                "dataIndex": str(example.document),
                "binMin": bin_min,
                "binMax": bin_max,
                "binContains": contains,
                "qualifyingTokenIndex": example.offset,
            }
            rows.append(_json(row, indent=None))
    base = Path(folder) / model_id
    written = []
    for source, lines in features.items():
        written.append(_write(base / source / "features" / "batch-0.jsonl.gz", _gzip(lines)))
        if activations[source]:
            written.append(_write(base / source / "activations" / "batch-0.jsonl.gz", _gzip(activations[source])))
    return written


def _neuronpedia_examples(report: UnitReport, i: int) -> list[tuple[Example, float, float, float | None]]:
    """``(example, binMin, binMax, binContains)``: the top examples, then the interval bands from the highest."""
    top = float(report.max[i])
    out: list[tuple[Example, float, float, float | None]] = [(e, -1.0, top, -1.0) for e in report.top(i)]
    if report.band_samples is None:
        return out
    edges = report.band_edges(i, "interval")
    bands = report.bands(i, "interval")
    shares = _band_shares(report, i, edges)
    for j in reversed(range(len(bands))):
        out.extend((e, edges[j], edges[j + 1], shares[j]) for e in bands[j])
    return out


def _band_shares(report: UnitReport, i: int, edges: list[float]) -> list[float]:
    """Each band's share of the unit's positive values, from the sketch (bucket values within 2% of the true ones)."""
    counts = report.first.sketch[i].double()
    values = _math.bucket_values().clamp(float(report.min[i]), float(report.max[i]))
    positive = counts[values > 0].sum()
    if not positive:
        return [0.0] * (len(edges) - 1)
    return [float(counts[(values > lo) & (values <= hi)].sum() / positive) for lo, hi in itertools.pairwise(edges)]


# -- OpenAI automated-interpretability ------------------------------------------------------------------------------


def neuron_record(report: UnitReport, unit: Unit) -> dict[str, Any]:
    """A unit as OpenAI automated-interpretability's ``NeuronRecord``: a plain dict, as ``fast_dataclasses`` write it.

    Keys (each record's ``dataclass_name`` included, so ``neuron_explainer.fast_dataclasses.loads`` rebuilds the
    dataclasses): ``neuron_id`` (``layer_index``, ``neuron_index``: the unit's decoder layer and index there);
    ``most_positive_activation_records`` (the top examples); ``random_sample_by_quantile`` (the samples of the
    equal-count bands of the positive values, lowest first) and ``quantile_boundaries`` (those bands' ``bands + 1``
    edges, as activation values), both ``None`` without bands; ``random_sample`` (the report's uniform sample of the
    positions where the unit is at most 0: the report keeps no uniform sample of all positions, which for a sparse
    unit is nearly the same); ``mean``, ``variance``, ``skewness``, ``kurtosis`` (over all included tokens; NaN where
    undefined, the dataclass's default). Each ``ActivationRecord`` is an example's context: ``tokens`` as text,
    ``activations`` the unit's values there. The upstream dataclass has no ``stdev`` (take ``variance ** 0.5``) and
    no most negative records.

    Args:
        report: the report.
        unit: the unit's number or label.

    Returns:
        The record, JSON-serialisable (``json.dumps`` writes NaN as ``NaN``).

    Raises:
        ValueError: the unit is not in a decoder layer, or the report has no sources.

    Example:
        >>> import tempfile, transformers
        >>> from attribution.features import Neurons, feature_statistics
        >>> config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.LlamaForCausalLM(config).eval()
        >>> report = feature_statistics(model, torch.randint(3, 50, (6, 12)), Neurons(1, indices=[5, 2]), k=3,
        ...     bands=2, context=(2, 2), progress=False)
        >>> record = neuron_record(report, "L1/N2")
        >>> record["neuron_id"], len(record["random_sample_by_quantile"])
        ({'dataclass_name': 'NeuronId', 'layer_index': 1, 'neuron_index': 2}, 2)
    """
    report = _checked(report)
    i = report.index(unit)
    place = _places(report, [i], "NeuronId names a layer_index")[i]
    bands = report.band_samples is not None
    return {
        "dataclass_name": "NeuronRecord",
        "neuron_id": {"dataclass_name": "NeuronId", "layer_index": place.layer, "neuron_index": place.index},
        "random_sample": [_record(report, e) for e in report.non_activating(i)],
        "random_sample_by_quantile": [[_record(report, e) for e in band] for band in report.bands(i, "rank")]
        if bands
        else None,
        "quantile_boundaries": report.band_edges(i, "rank") if bands else None,
        "mean": float(report.mean[i]),
        "variance": float(report.variance[i]),
        "skewness": float(report.skewness[i]),
        "kurtosis": float(report.kurtosis[i]),
        "most_positive_activation_records": [_record(report, e) for e in report.top(i)],
    }


def _record(report: UnitReport, example: Example) -> dict[str, Any]:
    """An example as an ``ActivationRecord``."""
    return {
        "dataclass_name": "ActivationRecord",
        "tokens": _token_texts(report, example.tokens),
        "activations": list(example.activations),
    }


# -- shared ---------------------------------------------------------------------------------------------------------


def _checked(report: Any) -> UnitReport:
    """``report`` if it is a :class:`UnitReport` (imported here: report.py may import this module)."""
    from .report import UnitReport

    if not isinstance(report, UnitReport):
        raise TypeError(f"`report` must be a UnitReport (from feature_statistics); got {type(report).__name__}")
    return report


def _places(report: UnitReport, units: list[int], why: str) -> dict[int, _Place]:
    """The places of ``units`` from ``report.sources``; one outside the decoder layers is refused, saying ``why``."""
    sources = [(s, int(index)) for s in report.sources for index in s["indices"]]
    if len(sources) != len(report):
        raise ValueError(
            f"the report's `sources` name {len(sources)} units, but it has {len(report)}: make the report again with "
            "feature_statistics (it records where each unit comes from)"
        )
    places = {}
    for i in units:
        source, index = sources[i]
        if source["layer"] is None:
            raise ValueError(
                f"unit {report.labels[i]!r} is read at {source['module']!r}, which is not in a decoder layer, and "
                f"{why}: export units read inside the model's layers (Neurons, or Features/Directions at a layer's "
                "module)"
            )
        places[i] = _Place(str(source["kind"]), str(source["module"]), int(source["layer"]), index)
    return places


def _unique(report: UnitReport, places: dict[int, _Place], name: Any, what: str) -> dict[int, str]:
    """Each unit's ``name(place)``; two units with one name are refused, naming both."""
    names = {i: name(p) for i, p in places.items()}
    first: dict[str, int] = {}
    for i, text in names.items():
        if text in first:
            raise ValueError(
                f"units {report.labels[first[text]]!r} and {report.labels[i]!r} would be the same {what} {text!r} "
                "(same layer and index): export them from separate reports, or give them different layers"
            )
        first[text] = i
    return names


def _live(report: UnitReport) -> list[int]:
    """The units that were non-zero somewhere, in order."""
    dead = set(report.dead)
    return [i for i in range(len(report)) if i not in dead]


def _token_texts(report: UnitReport, ids: Any) -> list[str]:
    """Each token id's text through the report's tokenizer (``[id]`` without one)."""
    return [report.text([int(t)]) for t in ids]


def _logit_texts(report: UnitReport, i: int, k: int) -> tuple[list[str], list[str]]:
    """The texts of the top and bottom ``k`` logit effects (none where the report has none)."""
    if report.logits is None or k == 0:
        return [], []
    top, bottom = report.logit_effects(i, k)
    return _token_texts(report, [t for t, _ in top]), _token_texts(report, [t for t, _ in bottom])


def _json(data: dict[str, Any], indent: int | None = 1) -> bytes:
    """``data`` as JSON (NaN and infinities refused: JSON has none)."""
    return json.dumps(data, indent=indent, ensure_ascii=False, allow_nan=False).encode()


def _gzip(lines: list[bytes]) -> bytes:
    """JSON lines, gzipped reproducibly (no time stamp)."""
    return gzip.compress(b"\n".join(lines) + b"\n", mtime=0)


def _write(path: Path, body: bytes) -> Path:
    """``body`` written to ``path`` atomically: a temporary file beside it, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
