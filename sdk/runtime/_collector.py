"""Python's cyclic collector set for a long run: loaded state frozen, young objects kept longer.

With transformers, jinja and a tokenizer loaded, the heap holds hundreds of thousands of
objects, and every full collection scans all of them. At Python's default thresholds that is
the worst stall of a rollout loop and a quarter of a turn's CPU (docs/scaling.md, "gc", where
`bench/rollout_bench.py --gc-threshold` prints both settings side by side). Freezing what is
loaded takes it out of every later scan, and a higher first threshold lets an episode's
short-lived objects die young instead of being promoted into the generations a full
collection scans.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["YOUNG_THRESHOLD", "long_run_collector"]

YOUNG_THRESHOLD = 20_000
"""Allocations between young collections (Python's default is 700)."""


@contextmanager
def long_run_collector() -> Iterator[None]:
    """Freeze what is loaded now and raise the young threshold until the block ends.

    The threshold in force before is put back on the way out, so a notebook that runs a loop
    keeps its own settings afterwards. The freeze stays: what was loaded before the run
    outlives it, and unfreezing would undo a freeze made by someone else.
    """
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, previous[1], previous[2])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
