"""Exports of a UnitReport checked against the peers' schemas, written here as pydantic models from their sources.

- circuit-tracer: decoderesearch/circuit-tracer 4bb8c0ea10bde09727e14565ec8469656880da53,
  ``circuit_tracer/frontend/feature_models.py``.
- Neuronpedia: hijohnnylin/neuronpedia ebb8426fc550ad5d1f76d52c271a624af3c08a57,
  ``utils/neuronpedia-utils/neuronpedia_utils/db_models/feature.py`` and ``activation.py``.
- OpenAI: openai/automated-interpretability e4aa21bc8baf26ff141ccf2e6f4444dcf120193f,
  ``neuron-explainer/neuron_explainer/activations/activations.py`` (with ``fast_dataclasses``' ``dataclass_name``).

Every model forbids extra keys, so a misspelt or invented key fails; fields without a default upstream are required.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
from datetime import datetime
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from attribution.features import Directions, Neurons, feature_statistics
from attribution.features import export as ex

STRICT = ConfigDict(extra="forbid", strict=True)


# -- circuit-tracer: frontend/feature_models.py ---------------------------------------------------------------------
class CTExample(BaseModel):
    model_config = STRICT
    tokens_acts_list: list[float]
    train_token_ind: int
    is_repeated_datapoint: bool
    tokens: list[str]


class CTExamplesQuantile(BaseModel):
    model_config = STRICT
    quantile_name: str
    examples: list[CTExample]


class CTModel(BaseModel):
    model_config = STRICT
    transcoder_id: str
    index: int
    examples_quantiles: list[CTExamplesQuantile]
    top_logits: list[str]
    bottom_logits: list[str]
    act_min: float
    act_max: float
    quantile_values: list[float]
    histogram: list[float]
    activation_frequency: float


# -- Neuronpedia: db_models/feature.py and activation.py ------------------------------------------------------------
class NPFeature(BaseModel):
    model_config = STRICT
    modelId: str
    layer: str
    index: str
    creatorId: str | None = None
    createdAt: datetime = Field(default_factory=datetime.now)
    maxActApprox: float | None = 0
    hasVector: bool = False
    vector: list[float] = []
    vectorLabel: str | None = None
    vectorDefaultSteerStrength: float | None = 10
    hookName: str | None = None
    topkCosSimIndices: list[int] = []
    topkCosSimValues: list[float] = []
    neuron_alignment_indices: list[int] = []
    neuron_alignment_values: list[float] = []
    neuron_alignment_l1: list[float] = []
    correlated_neurons_indices: list[int] = []
    correlated_neurons_pearson: list[float] = []
    correlated_neurons_l1: list[float] = []
    correlated_features_indices: list[int] = []
    correlated_features_pearson: list[float] = []
    correlated_features_l1: list[float] = []
    neg_str: list[str] = []
    neg_values: list[float] = []
    pos_str: list[str] = []
    pos_values: list[float] = []
    frac_nonzero: float = 0
    freq_hist_data_bar_heights: list[float] = []
    freq_hist_data_bar_values: list[float] = []
    logits_hist_data_bar_heights: list[float] = []
    logits_hist_data_bar_values: list[float] = []
    decoder_weights_dist: list[float] = []
    sourceSetName: str | None = None


class NPActivation(BaseModel):
    model_config = STRICT
    id: str
    tokens: list[str]
    index: str
    layer: str
    modelId: str
    maxValue: float
    maxValueTokenIndex: int
    minValue: float
    values: list[float]
    creatorId: str
    dataSource: str | None = None
    dataIndex: str | None = None
    dfaValues: list[float] = []
    dfaTargetIndex: int | None = None
    dfaMaxValue: float | None = None
    createdAt: datetime = Field(default_factory=datetime.now)
    lossValues: list[float] = []
    logitContributions: str | None = None
    binMin: float | None = None
    binMax: float | None = None
    binContains: float | None = None
    qualifyingTokenIndex: int | None = None
    zIndices: list[list[int]] | None = None
    zValues: list[float] | None = None


# -- OpenAI: neuron_explainer/activations/activations.py ------------------------------------------------------------
class OAActivationRecord(BaseModel):
    model_config = STRICT
    dataclass_name: Literal["ActivationRecord"]
    tokens: list[str]
    activations: list[float]


class OANeuronId(BaseModel):
    model_config = STRICT
    dataclass_name: Literal["NeuronId"]
    layer_index: int
    neuron_index: int


class OANeuronRecord(BaseModel):
    model_config = STRICT
    dataclass_name: Literal["NeuronRecord"]
    neuron_id: OANeuronId
    random_sample: list[OAActivationRecord] = []
    random_sample_by_quantile: list[list[OAActivationRecord]] | None = None
    quantile_boundaries: list[float] | None = None
    mean: float | None = math.nan
    variance: float | None = math.nan
    skewness: float | None = math.nan
    kurtosis: float | None = math.nan
    most_positive_activation_records: list[OAActivationRecord] = []


# -- the report -----------------------------------------------------------------------------------------------------
class Words:
    """A tokenizer-like object: token ``i`` reads `` w<i>``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f" w{i}" for i in ids)


