"""Progress bars appear only on calls that run for more than a second, and only where stderr is a terminal."""

from __future__ import annotations

import io
import sys

import torch

from attribution import _progress, activation_patching, attribute_dataset
from attribution.datasets import runner


class Terminal(io.StringIO):
    """A stderr that says it is a terminal and keeps what is written."""

    def isatty(self) -> bool:
        return True


def test_a_quick_sweep_prints_no_bar_even_with_progress_on(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    clean, corrupted = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    activation_patching(model, clean, corrupted, ["0", "1"], lambda out: out[:, -1].mean(), progress=True)
    assert "activation patching" not in terminal.getvalue()


def test_on_a_terminal_the_bar_shows_once_the_delay_has_passed_and_never_when_disabled(monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    shown, hidden = Terminal(), Terminal()
    monkeypatch.setattr(sys, "stderr", shown)
    assert list(_progress.progress(range(3), desc="long call", enabled=True)) == [0, 1, 2]
    monkeypatch.setattr(sys, "stderr", hidden)
    assert list(_progress.progress(range(3), desc="long call", enabled=False)) == [0, 1, 2]
    assert "long call" in shown.getvalue()
    assert hidden.getvalue() == ""


def test_a_redirected_stderr_gets_no_bar_even_when_one_is_asked_for(capfd, monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    assert not sys.stderr.isatty()
    assert list(_progress.progress(range(3), desc="long call", enabled=True)) == [0, 1, 2]
    assert capfd.readouterr().err == ""


def test_the_dataset_runner_draws_no_bar_into_a_redirected_stderr(capfd, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "DELAY", 0.0)
    attribute_dataset(lambda x, t: x.mean(1), torch.rand(6, 3, 4, 4), tmp_path / "plain", batch_size=4, progress=True)
    assert capfd.readouterr().err == ""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # the same run on a terminal shows its bar
    attribute_dataset(lambda x, t: x.mean(1), torch.rand(6, 3, 4, 4), tmp_path / "tty", batch_size=4, progress=True)
    assert "attribute_dataset" in terminal.getvalue()


def test_a_notebook_shows_its_widget_bar_whatever_stderr_is(monkeypatch):
    monkeypatch.setattr(_progress, "NOTEBOOK", True)
    assert _progress.shown(True, io.StringIO())
    assert not _progress.shown(False, io.StringIO())
