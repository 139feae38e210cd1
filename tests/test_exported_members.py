"""The public surface is explicit: each package's `__all__` is exactly its public names.

In the style of httpx's `tests/test_exported_members.py`: a name that a package exposes but does
not list, or lists but does not have, fails here; so does a public object whose `__module__`
still names a private module (reprs and tracebacks would show the private path).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import plies

PACKAGES = [
    "plies",
    "plies.environments",
    "plies.gateway",
    "plies.harness",
    "plies.policy",
    "plies.recipes.blackjack",
    "plies.rl",
    "plies.runtime",
    "plies.server",
    "plies.testing",
    "plies.tokens",
    "plies.training",
    "plies.view",
    "plies.wire",
]


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _public_names(module: object) -> set[str]:
    """What `from package import *` would offer if `__all__` did not exist: every public
    attribute except submodules (importing `plies.x.y` sets `y` on `plies.x`)."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_exactly_the_public_names(name):
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__, key=_isort_key)
    assert len(set(module.__all__)) == len(module.__all__)
    assert set(module.__all__) == _public_names(module)


@pytest.mark.parametrize("name", PACKAGES)
def test_exported_objects_name_a_public_module(name):
    module = importlib.import_module(name)
    for member in module.__all__:
        obj = getattr(module, member)
        origin = getattr(obj, "__module__", None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or origin is None:
            continue
        private = [part for part in origin.split(".") if part.startswith("_")]
        assert not private, f"{name}.{member} reports module {origin!r}"


def test_every_error_is_public():
    """Every error class plies defines is reachable as `plies.<Name>`, under `PliesError`
    or the misuse branch (`UsageError`)."""
    errors = importlib.import_module("plies._exceptions")
    defined = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__
        in (
            "plies._exceptions",
            "plies",
        )
    }
    assert defined <= set(plies.__all__), defined - set(plies.__all__)
    for name in defined:
        error = getattr(plies, name)
        assert issubclass(error, plies.PliesError | plies.UsageError), name


def test_public_names_report_the_public_module():
    assert plies.Trajectory.__module__ == "plies"
    assert plies.ToolError.__module__ == "plies"
    assert repr(plies.PolicyRef(uri="u", version=1)).startswith("PolicyRef(")
