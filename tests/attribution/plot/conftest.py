"""Every plotting test fails if a plotting function calls ``plt.show()``."""

import matplotlib.pyplot as plt
import pytest


@pytest.fixture(autouse=True)
def no_show(monkeypatch):
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("a plotting function called plt.show()"))
