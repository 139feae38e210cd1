"""GRPO on episodes played by a real agent CLI, on CPU, written out on plies' public API.

    python examples/agent_cli_grpo.py --out runs/agent-grpo [--agent mini-swe-agent]
        [--policy scripted|tiny] [--steps 2] [--groups 2] [--group-size 2]

The agent (mini-swe-agent by default; also opencode, pi, openai-agents) is the unmodified
program from its registry, as `.ci/agents-tier` installs it (`.agents/npm`, `.venv-agents`).
Each episode runs it in its own sandbox workspace against a gateway session; the gateway
samples every turn from the policy and records the exact tokens; a verifier run in the
workspace after the agent exits gives the reward. Then, per step: `training_groups` checks
the groups, each member gets its reward minus the group mean, the trainer (`plies serve`)
takes one importance-sampling step and saves a new policy, and the next episodes sample
from it.

`--policy tiny` samples the long-context tiny random model: the data path is real end to
end, but random text never writes the file, so every group ties and there is nothing to
learn. `--policy scripted` (the default) answers each turn from a script in the model's own
tool-call format, writing the right file in about half of the episodes, so groups have a
signal; its logprobs are nominal (no model sampled them), so its steps show the plumbing,
not learning. Ctrl-C stops with 130; every agent process goes with its episode.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import anyio
from transformers import AutoTokenizer

from plies import PolicyRef
from plies.environments import LocalProcessBackend, Task
from plies.gateway import Gateway, GatewayServer
from plies.harness import (
    AgentAdapter,
    AgentHarness,
    AgentsSdk,
    EnvGroup,
    MiniSweAgent,
    OpenCode,
    Pi,
    WorkspaceEnv,
    play_groups,
)
from plies.policy import SamplingParams, VLLMClient, publish
from plies.runtime import Interrupts, JsonlSink, run
from plies.testing import (
    LONG_MAX_POSITIONS,
    ScriptedPolicy,
    plies_command,
    serve_process,
    tiny_model_dir,
)
from plies.tokens import ChatRenderer
from plies.training import (
    AdamParams,
    TrainingClient,
    grpo_advantages,
    training_batch,
    training_groups,
)

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "Create answer.txt containing the word yes, show it with cat, then say done."
VERIFY = ["grep", "-qx", "yes", "answer.txt"]


def adapter_for(agent: str, npm_bin: Path, venv_bin: Path) -> AgentAdapter:
    return {
        "mini-swe-agent": lambda: MiniSweAgent(command=str(venv_bin / "mini")),
        "openai-agents": lambda: AgentsSdk(python=str(venv_bin / "python")),
        "opencode": lambda: OpenCode(command=str(npm_bin / "opencode")),
        "pi": lambda: Pi(command=str(npm_bin / "pi")),
    }[agent]()


def script_for(agent: str, seed: int) -> list[Any]:
    """Write a file (right or wrong, by chance), show it, answer: in each agent's own tools."""
    draw = random.Random(seed)

    def write(_prompt: str) -> dict[str, Any]:
        word = draw.choice(["yes", "no"])
        name, arguments = {
            "mini-swe-agent": ("bash", {"command": f"echo {word} > answer.txt"}),
            "openai-agents": ("write_file", {"path": "answer.txt", "content": f"{word}\n"}),
            "opencode": ("write", {"filePath": "answer.txt", "content": f"{word}\n"}),
            "pi": ("write", {"path": "answer.txt", "content": f"{word}\n"}),
        }[agent]
        return {"tool_calls": [{"name": name, "arguments": arguments}]}

    show: dict[str, Any] = {"command": "cat answer.txt"}
    if agent == "opencode":
        show["description"] = "Show answer.txt"
    shell = "run_command" if agent == "openai-agents" else "bash"
    if agent == "mini-swe-agent":  # it ends only on its submit command
        done: Any = {
            "tool_calls": [
                {
                    "name": "bash",
                    "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"},
                }
            ]
        }
    else:
        done = "Done."
    return [write, {"tool_calls": [{"name": shell, "arguments": show}]}, done]


