"""examples/attribution_graph.py's helpers: the words that say why the real change and the graph's prediction differ."""

from __future__ import annotations

import importlib

import torch

example = importlib.import_module("examples.attribution_graph")  # imports SmolLM2 only when run


def test_the_check_names_the_attention_sink_when_ablated_neurons_sit_at_the_first_position(llama_graph):
    neurons = llama_graph.nodes.where("neuron")
    first = neurons[llama_graph.nodes.position[neurons] == 0][:3]
    later = neurons[llama_graph.nodes.position[neurons] > 0][:7]
    words = example.why_they_differ(llama_graph, torch.cat([first, later]))
    assert words.startswith("the graph freezes attention and norms, the real model does not: ")
    assert "3 of these 10 neurons are at the first position\n  (the attention sink" in words
    assert words.endswith("ablating them breaks the attention of every later layer")
    assert len(words.splitlines()) == 2


def test_without_first_position_neurons_only_the_frozen_attention_is_named(llama_graph):
    neurons = llama_graph.nodes.where("neuron")
    words = example.why_they_differ(llama_graph, neurons[llama_graph.nodes.position[neurons] > 0][:10])
    assert "sink" not in words
    assert (
        words
        == "the graph freezes attention and norms, the real model does not: the gap is what the frozen model leaves out"
    )
