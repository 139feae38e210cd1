"""The public surface is explicit: every package's `__all__` is sorted and importable."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = ["plies"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name):
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    for member in module.__all__:
        assert hasattr(module, member), member


def test_public_names_report_the_public_module():
    import plies

    assert plies.Trajectory.__module__ == "plies"
    assert repr(plies.PolicyRef(uri="u", version=1)).startswith("PolicyRef(")