async def agent_grpo(args: argparse.Namespace, interrupts: Interrupts) -> dict[str, Any]:
    out: Path = args.out
    model_dir = await anyio.to_thread.run_sync(
        lambda: tiny_model_dir(max_positions=LONG_MAX_POSITIONS)
    )
    tokenizer = await anyio.to_thread.run_sync(AutoTokenizer.from_pretrained, model_dir)
    serve = plies_command(
        "serve", str(model_dir), "--state-dir", str(out / "server"),
        "--max-model-len", str(LONG_MAX_POSITIONS),
    )  # fmt: skip
    adapter = adapter_for(args.agent, args.npm_bin, args.agents_venv / "bin")
    backend = LocalProcessBackend(out / "workspaces")
    history: list[dict[str, Any]] = []
    async with (
        serve_process(serve, log=out / "server.log") as server,
        TrainingClient(server.url) as trainer,
        VLLMClient(server.url, server.ready["model"]) as engine,
    ):
        policy = PolicyRef.model_validate(server.ready["policy"])
        scripted = ScriptedPolicy(tokenizer, script_for(args.agent, args.seed), policy=policy)
        sampler = scripted if args.policy == "scripted" else engine
        # Qwen3's own template keeps scripted answers as written; see ScriptedPolicy.
        renderer = ChatRenderer(tokenizer, template="model")
        sampling = SamplingParams(max_tokens=64)
        async with (
            Gateway(sampler, renderer, sampling=sampling, policy=policy) as gateway,
            GatewayServer(gateway) as gateway_server,
        ):
            harness = AgentHarness(gateway_server, adapter, wall_s=300, max_turns=4)

            async def new_env() -> WorkspaceEnv:
                return WorkspaceEnv(backend, run_id=out.name)

            with JsonlSink(out / "groups.jsonl") as sink:
                for step in range(args.steps):
                    if interrupts.count:
                        break
                    tasks = [
                        Task(
                            id=f"step{step}-task{k}",
                            data={"instruction": INSTRUCTION, "verify": VERIFY},
                        )
                        for k in range(args.groups)
                    ]
                    groups = await play_groups(
                        harness,
                        [EnvGroup(task, new_env, size=args.group_size) for task in tasks],
                        policy=policy,
                        sink=sink,
                        report_path=out / "quarantine.json",
                    )
                    selection = training_groups(groups, policy=policy, max_staleness=0)
                    advantages = [
                        grpo_advantages([t.reward for t in g.trajectories])
                        for g in selection.trainable
                    ]
                    rewards = [t.reward for g in groups for t in g.trajectories]
                    record: dict[str, Any] = {
                        "step": step,
                        "rewards": rewards,
                        "trainable_groups": len(selection.trainable),
                        "refused": [r.reason.value for r in selection.refused],
                        "turns": sum(len(t.turns) for g in groups for t in g.trajectories),
                    }
                    if any(a for group_advantages in advantages for a in group_advantages):
                        batch = training_batch(
                            selection.trainable, advantages, temperature=1.0, skip_zero=True
                        )
                        fb = await trainer.forward_backward(batch, loss="importance_sampling")
                        await trainer.optim_step(AdamParams(lr=1e-3, grad_clip=1.0))
                        policy = await trainer.save_policy()
                        await publish(policy, [engine])
                        # The gateway samples from the new policy from now on; the scripted
                        # stand-in reports it as the policy it answers for.
                        gateway.policy = scripted.policy = policy
                        record["loss"] = fb.metrics.get("loss")
                    record["policy_version"] = policy.version
                    print(json.dumps(record), flush=True)
                    history.append(record)
    summary = {"agent": args.agent, "policy": args.policy, "steps": history}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/agent-grpo"))
    parser.add_argument(
        "--agent", choices=["mini-swe-agent", "openai-agents", "opencode", "pi"],
        default="mini-swe-agent",
    )  # fmt: skip
    parser.add_argument("--policy", choices=["scripted", "tiny"], default="scripted")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2, help="groups per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--npm-bin", type=Path, default=ROOT / ".agents/npm/node_modules/.bin")
    parser.add_argument("--agents-venv", type=Path, default=ROOT / ".venv-agents")
    args = parser.parse_args()
    if (args.out / "server").exists():
        parser.error(f"{args.out} holds an earlier run; choose a new --out")
    args.out.mkdir(parents=True, exist_ok=True)

    async def job(interrupts: Interrupts) -> None:
        await agent_grpo(args, interrupts)

    code = run(job)
    if code:
        print("interrupted", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
