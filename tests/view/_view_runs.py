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


HIT_STAND = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": text,
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }
    for name, text in (("hit", "Take another card."), ("stand", "End your turn."))
]
SYSTEM_PROMPT = "You play Blackjack. Reply with exactly one tool call: hit or stand."
RULES = (
    "Blackjack rules: aces count 1 or 11, face cards count 10. Get closer to 21 than the "
    "dealer without going over. The dealer draws until reaching 17 or more. Call `hit` to "
    "take a card or `stand` to end your turn. Win +1, draw 0, lose -1."
)
DEFAULT_SHAPE = {"steps": 45, "per_step": 8, "size": 16, "certain": 1054, "tied": 343}
"""The default budget's run as docs/research.md's clean run recorded it: 45 GRPO steps of 8
groups of 16, and the groups set aside on the way (1,054 certain, played as one member, and
343 tied): 1,757 groups, 12,302 episodes, about 20,000 turns."""


def write_default_size_run(out: Path, tokenizer, *, scale: float = 1.0, seed: int = 0) -> Path:
    """A run directory the size and shape of the default budget's, every episode distinct.

    Each group is one deal, rendered by the Qwen3 chat template with the Blackjack tools as
    the recipe renders it; each member hits a random number of times, every later turn a
    prompt delta; the format tokens of a call are sampled with certainty (logprob 0, as at
    top_p 0.8) and the decision token with a logprob of its own. `scale` shrinks it for
    quicker tests (0.1: a tenth of the groups).
    """
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    kw = {"tools": HIT_STAND, "add_generation_prompt": True, "enable_thinking": False}
    call = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    calls = {name: [*tokenizer.encode(call.format(name)), 151645] for name in ("hit", "stand")}
    decision = {name: ids.index(tokenizer.encode(f' "{name}')[-1]) for name, ids in calls.items()}
    shape = {k: max(1, round(v * scale)) if k not in ("size", "per_step") else v
             for k, v in DEFAULT_SHAPE.items()}  # fmt: skip
    policies = [PolicyRef(uri=f"plies://synthetic/policies/{v}", version=v) for v in range(47)]
    plan: list[tuple[int, int, str]] = []  # (step, members, why)
    extra = ["certain"] * shape["certain"] + ["tied"] * shape["tied"]
    rng.shuffle(extra)
    per_step_extra = len(extra) / shape["steps"]
    for step in range(shape["steps"]):
        for _ in range(round(per_step_extra * (step + 1)) - round(per_step_extra * step)):
            why = extra.pop()
            plan.append((step, 1 if why == "certain" else shape["size"], why))
        plan += [(step, shape["size"], "trained")] * shape["per_step"]
    steps: list[dict] = []
    trained: dict[int, list[str]] = {}
    with JsonlSink(out / "groups.jsonl") as sink:
        for step, members, why in plan:
            policy = policies[min(step + 1, 46)]
            deal = rng.randrange(10**9)
            player = [rng.randint(1, 10), rng.randint(1, 10)]
            up = rng.randint(1, 10)
            hand = f"Your cards: {player[0]}, {player[1]} (total {sum(player)})."
            opening = f"{RULES}\n\n{hand} The dealer shows {up}."
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": opening},
            ]
            prompt = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
            group = Group(
                id=f"train-{deal}", task_id=f"blackjack-{deal}", size=members, policy=policy
            )
            for _ in range(members):
                traj = Trajectory(task_id=group.task_id, group_id=group.id)
                hits = 0 if why == "certain" else rng.choice((0, 0, 1, 1, 2))
                cards, history = list(player), list(messages)
                for k in range(hits + 1):
                    move = "hit" if k < hits else "stand"
                    if k == 0:
                        ids = prompt
                    else:
                        card = rng.randint(1, 10)
                        cards.append(card)
                        shown = ", ".join(map(str, cards))
                        text = f"You draw {card}. Your cards: {shown} (total {sum(cards)})."
                        history.append({"role": "tool", "name": "hit", "content": text})
                        ids = tokenizer.encode(
                            f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
                        )  # fmt: skip
                    completion = calls[move]
                    lps = [0.0] * len(completion)
                    lps[decision[move]] = -rng.random() * 2
                    tool_call = {"type": "function", "function": {"name": move, "arguments": {}}}
                    message = {"role": "assistant", "content": "", "tool_calls": [tool_call]}
                    history.append(message)
                    traj.turns.append(
                        Turn(
                            prompt_ids=ids, extends=k > 0, completion_ids=completion,
                            logprobs=lps, finish_reason="stop", policy=policy,
                            message=message, latency_s=rng.uniform(0.05, 0.6),
                        )
                    )  # fmt: skip
                dealer = [up, rng.randint(1, 10)]
                reward = rng.choice((-1.0, -1.0, 0.0, 1.0))
                end = f"You stand on {sum(cards)}. The dealer has {dealer}. Reward: {reward:+.0f}."
                history.append({"role": "tool", "name": "stand", "content": end})
                traj.messages = history
                state = {"seed": deal, "player_cards": cards, "player_total": sum(cards),
                         "dealer_up": up, "dealer_cards": dealer}  # fmt: skip
                info = {"stop_reason": "done", "env": state}
                traj.settle(Status.COMPLETED, reward=reward, info=info)
                group.trajectories.append(traj)
            sink.write_group(group)
            if why == "trained":
                trained.setdefault(step, []).append(group.id)
    for step in range(shape["steps"]):
        steps.append(
            {
                "kind": "step", "time": 1.0 + step, "step": step,
                "policy": policies[step + 2].model_dump(), "groups": trained[step],
                "trainable": len(trained[step]), "refused": [],
                "train_return": rng.uniform(-0.3, 0.1), "loss": rng.uniform(-0.1, 0.1),
                "grad_norm": rng.uniform(0.1, 2), "kl": rng.random() / 100,
                "tokens": 1500, "ratio_mean": 1.0,
            }
        )  # fmt: skip
    evals = [
        {"kind": "eval", "time": 0.0, "label": "curve", "step": s, "policy": s + 1,
         "return": rng.uniform(-0.15, -0.05), "hands": 200, "stderr": 0.06}
        for s in range(0, shape["steps"] + 1, 10)
    ]  # fmt: skip
    warm = {"kind": "warm_start", "time": 0.0, "policy": policies[1].model_dump()}
    with (out / "metrics.jsonl").open("w") as f:
        for record in [warm, *steps, *evals]:
            f.write(json.dumps(record) + "\n")
    from plies.environments.blackjack_exact import strategy_table

    decisions = [
        (t, u, soft, rng.random() < (0.95 if t <= 11 else 0.6 if t <= 16 else 0.02))
        for t in range(4, 22) for u in range(1, 11) for soft in (False, True)
        if not soft or t >= 12 for _ in range(rng.randint(0, 12))
    ]  # fmt: skip
    summary = {
        "warm_start_return": -0.112, "final_return": -0.066, "improvement": 0.046,
        "eval_hands": 2000, "grpo_steps": shape["steps"], "complete": True,
        "references": {"random": -0.396, "always_stand": -0.186, "optimal": -0.047},
        "strategy": {"policy": "final", "how": "hit share of the held-out evaluation's decisions",
                     **strategy_table(decisions)},
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "run.json").write_text(
        json.dumps({"config": {"budget": "default"}, "budget": {"max_new_tokens": 32}})
    )
    return out
