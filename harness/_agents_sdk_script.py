"""A small coding agent on the OpenAI Agents SDK, run by `plies.harness.AgentsSdk`.

Not imported by plies: the adapter copies it into the episode's HOME and runs it with an
interpreter that has `openai-agents` installed. It reads the endpoint from `OPENAI_BASE_URL`
and `OPENAI_API_KEY`, offers two tools (write a file, run a shell command) in its working
directory, prints the final answer and exits 0; a failed run exits 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
)
from openai import AsyncOpenAI

INSTRUCTIONS = (
    "You are a coding agent working in the current directory. Use write_file to create "
    "files and run_command to run shell commands, then answer briefly."
)


@function_tool
def write_file(path: str, content: str) -> str:
    """Write a text file, relative to the working directory.

    Args:
        path: the file's relative path.
        content: the whole text of the file.
    """
    target = Path(path)
    if target.is_absolute() or ".." in target.parts:
        return f"refused: {path} is not a relative path inside the working directory"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {path}"


@function_tool
def run_command(command: str) -> str:
    """Run a shell command in the working directory and return its exit code and output.

    Args:
        command: the command line, run by /bin/sh.
    """
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    return f"exit code {done.returncode}\n{done.stdout}{done.stderr}"[-8000:]


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wire", choices=["chat", "responses"], default="chat")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("task")
    args = parser.parse_args()
    client = AsyncOpenAI(
        base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0
    )
    if args.wire == "chat":
        model = OpenAIChatCompletionsModel(model=args.model, openai_client=client)
    else:
        model = OpenAIResponsesModel(model=args.model, openai_client=client)
    agent = Agent(
        name="plies-agent", instructions=INSTRUCTIONS, tools=[write_file, run_command], model=model
    )
    try:
        result = await Runner.run(agent, args.task, max_turns=args.max_turns)
    except MaxTurnsExceeded:  # the agent's own budget: an ending, not a failure
        print(f"stopped after {args.max_turns} turns", file=sys.stderr)
        return 0
    except Exception as err:  # one line, not a traceback: the harness keeps stderr's tail
        print(f"agent failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    print(result.final_output)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
