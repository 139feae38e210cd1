"""A small agent program on the official openai client, for AgentHarness tests in the main run.

    python chat_agent.py TASK

Reads `OPENAI_BASE_URL` and `OPENAI_API_KEY`, offers one tool (`sh`: run a shell command),
runs each call it gets and sends the output back, and prints the first plain answer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "sh",
            "description": "Run a shell command in the working directory.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


def main() -> int:
    client = openai.OpenAI(max_retries=0)
    messages: list[dict] = [{"role": "user", "content": sys.argv[1]}]
    for _ in range(8):
        reply = (
            client.chat.completions.create(model="plies-policy", messages=messages, tools=TOOLS)
            .choices[0]
            .message
        )
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            print(reply.content)
            return 0
        for call in reply.tool_calls:
            command = json.loads(call.function.arguments)["command"]
            done = subprocess.run(command, shell=True, capture_output=True, text=True)
            output = done.stdout + done.stderr
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 2


if __name__ == "__main__":
    sys.exit(main())
