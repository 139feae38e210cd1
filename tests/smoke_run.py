"""How the tests that run `plies demo blackjack` run it: the smoke budget, with a shorter
warm start.

Those tests check what a run records, resumes, shows and replays, not how well it plays. The
warm start is most of a smoke run's time (100 steps: 157 s of 222 natively, 242 s of 310 on
the Tinker API, on a loaded 2-core machine); 50 steps leave its loss at 0.15 against 0.06, a
format good enough that GRPO's groups are not all ill-formed. A resumed run passes the same
`--set`, as a resume must.
"""

from __future__ import annotations

WARM_STEPS = 50

SMOKE = ("--budget", "smoke", "--set", f"warm_steps={WARM_STEPS}")
"""The demo's options for a smoke run in tests."""
