"""Progress bars appear only on calls that run for more than a second."""

from __future__ import annotations

import torch

from attribution import _progress, activation_patching


def test_a_quick_sweep_prints_no_bar_even_with_progress_on(capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    activation_patching(model, clean, corrupted, ["0", "1"], lambda out: out[:, -1].mean(), progress=True)
    assert "activation patching" not in capsys.readouterr().err


def test_the_bar_shows_once_the_delay_has_passed_and_never_when_disabled(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    assert list(_progress.progress(range(3), desc="long call", enabled=True)) == [0, 1, 2]
    assert "long call" in capsys.readouterr().err
    assert list(_progress.progress(range(3), desc="long call", enabled=False)) == [0, 1, 2]
    assert "long call" not in capsys.readouterr().err
