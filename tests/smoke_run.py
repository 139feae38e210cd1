"""The one real demo run a session shares, made by the `demo_run` fixture (tests/conftest.py).

The tests that only read a finished run (the short demo's checks in tests/demo/test_demo.py,
`plies view` and `plies replay` in tests/view) read this one rather than each making its own:
a smoke run is a few minutes of the suite. Its options make every check there bite: two GRPO
policies kept of three published (so retention removed one), numbers changed by `--set`
(which run.json must record), nucleus sampling, so that `plies replay --train-only` re-feeds a
batch that carries its top_p, and the batch-invariant sampler, so that `plies replay` must get
every logprob back bit for bit (the default, batched sampler runs in the Ctrl-C tests).
"""

from __future__ import annotations

import os

import pytest

ARGS = (
    "--budget", "smoke", "--keep-policies", "2",
    "--set", "curve_hands=8", "--set", "top_p=0.99", "--sampler", "batch-invariant",
)  # fmt: skip
"""`plies demo blackjack` options of the shared run (its `--out` aside)."""
TIMEOUT = 1200
"""Seconds the smoke demo may take on a loaded 2-core machine (a few minutes when idle)."""
LOG = "demo.log"
"""The run's terminal output, beside its directory."""
REUSE = "PLIES_TEST_DEMO_RUN"
"""A finished run directory made with `ARGS` (its terminal output in `LOG` beside it) that the
session uses instead of making its own: for iterating on a loaded machine, where the demo
takes tens of minutes. Unset (as in CI), every session makes a fresh run. Tests only read it;
those that alter a run alter a copy."""
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
"""The environment `plies` subprocesses of the tests run in: offline."""

demo_test = pytest.mark.timeout(TIMEOUT + 300)
"""For a test that reads `demo_run`: the first one also waits for the demo."""
