"""Where a published policy's files are, for engines that read them from a shared disk."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from .._exceptions import ConfigError
from ..trajectory import PolicyRef

__all__ = ["policy_path"]


def policy_path(policy: PolicyRef) -> Path:
    """The local directory of a policy with a `file://` URI.

    Raises:
        ConfigError: the URI is not a local file URI.
    """
    parsed = urlparse(policy.uri)
    if parsed.scheme != "file":
        raise ConfigError(
            f"policy {policy.uri} is not a file:// URI; pass the directory the engines can read"
        )
    return Path(unquote(parsed.path))
