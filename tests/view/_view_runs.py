"""A run directory written the way a run writes one, with as many turns as a test asks for.

The records are real `Group`s written by `JsonlSink`, and the ids are the Qwen3 tokenizer's
encoding of real text, so the page decodes them as it would a real run's. Every kind of mark
the page shows occurs: fallbacks (a full re-render), ill-formed turns, failed and truncated
members, a refused group, quarantined leases.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from plies import Group, PolicyRef, Status, Trajectory, Turn
from plies.runtime import JsonlSink

SYSTEM = "You play Blackjack. Reply with exactly one tool call: hit or stand. " * 12
TOOL_CALL = '<tool_call>\n{"name": "hit", "arguments": {}}\n</tool_call>'


def write_run(out: Path, tokenizer, *, groups: int, size: int, turns: int, seed: int = 0) -> Path:
    """Write `groups` groups of `size` members of `turns` turns each into `out`."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    system = tokenizer.encode(SYSTEM)
    delta = tokenizer.encode("<|im_end|>\n<|im_start|>user\nYour cards: 10, 3 (total 13).")
    call = tokenizer.encode(TOOL_CALL)
    policies = [PolicyRef(uri=f"plies://synthetic/policies/{v}", version=v) for v in range(4)]
    steps: list[dict] = []
    with JsonlSink(out / "groups.jsonl") as sink:
        for g in range(groups):
            step = g // 2
            policy = policies[min(step // 40, 3)]
            group = Group(id=f"train-{g}", task_id=f"train-{g}", size=size, policy=policy)
            for m in range(size):
                traj = Trajectory(task_id=group.task_id, group_id=group.id)
                for k in range(turns):
                    fallback = k > 0 and (g + m + k) % 7 == 0
                    prompt = system + delta if k == 0 or fallback else delta
                    traj.turns.append(
                        Turn(
                            prompt_ids=prompt,
                            extends=k > 0 and not fallback,
                            completion_ids=call,
                            logprobs=[-rng.random() * 3 for _ in call],
                            finish_reason="stop",
                            policy=policy,
                            ill_formed=(g * size + m + k) % 13 == 0,
                            fallback="template_not_prefix" if fallback else None,
                        )
                    )
                status = Status.COMPLETED
                if (g + m) % 41 == 0:
                    status = Status.FAILED
                elif (g + m) % 29 == 0:
                    status = Status.TRUNCATED
                info = {"stop_reason": "done" if status is Status.COMPLETED else "max_turns"}
                if g == 3 and m == 1:
                    status = Status.QUARANTINED
                    info["quarantined_leases"] = [
                        {"lease": "l-1", "kind": "env", "remote_id": "sbx-9", "reason": "hung"}
                    ]
                reward = (
                    None
                    if status in (Status.FAILED, Status.QUARANTINED)
                    else rng.choice((-1.0, 0.0, 1.0))
                )
                traj.settle(status, reward=reward, info=info)
                group.trajectories.append(traj)
            sink.write_group(group)
            if g % 2 == 1:
                ids = [f"train-{g - 1}", f"train-{g}"]
                refused = [f"{i}: failed_member" for i in ids if i == "train-3"]
                steps.append(
                    {
                        "kind": "step", "time": 0.0, "step": step,
                        "policy": policy.model_dump(), "groups": ids,
                        "trainable": 2 - len(refused), "refused": refused,
                        "train_return": rng.uniform(-1, 1), "loss": rng.random(),
                    }
                )  # fmt: skip
    evals = [
        {"kind": "eval", "time": 0.0, "label": "curve", "step": s, "policy": 1,
         "return": -0.4 + s / 400, "hands": 200, "stderr": 0.05}
        for s in range(0, groups // 2 + 1, 25)
    ]  # fmt: skip
    with (out / "metrics.jsonl").open("w") as f:
        for record in [*steps, *evals]:
            f.write(json.dumps(record) + "\n")
    strategy = {f"hard {t}": {str(up): "stand" if t >= 17 else "hit" for up in range(2, 12)}
                for t in range(12, 18)}  # fmt: skip
    summary = {
        "final_return": evals[-1]["return"], "grpo_steps": len(steps), "complete": True,
        "strategy": strategy,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "run.json").write_text(json.dumps({"config": {"synthetic": True}}))
    return out
