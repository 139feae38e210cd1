"""A black-box Blackjack agent, trained through the capture gateway.

This file has two halves that never import each other's world:

- `agent`: the agent program, written only against the official `openai` client. It reads
  its task (messages and tool schemas) from stdin, asks the "model" for each move, and
  reports each tool call (`hit` / `stand`) on stdout, reading the game's answer back from
  stdin: the line protocol of `plies.harness.GatewayHarness`. It knows nothing of plies;
  `OPENAI_BASE_URL` and `OPENAI_API_KEY` point it at a gateway session.
- `train`: the trainer. It starts the reference server (`plies serve`) on the tiny model,
  puts a gateway in front of it, plays groups of hands by running the agent as a subprocess
  per episode, checks the groups with `training_groups`, and takes GRPO steps, publishing
  each new policy to the sampler the gateway uses.

Run it:

    python examples/gateway_agent.py train --steps 2 --tasks 2 --group-size 4

The tiny model is random, so it rarely calls a tool and rewards are mostly equal; the run
shows the pipeline end to end (exact tokens from a black box to gradient steps), not
learning. Point `--model-dir` at a real instruct model to see rewards move.
"""

from __future__ import annotations

import argparse
import json
import sys

MAX_TURNS = 6
UNFINISHED_REWARD = -1.0
"""What a hand the agent left unfinished (no tool paid, or past the wall clock) is worth: a
loss, as in the Blackjack recipe."""


def agent(system: str | None = None) -> int:
    """The agent program: plain OpenAI client code, no plies import."""
    import openai

    client = openai.OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY name the gateway session
    task = json.loads(sys.stdin.readline())
    messages, tools = task["messages"], task["tools"]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})

    def act(name: str, arguments: str) -> dict:
        print(json.dumps({"type": "tool", "name": name, "arguments": arguments}), flush=True)
        return json.loads(sys.stdin.readline())

    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=tools, max_tokens=48
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Play by calling `hit` or `stand`."})
            continue
        for call in message.tool_calls:
            result = act(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result["content"]})
            if result["done"]:
                print(json.dumps({"type": "done"}), flush=True)
                return 0
    print(json.dumps({"type": "done"}), flush=True)
    return 0


async def train(args: argparse.Namespace) -> None:
    """Play groups of hands through the gateway and train on them."""
    import tempfile
    import uuid
    from collections import Counter
    from pathlib import Path

    import anyio
    from transformers import AutoTokenizer

    from plies import Group, PolicyRef
    from plies.environments import BlackjackEnv, Task
    from plies.gateway import Gateway, GatewayServer
    from plies.harness import GatewayHarness, RewardPolicy, TruncationReward, UnpaidReward
    from plies.policy import SamplingParams, VLLMClient, publish
    from plies.testing import plies_command, serve_process, tiny_model_dir
    from plies.tokens import ChatRenderer
    from plies.training import (
        AdamParams,
        TrainingClient,
        grpo_advantages,
        training_batch,
        training_groups,
    )

    model_dir = args.model_dir or tiny_model_dir()
    serve = plies_command("serve", str(model_dir), "--port", "0", "--threads", "1")
    log = Path(tempfile.mkdtemp(prefix="plies-gateway-agent-")) / "serve.log"
    async with serve_process(serve, log=log) as reference:
        ready = reference.ready
        policy = PolicyRef.model_validate(ready["policy"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        sampling = SamplingParams(max_tokens=48, temperature=1.0)
        async with (
            VLLMClient(ready["url"], ready["model"]) as sampler,
            TrainingClient(ready["url"]) as trainer,
            Gateway(sampler, ChatRenderer(tokenizer), sampling=sampling) as gateway,
            GatewayServer(gateway) as server,
        ):
            unfinished = RewardPolicy(
                truncated=TruncationReward(reward=UNFINISHED_REWARD),
                unpaid=UnpaidReward(reward=UNFINISHED_REWARD),
            )
            harness = GatewayHarness(
                server, [sys.executable, __file__, "agent"], wall_s=120, rewards=unfinished
            )
            for step in range(args.steps):
                groups = []
                for t in range(args.tasks):
                    task = Task(id=f"hand-{step}-{t}", seed=1000 * step + t)
                    group_id = uuid.uuid4().hex
                    members = [None] * args.group_size

                    async def play(i: int, task=task, group_id=group_id, members=members) -> None:
                        async with BlackjackEnv() as env:
                            members[i] = await harness.run(env, task, group_id=group_id)

                    async with anyio.create_task_group() as tg:
                        for i in range(args.group_size):
                            tg.start_soon(play, i)
                    groups.append(
                        Group(
                            id=group_id,
                            task_id=task.id,
                            size=args.group_size,
                            policy=policy,
                            trajectories=members,
                        )
                    )
                selection = training_groups(groups, policy=policy, max_staleness=0)
                rewards = [t.reward for g in groups for t in g.trajectories]
                turns = sum(len(t.turns) for g in groups for t in g.trajectories)
                fallbacks = Counter(
                    reason
                    for g in groups
                    for t in g.trajectories
                    for reason, n in t.info["fallbacks"].items()
                    for _ in range(n)
                )
                print(
                    f"step {step}: {len(selection.trainable)}/{len(groups)} groups trainable, "
                    f"{turns} turns, mean reward {sum(rewards) / len(rewards):+.2f}, "
                    f"full re-renders: {dict(fallbacks) or 'none'}",
                    *(f"refused {r.group_id}: {r.reason} ({r.detail})" for r in selection.refused),
                    sep="\n  ",
                )
                if not selection.trainable:
                    continue
                advantages = [
                    grpo_advantages([t.reward for t in g.trajectories]) for g in selection.trainable
                ]
                batch = training_batch(selection.trainable, advantages, temperature=1.0)
                result = await trainer.forward_backward(batch, loss="importance_sampling")
                await trainer.optim_step(AdamParams(lr=args.lr))
                policy = await trainer.save_policy()
                await publish(policy, [sampler])  # served as policy-<version>
                gateway.policy = policy  # the next turns sample the new policy
                print(f"  trained: {result}\n  published policy version {policy.version}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    agent_args = sub.add_parser("agent", help="run the agent program (the harness starts this)")
    agent_args.add_argument("--system", default=None, help="a system message to play under")
    trainer = sub.add_parser("train", help="play groups through the gateway and train")
    trainer.add_argument("--steps", type=int, default=2)
    trainer.add_argument("--tasks", type=int, default=2, help="groups per step")
    trainer.add_argument("--group-size", type=int, default=4)
    trainer.add_argument("--lr", type=float, default=1e-3)
    trainer.add_argument("--model-dir", default=None, help="default: the tiny offline model")
    args = parser.parse_args()
    if args.mode == "agent":
        return agent(args.system)
    import anyio

    anyio.run(train, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