def words(ids) -> list[str]:
    return [f" w{i}" for i in ids]


@pytest.fixture(scope="module")
def model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def report(model):
    """Neurons 5, 0, 7 of layer 1, then a random and a zero (dead) direction at layer 0's output."""
    torch.manual_seed(1)
    directions = torch.stack([torch.randn(16), torch.zeros(16)])
    units = [Neurons(1, indices=[5, 0, 7]), Directions(directions, "model.layers.0")]
    tokens = torch.randint(3, 50, (8, 12))
    return feature_statistics(
        model, tokens, units, tokenizer=Words(), k=4, bands=3, samples=2, context=(3, 2), progress=False
    )


def test_the_report_has_the_units_the_tests_expect(report):
    assert report.labels == ["L1/N5", "L1/N0", "L1/N7", "D0", "D1"]
    assert report.dead == [4]


def hand_logits(model, neuron: int) -> torch.Tensor:
    """Neuron ``neuron`` of layer 1 through the final RMSNorm's gain and the unembedding, in float64."""
    write = model.model.layers[1].mlp.down_proj.weight[:, neuron].double()
    return model.lm_head.weight.double() @ (model.model.norm.weight.double() * write)


# -- circuit-tracer -------------------------------------------------------------------------------------------------
def test_circuit_tracer_files_are_named_by_cantor_pairs_and_dead_units_get_none(report, tmp_path):
    paths = ex.to_circuit_tracer(report, tmp_path)
    # (layer, index): L1/N5 -> 6*7/2 + 5 = 26, L1/N0 -> 1, L1/N7 -> 8*9/2 + 7 = 43, D0 (layer 0, row 0) -> 0; D1 dead
    assert [p.name for p in paths] == ["26.json", "1.json", "43.json", "0.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.json", "1.json", "26.json", "43.json"]  # no temp files
    for path in paths:
        text = path.read_text()
        parsed = CTModel.model_validate_json(text)
        assert parsed.model_dump() == json.loads(text)  # round trip: nothing dropped, nothing added


def test_circuit_tracer_top_example_values_tokens_and_stats(report, tmp_path):
    data = json.loads(ex.to_circuit_tracer(report, tmp_path)[0].read_text())
    top = report.top(0)
    assert data["index"] == 5
    assert data["transcoder_id"] == "model.layers.1.mlp.down_proj"
    first = data["examples_quantiles"][0]
    assert first["quantile_name"] == "Top activations"
    assert len(first["examples"]) == len(top) == 4
    best = first["examples"][0]
    assert best["tokens_acts_list"][best["train_token_ind"]] == data["act_max"] == float(report.max[0])
    assert best["tokens"] == words(top[0].tokens)
    assert best["is_repeated_datapoint"] is False
    values = [e["tokens_acts_list"][e["train_token_ind"]] for e in first["examples"]]
    assert values == sorted(values, reverse=True) == [e.value for e in top]
    assert data["act_min"] == float(report.min[0])
    assert data["activation_frequency"] == float(report.density[0])
    assert len(data["quantile_values"]) == 100
    assert data["quantile_values"] == sorted(data["quantile_values"])
    assert data["quantile_values"][-1] == pytest.approx(float(report.max[0]), rel=0.02)  # the sketch's accuracy
    assert sum(data["histogram"]) == int(report.histogram(0)[1].sum())


