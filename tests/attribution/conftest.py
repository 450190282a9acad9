"""Fixtures the attribution tests share."""

import warnings

import pytest


@pytest.fixture
def no_warnings():
    """Any warning raised inside the test is an error (for calls that must stay silent)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
