"""Public objects named after the package that exports them, not the private module that
defines them: reprs, tracebacks and docs then show `plies.runtime.EnvPool`, a path users can
import, and files can move inside a package without changing what users see."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

__all__ = ["name_after"]


def name_after(package: str, namespace: Mapping[str, Any]) -> None:
    """Set `__module__` to `package` on each class and function of `namespace["__all__"]`
    that a module inside `package` defines.

    Constants, instances and type aliases keep what they have (most cannot take the
    attribute), and so do names re-exported from elsewhere: they belong to the package that
    defines them, whichever imports them first.
    """
    prefix = package + "."
    for name in namespace["__all__"]:
        obj = namespace[name]
        defined_here = getattr(obj, "__module__", "").startswith(prefix)
        if defined_here and (inspect.isclass(obj) or inspect.isfunction(obj)):
            obj.__module__ = package