def test_circuit_tracer_bands_come_highest_first_and_hold_their_values(report, tmp_path):
    data = json.loads(ex.to_circuit_tracer(report, tmp_path)[0].read_text())
    edges = report.band_edges(0)
    bands = report.bands(0)
    groups = data["examples_quantiles"][1:]
    expected = [j for j in reversed(range(3)) if bands[j]]
    assert [g["quantile_name"] for g in groups] == [
        f"Interval {j + 1} of 3: ({edges[j]:.4g}, {edges[j + 1]:.4g}]" for j in expected
    ]
    assert len(groups) >= 2
    for j, group in zip(expected, groups, strict=True):
        for e in group["examples"]:
            assert edges[j] < e["tokens_acts_list"][e["train_token_ind"]] <= edges[j + 1]
    # an example shown among the top ones and again in a band is marked as repeated
    top = {(e.document, e.position) for e in report.top(0)}
    flags = [(e.document, e.position) in top for j in expected for e in bands[j]]
    assert [e["is_repeated_datapoint"] for g in groups for e in g["examples"]] == flags


def test_circuit_tracer_logits_are_the_hand_computed_ones_in_order(report, model, tmp_path):
    data = json.loads(ex.to_circuit_tracer(report, tmp_path, logits=5)[0].read_text())
    logits = hand_logits(model, 5)
    assert data["top_logits"] == words(logits.argsort(descending=True)[:5].tolist())
    assert data["bottom_logits"] == words(logits.argsort()[:5].tolist())


@pytest.mark.peers
def test_circuit_tracer_reads_the_files_with_its_own_model(report, tmp_path):
    models = pytest.importorskip("circuit_tracer.frontend.feature_models")
    for path in ex.to_circuit_tracer(report, tmp_path):
        models.Model(**json.loads(path.read_text()))


# -- Neuronpedia ----------------------------------------------------------------------------------------------------
def read_jsonl_gz(path) -> list[str]:
    return gzip.decompress(path.read_bytes()).decode().splitlines()


def test_neuronpedia_export_layout_and_schema(report, tmp_path):
    paths = ex.to_neuronpedia(report, tmp_path, model_id="tiny-llama")
    rel = [p.relative_to(tmp_path).as_posix() for p in paths]
    assert rel == [
        "tiny-llama/1-hookscope-neurons/features/batch-0.jsonl.gz",
        "tiny-llama/1-hookscope-neurons/activations/batch-0.jsonl.gz",
        "tiny-llama/0-hookscope-directions/features/batch-0.jsonl.gz",
        "tiny-llama/0-hookscope-directions/activations/batch-0.jsonl.gz",
    ]
    features = {p.parent.parent.name: read_jsonl_gz(p) for p in paths if p.parent.name == "features"}
    activations = {p.parent.parent.name: read_jsonl_gz(p) for p in paths if p.parent.name == "activations"}
    assert [json.loads(line)["index"] for line in features["1-hookscope-neurons"]] == ["5", "0", "7"]
    assert [json.loads(line)["index"] for line in features["0-hookscope-directions"]] == ["0"]  # D1 is dead
    for line in (line for lines in features.values() for line in lines):
        assert NPFeature.model_validate_json(line).model_dump(exclude_unset=True) == json.loads(line)
    ids = set()
    for line in (line for lines in activations.values() for line in lines):
        assert NPActivation.model_validate_json(line).model_dump(exclude_unset=True) == json.loads(line)
        ids.add(json.loads(line)["id"])
    assert len(ids) == sum(len(lines) for lines in activations.values())  # row ids are unique
    # the same report exports to the same bytes (ids are digests, gzip without a time stamp)
    again = ex.to_neuronpedia(report, tmp_path / "again", model_id="tiny-llama")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]


