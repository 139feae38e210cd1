"""`RunView`: a run directory turned into its page, again and again as the run grows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ._load import GroupEntry, RunReader
from ._page import CHUNK_BYTES, chunk_json, packed, render_page, run_index
from ._tokens import TokenTable, find_tokenizer

__all__ = ["RunView", "write_page"]


def _ids(entry: GroupEntry) -> Iterator[int]:
    for traj in entry.group.trajectories:
        for turn in traj.turns:
            yield from turn.prompt_ids
            yield from turn.completion_ids


class RunView:
    """The page of one run directory; each `page()` reads and encodes only what is new.

    Args:
        run_dir: the run directory (`groups.jsonl`, `metrics.jsonl`, `summary.json`, ...).
        tokenizer: a tokenizer directory; None: the one the run's policies were published
            with, found in the run directory.

    Example::

        html = RunView(Path("runs/blackjack")).page()
    """

    def __init__(self, run_dir: Path, *, tokenizer: Path | None = None):
        self.run_dir = Path(run_dir)
        self._reader = RunReader(self.run_dir)
        self._given = tokenizer
        self._tokens: TokenTable | None = None
        self._elements: dict[tuple[int, str], str] = {}
        self._packs: dict[tuple[tuple[int, str], ...], str] = {}

    def page(self, *, live: bool = False, stamp: str = "") -> str:
        """The page as the run directory holds it now.

        Args:
            live: the page polls its server for changes (`serve_live`).
            stamp: the files' stamp this page was read at, which the page polls against.
        """
        snap = self._reader.refresh(live=live)
        tokens = self._tokens
        fresh = tokens is None or not (tokens.loaded or self._given)
        if tokens is None or fresh:
            tokens = self._tokens = self._token_table(snap.groups)
        elements: dict[tuple[int, str], str] = {}
        for entry in snap.groups:
            key = (entry.line, entry.group.id)
            element = self._elements.get(key)
            if element is None or fresh:
                tokens.add(_ids(entry))  # a table loaded just now decodes every group's ids
            elements[key] = element if element is not None else chunk_json(entry.group)
        self._elements = elements
        chunks, places = self._chunks_of(list(elements.items()))
        index = run_index(snap, tokens, places, live=live, stamp=stamp)
        return render_page(index, tokens.texts, chunks)

    def _chunks_of(
        self, elements: list[tuple[tuple[int, str], str]]
    ) -> tuple[list[str], list[tuple[int, int]]]:
        """Consecutive groups packed into chunks of about `CHUNK_BYTES`; each chunk is
        compressed once and reused while its groups stay the same (a live run appends)."""
        chunks: list[str] = []
        places: list[tuple[int, int]] = []
        packs: dict[tuple[tuple[int, str], ...], str] = {}
        run: list[tuple[tuple[int, str], str]] = []
        size = 0

        def close() -> None:
            nonlocal run, size
            keys = tuple(k for k, _ in run)
            text = self._packs.get(keys) or packed("[" + ",".join(e for _, e in run) + "]")
            packs[keys] = text
            chunks.append(text)
            run, size = [], 0

        for key, element in elements:
            places.append((len(chunks), len(run)))
            run.append((key, element))
            size += len(element)
            if size >= CHUNK_BYTES:
                close()
        if run:
            close()
        self._packs = packs
        return chunks, places

    def _token_table(self, groups: list[GroupEntry]) -> TokenTable:
        """Load the tokenizer; while a run has none yet, look again at the next page."""
        if self._given is not None:
            table = TokenTable.load(self._given, given=True)
        else:
            policies = {g.group.policy for g in groups[:1]}
            table = TokenTable.load(find_tokenizer(self.run_dir, policies), given=False)
        return table


def write_page(run_dir: Path, out: Path, *, tokenizer: Path | None = None) -> Path:
    """Write the run's page to `out` and return it."""
    out.write_text(RunView(run_dir, tokenizer=tokenizer).page(), encoding="utf-8")
    return out
