"""Blackjack GRPO on the tiny Qwen3 model: the main job, as a script.

    python examples/blackjack_grpo.py --out runs/blackjack [--budget quick] \
        [--env openenv | --sandbox local|e2b]

The same as `plies demo blackjack`; the code lives in `plies.demo_blackjack` so that the
command works from an installed package. Read that module for the loop: the warm start,
GRPO with explicit advantages, `training_groups`, publication, resume.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plies.demo_blackjack import BUDGETS, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/blackjack"))
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="default")
    parser.add_argument("--env", choices=["local", "openenv"], default="local")
    parser.add_argument("--sandbox", choices=["none", "local", "e2b"], default="none")
    args = parser.parse_args()
    raise SystemExit(main(args.out, budget=args.budget, env=args.env, sandbox=args.sandbox))
