"""The run's tokenizer, found in the run directory, and the text of each token id it used.

A run records which weights sampled each turn (`PolicyRef.uri`); the reference server
publishes every policy as a Hugging Face directory with its tokenizer beside the weights
(`server/policies/N/`). So the tokenizer that produced a run's ids is normally in the run
directory already; `--tokenizer` overrides it (a run sampled by another server).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from plies import PolicyRef

__all__ = ["TokenTable", "find_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _policy_dir(policy: PolicyRef) -> Path | None:
    url = urlparse(policy.uri)
    return Path(unquote(url.path)) if url.scheme == "file" else None


def find_tokenizer(run_dir: Path, policies: Iterable[PolicyRef]) -> Path | None:
    """The first folder with a tokenizer: a policy's own directory, else the run's copies.

    The run directory's `server/policies/*` come second so that a run moved to another place
    (its recorded `file://` URIs now dangling) still finds its tokenizer.
    """
    seen: set[Path] = set()
    candidates = [d for p in policies if (d := _policy_dir(p)) is not None]
    published = run_dir / "server" / "policies"
    if published.is_dir():
        candidates += sorted(
            (d for d in published.iterdir() if d.name.isdigit()), key=lambda d: int(d.name)
        )
    for folder in candidates:
        if folder not in seen and folder.is_dir() and _has_tokenizer(folder):
            return folder
        seen.add(folder)
    return None


Decode = Callable[[list[list[int]]], list[str]]
"""Decodes a batch of id sequences, special tokens kept."""


def _decoder(folder: Path) -> tuple[Decode, int]:
    """A batch decoder for the tokenizer in `folder`, and its vocabulary size.

    A `tokenizer.json` loads with `tokenizers` alone, in a fraction of the time importing
    transformers takes; anything else goes through `AutoTokenizer`.
    """
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(folder / "tokenizer.json"))

        def decode(batch: list[list[int]]) -> list[str]:
            return fast.decode_batch(batch, skip_special_tokens=False)

        return decode, fast.get_vocab_size(with_added_tokens=True)
    from transformers import AutoTokenizer  # heavy: only for tokenizers without the JSON

    slow = AutoTokenizer.from_pretrained(folder)
    return slow.batch_decode, len(slow)


@dataclass(slots=True)
class TokenTable:
    """Token id -> the text it decodes to, for the ids a page shows (each decoded once).

    Without a tokenizer the table is empty and the page shows ids; `problem` says why.
    """

    decode: Decode | None
    vocab_size: int
    source: str | None
    problem: str | None = None
    texts: dict[int, str] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        return self.decode is not None

    @classmethod
    def load(cls, folder: Path | None, *, given: bool) -> TokenTable:
        """Load the tokenizer in `folder`; a failure is a `problem`, never an exception."""
        if folder is None:
            return cls(
                None, 0, None, "no tokenizer in the run directory: pass --tokenizer DIR to decode"
            )
        try:
            decode, size = _decoder(folder)
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            origin = "--tokenizer" if given else "the run's tokenizer"
            return cls(None, 0, str(folder), f"{origin} {folder} does not load: {exc}")
        return cls(decode, size, str(folder))

    def add(self, ids: Iterable[int]) -> None:
        """Decode the ids not seen before (one batch call, O(new ids))."""
        if self.decode is None:
            return
        new = sorted({i for i in ids if i not in self.texts and 0 <= i < self.vocab_size})
        if new:
            self.texts.update(zip(new, self.decode([[i] for i in new]), strict=True))
