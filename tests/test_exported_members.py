"""The public surface is explicit: every package's `__all__` is sorted and importable."""

from __future__ import annotations

import importlib

import pytest

PACKAGES = [
    "plies",
    "plies.environments",
    "plies.gateway",
    "plies.harness",
    "plies.policy",
    "plies.runtime",
    "plies.server",
    "plies.tokens",
    "plies.training",
]


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name):
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__, key=_isort_key)
    assert len(set(module.__all__)) == len(module.__all__)
    for member in module.__all__:
        assert hasattr(module, member), member


def test_public_names_report_the_public_module():
    import plies

    assert plies.Trajectory.__module__ == "plies"
    assert repr(plies.PolicyRef(uri="u", version=1)).startswith("PolicyRef(")