def test_neuronpedia_feature_and_activation_values(report, model, tmp_path):
    paths = ex.to_neuronpedia(report, tmp_path, model_id="tiny-llama", source_set="res-x")
    feature = json.loads(read_jsonl_gz(paths[0])[0])
    rows = [json.loads(line) for line in read_jsonl_gz(paths[1])]
    assert (feature["modelId"], feature["layer"], feature["index"]) == ("tiny-llama", "1-res-x", "5")
    assert feature["maxActApprox"] == float(report.max[0])
    assert feature["frac_nonzero"] == float(report.density[0])
    logits = hand_logits(model, 5)
    assert feature["pos_str"] == words(logits.argsort(descending=True)[:10].tolist())
    assert feature["neg_str"] == words(logits.argsort()[:10].tolist())
    assert feature["pos_values"] == sorted(feature["pos_values"], reverse=True)
    assert feature["neg_values"] == sorted(feature["neg_values"])
    torch.testing.assert_close(torch.tensor(feature["neg_values"]), logits.sort().values[:10].float())
    edges, counts = report.histogram(0)
    assert feature["freq_hist_data_bar_heights"] == counts.double().tolist()
    assert feature["freq_hist_data_bar_values"][0] == pytest.approx(float(edges[0] + edges[1]) / 2)

    unit = [r for r in rows if r["index"] == "5"]
    top = report.top(0)
    bands = report.bands(0)
    assert len(unit) == len(top) + sum(len(b) for b in bands)
    best = unit[0]
    assert best["values"][best["qualifyingTokenIndex"]] == best["maxValue"] == float(report.max[0])
    assert best["maxValueTokenIndex"] == best["qualifyingTokenIndex"]
    assert best["tokens"] == words(top[0].tokens)
    assert best["dataIndex"] == str(top[0].document)
    assert (best["binMin"], best["binMax"], best["binContains"]) == (-1, float(report.max[0]), -1)
    banded = unit[len(top) :]
    assert [r["binMax"] for r in banded] == sorted((r["binMax"] for r in banded), reverse=True)  # highest band first
    for r in banded:
        assert r["binMin"] < r["values"][r["qualifyingTokenIndex"]] <= r["binMax"]
    shares = {r["binMax"]: r["binContains"] for r in banded}
    assert all(0 < s <= 1 for s in shares.values())
    total = ex._band_shares(report, 0, report.band_edges(0))
    assert sum(total) == pytest.approx(1.0)


def test_neuronpedia_needs_a_well_formed_model_id(report, tmp_path):
    with pytest.raises(ValueError, match="`model_id` must be letters"):
        ex.to_neuronpedia(report, tmp_path, model_id="my model/v1")
    with pytest.raises(TypeError, match="model_id"):
        ex.to_neuronpedia(report, tmp_path)


