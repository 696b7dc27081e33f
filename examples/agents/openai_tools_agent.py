"""A small coding agent written with the plain `openai` SDK and tool calls: the kind of script
people already have. Nothing in it knows about RL360.

    python openai_tools_agent.py "the task" [--model NAME] [--max-turns N]

The OpenAI client reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment (RL360's agent
worker sets them to the episode's own session). The model gets one tool, `bash`; each call runs
in the current directory and its output goes back as the tool's result. The agent stops when
the model answers without a tool call, or after --max-turns replies.
"""

from __future__ import annotations

import argparse
import json
import subprocess

from openai import OpenAI

SYSTEM = ("You are a careful engineer working in a Linux shell. Use the bash tool to look "
          "around, run commands and change files. When the task is done, reply with a short "
          "summary and no tool call.")
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the working directory; returns its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}


def run_bash(arguments: str, timeout: float = 60.0) -> str:
    try:
        command = json.loads(arguments)["command"]
    except (ValueError, KeyError, TypeError):
        return "error: the arguments must be a JSON object with a `command` string"
    try:
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error: the command ran past {timeout:g}s"
    text = (out.stdout + out.stderr)[-4000:]
    return f"exit code {out.returncode}\n{text}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--max-turns", type=int, default=10)
    args = parser.parse_args()

    client = OpenAI()
    messages: list[dict] = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": args.task}]
    for _ in range(args.max_turns):
        reply = client.chat.completions.create(model=args.model, messages=messages,
                                               tools=[BASH])
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            print(msg.content)
            return 0
        for call in msg.tool_calls:
            result = (run_bash(call.function.arguments) if call.function.name == "bash"
                      else f"error: no tool named {call.function.name!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print("stopped after", args.max_turns, "replies")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
