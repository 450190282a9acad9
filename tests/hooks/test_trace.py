"""trace(): every module call of one forward, in start order, with shapes; hooks removed afterwards."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from hooks import trace
from tests.support import hook_state


def _resnet18_calls_in_completion_order() -> list[str]:
    """The 75 module calls the module-traversal post lists for resnet18 (children before parents)."""
    calls = ["conv1", "bn1", "relu", "maxpool"]
    for layer in range(1, 5):
        for block in range(2):
            p = f"layer{layer}.{block}"
            calls += [f"{p}.conv1", f"{p}.bn1", f"{p}.relu", f"{p}.conv2", f"{p}.bn2"]
            if layer > 1 and block == 0:
                calls += [f"{p}.downsample.0", f"{p}.downsample.1", f"{p}.downsample"]
            calls += [f"{p}.relu", p]
        calls.append(f"layer{layer}")
    return [*calls, "avgpool", "fc"]


def test_resnet18_trace_lists_every_call_with_repeats(resnet18):
    before = hook_state(resnet18)
    result = trace(resnet18, torch.randn(1, 3, 64, 64))
    assert hook_state(resnet18) == before
    expected = _resnet18_calls_in_completion_order()
    assert len(result) == len(expected) == 75
    assert Counter(result.names) == Counter(expected)
    start = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer1.0", "layer1.0.conv1", "layer1.0.bn1"]
    assert result.names[:8] == start
    relu_calls = [c for c in result if c.name == "layer1.0.relu"]
    assert [c.call for c in relu_calls] == [0, 1] and relu_calls[0].depth == 2
    first = result[0]
    assert (first.type, first.input_shapes, first.output_shapes) == ("Conv2d", ((1, 3, 64, 64),), ((1, 64, 32, 32),))
    assert result[-1].output_shapes == ((1, 1000),) and result[-1].depth == 0
    assert [c.index for c in result] == list(range(75))
    assert "layer1.0.relu (call 1)" in str(result)


def test_trace_removes_hooks_when_forward_raises(tiny_cnn):
    before = hook_state(tiny_cnn)
    with pytest.raises(RuntimeError):
        trace(tiny_cnn, torch.randn(1, 4, 8, 8))  # wrong channel count
    assert hook_state(tiny_cnn) == before


def test_trace_keyword_inputs_and_no_grad():
    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, *, x):
            return self.lin(x)

    model = KW()
    result = trace(model, x=torch.randn(4, 2))
    assert result.names == ["lin"] and result[0].input_shapes == ((4, 2),)
    assert trace(nn.ReLU(), torch.randn(2)) == []