# -- OpenAI NeuronRecord --------------------------------------------------------------------------------------------
def test_neuron_record_follows_the_dataclass_and_holds_the_report(report):
    record = ex.neuron_record(report, "L1/N7")
    text = json.dumps(record)
    parsed = OANeuronRecord.model_validate_json(text)
    assert json.dumps(parsed.model_dump(), sort_keys=True) == json.dumps(record, sort_keys=True)
    assert record["neuron_id"] == {"dataclass_name": "NeuronId", "layer_index": 1, "neuron_index": 7}
    top = report.top(2)
    first = record["most_positive_activation_records"][0]
    assert max(first["activations"]) == float(report.max[2])
    assert first["tokens"] == words(top[0].tokens)
    assert len(record["most_positive_activation_records"]) == len(top)
    assert record["quantile_boundaries"] == report.band_edges(2, "rank")
    assert len(record["random_sample_by_quantile"]) == 3
    for j, band in enumerate(record["random_sample_by_quantile"]):  # lowest band first
        lo, hi = record["quantile_boundaries"][j : j + 2]
        for rec, example in zip(band, report.bands(2, "rank")[j], strict=True):
            assert lo < rec["activations"][example.offset] <= hi
    quiet = report.non_activating(2)
    assert len(record["random_sample"]) == len(quiet)
    for rec, example in zip(record["random_sample"], quiet, strict=True):
        assert rec["activations"][example.offset] <= 0
    assert record["mean"] == float(report.mean[2])
    assert record["variance"] == float(report.variance[2])
    assert record["kurtosis"] == float(report.kurtosis[2])


def test_neuron_record_without_bands_has_none(report):
    bare = dataclasses.replace(report, band_samples=None)
    record = ex.neuron_record(bare, 0)
    assert record["random_sample_by_quantile"] is None
    assert record["quantile_boundaries"] is None
    OANeuronRecord.model_validate_json(json.dumps(record))


# -- refusals and writes --------------------------------------------------------------------------------------------
def test_units_outside_the_decoder_layers_are_refused(report, tmp_path):
    sources = [dict(s) for s in report.sources]
    sources[1]["layer"] = None
    sources[1]["module"] = "model.norm"
    moved = dataclasses.replace(report, sources=sources)
    with pytest.raises(ValueError, match=r"unit 'D0' is read at 'model.norm', which is not in a decoder layer"):
        ex.to_circuit_tracer(moved, tmp_path)
    with pytest.raises(ValueError, match="not in a decoder layer"):
        ex.to_neuronpedia(moved, tmp_path, model_id="m")
    with pytest.raises(ValueError, match="NeuronId names a layer_index"):
        ex.neuron_record(moved, "D0")
    assert ex.neuron_record(moved, 0)["neuron_id"]["neuron_index"] == 5  # only the unit that cannot be placed fails
    assert list(tmp_path.iterdir()) == []


def test_two_units_with_one_name_are_refused(report, tmp_path):
    sources = [dict(s) for s in report.sources]
    sources[1]["layer"] = 1
    sources[1]["indices"] = [0, 1]  # D0 would be layer 1 index 0, as L1/N0 is
    clash = dataclasses.replace(report, sources=sources)
    with pytest.raises(ValueError, match=r"units 'L1/N0' and 'D0' would be the same file '1.json'"):
        ex.to_circuit_tracer(clash, tmp_path)
    ex.to_neuronpedia(clash, tmp_path, model_id="m")  # different source sets by kind: no clash
    with pytest.raises(ValueError, match="would be the same feature '1-s/0'"):
        ex.to_neuronpedia(clash, tmp_path, model_id="m", source_set="s")


def test_bad_arguments_say_what_was_expected(report, tmp_path):
    with pytest.raises(TypeError, match="`report` must be a UnitReport"):
        ex.to_circuit_tracer({"labels": []}, tmp_path)
    with pytest.raises(ValueError, match=r"`logits` must be an integer in \[0, 20\]"):
        ex.to_circuit_tracer(report, tmp_path, logits=21)
    with pytest.raises(ValueError, match="report's `sources` name 0 units, but it has 5"):
        ex.neuron_record(dataclasses.replace(report, sources=[]), 0)
    with pytest.raises(KeyError, match="no unit is labelled 'L9/N9'"):
        ex.neuron_record(report, "L9/N9")


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(report, tmp_path, monkeypatch):
    path = ex.to_circuit_tracer(report, tmp_path)[0]
    before = path.read_bytes()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(ex.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        ex.to_circuit_tracer(report, tmp_path, transcoder_id="other")
    assert path.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
