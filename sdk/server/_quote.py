"""Quoting client input back in error messages, bounded.

An error names what was wrong, often by quoting it: a model id, a session id, a path. The
client chose that text and its length (a body may hold a megabyte, once decompressed), so
every quote goes through `quoted`, and every message through `bounded` as a last stop.
"""

from __future__ import annotations

__all__ = ["MAX_MESSAGE_CHARS", "MAX_QUOTE_CHARS", "bounded", "quoted"]

MAX_QUOTE_CHARS = 80
"""The most characters of one client value an error quotes (ids are far shorter)."""
MAX_MESSAGE_CHARS = 2000
"""The most characters of any error message answered."""


def quoted(value: object) -> str:
    """`repr(value)`, cut to `MAX_QUOTE_CHARS` with its full length said when it was longer."""
    text = repr(value)
    if len(text) <= MAX_QUOTE_CHARS:
        return text
    size = len(value) if isinstance(value, str | bytes) else len(text)
    return f"{text[:MAX_QUOTE_CHARS]}... ({size} characters)"


def bounded(message: str) -> str:
    """`message`, cut to `MAX_MESSAGE_CHARS`."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
