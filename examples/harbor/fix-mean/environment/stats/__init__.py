"""Small statistics helpers."""

from .core import mean, total

__all__ = ["mean", "total"]
