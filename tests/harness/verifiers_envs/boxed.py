"""A verifiers environment of the package's own pieces, for tests/harness/test_verifiers.py.

`vf.SingleTurnEnv` scored by verifiers' shipped `vf.MathRubric` (math-verify, in a worker
process of its own), on an in-memory dataset. With `group_reward`, the rubric also ranks the
members of a group, which plies refuses when the harness starts.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def load_environment(group_reward: bool = False) -> vf.Environment:
    rows = [{"question": "What is 6 * 7? Put the answer in \\boxed{}.", "answer": "42"}]
    rubric = vf.MathRubric()
    if group_reward:

        def shortest(completions) -> list[float]:
            """1.0 for the shortest answer of the group."""
            sizes = [len(str(c[-1].content)) for c in completions]
            return [float(s == min(sizes)) for s in sizes]

        rubric.add_reward_func(shortest)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
