"""Built-in tools over a Sandbox, with OpenAI tool schemas: bash, python, read_file, write_file,
edit_file. Bad arguments (not JSON, a missing or mistyped field, an unknown tool) come back as
an error ToolResult (ok=False) the model can read; only a broken sandbox (SandboxError) raises.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rl360.envs.api import ToolResult
from rl360.envs.sandbox import ExecResult, Sandbox, SandboxFileError
from rl360.types import FunctionSpec, ToolCall, ToolSpec

EDIT_CAP = 1 << 20  # edit_file reads at most this much (a file, or /dev/zero, may be endless)
ToolImpl = Callable[[Sandbox, dict[str, Any], "ToolBox"], Awaitable[ToolResult]]
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: ToolImpl

    @property
    def name(self) -> str:
        return self.spec.function.name


def _spec(
    name: str, description: str, props: dict[str, dict[str, Any]], required: list[str]
) -> ToolSpec:
    params = {"type": "object", "properties": props, "required": required}
    return ToolSpec(function=FunctionSpec(name=name, description=description, parameters=params))


def clip(text: str, limit: int) -> str:
    """Keep the head and tail of `text` within `limit` characters."""
    if len(text) <= limit:
        return text
    half = max(0, limit // 2 - 40)
    return f"{text[:half]}\n...[{len(text) - 2 * half} characters dropped]...\n{text[len(text) - half :]}"


def format_exec(res: ExecResult, limit_s: float) -> str:
    parts = []
    if res.stdout:
        parts.append(res.stdout.rstrip("\n"))
    if res.stderr:
        parts.append("[stderr]\n" + res.stderr.rstrip("\n"))
    if res.timed_out:
        parts.append(f"[timed out after {limit_s:g}s; the command was killed]")
    else:
        parts.append(f"[exit code {res.exit_code}]")
    return "\n".join(parts)


def _timeout(args: dict[str, Any], box: ToolBox) -> float:
    asked = args.get("timeout")
    limit = box.max_exec_timeout_s
    return limit if asked is None else max(0.1, min(float(asked), limit))


async def _bash(sb: Sandbox, args: dict[str, Any], box: ToolBox) -> ToolResult:
    t = _timeout(args, box)
    res = await sb.exec(args["command"], timeout=t)
    return ToolResult(format_exec(res, t), ok=res.ok)


async def _python(sb: Sandbox, args: dict[str, Any], box: ToolBox) -> ToolResult:
    code = args["code"]
    if len(code.encode()) > 100_000:
        return ToolResult(
            "error: code longer than 100 kB; write it to a file and run it with bash", ok=False
        )
    t = _timeout(args, box)
    res = await sb.exec(["python3", "-c", code], timeout=t)
    return ToolResult(format_exec(res, t), ok=res.ok)


async def _read_file(sb: Sandbox, args: dict[str, Any], box: ToolBox) -> ToolResult:
    data = await sb.read_file(args["path"], max_bytes=box.max_output_chars * 4)
    return ToolResult(clip(data.decode(errors="replace"), box.max_output_chars))


async def _write_file(sb: Sandbox, args: dict[str, Any], box: ToolBox) -> ToolResult:
    data = args["content"].encode()
    await sb.write_file(args["path"], data)
    return ToolResult(f"wrote {len(data)} bytes to {args['path']}")


async def _edit_file(sb: Sandbox, args: dict[str, Any], box: ToolBox) -> ToolResult:
    path, old, new = args["path"], args["old_string"], args["new_string"]
    if not old:
        return ToolResult("error: old_string is empty", ok=False)
    raw = await sb.read_file(path, max_bytes=EDIT_CAP + 1)
    if len(raw) > EDIT_CAP:
        return ToolResult(
            f"error: {path} is larger than {EDIT_CAP} bytes; edit it with bash (sed, python)",
            ok=False,
        )
    text = raw.decode(errors="replace")
    count = text.count(old)
    if count == 0:
        return ToolResult(f"error: old_string not found in {path}", ok=False)
    if count > 1:
        return ToolResult(
            f"error: old_string occurs {count} times in {path}; include more context to make it unique",
            ok=False,
        )
    await sb.write_file(path, text.replace(old, new, 1))
    return ToolResult(f"edited {path}: replaced 1 occurrence")


_TIMEOUT_PROP = {"type": "number", "description": "seconds before the command is killed"}
BUILTIN_TOOLS: dict[str, Tool] = {
    t.name: t
    for t in [
        Tool(
            _spec(
                "bash",
                "Run a shell command in the sandbox's work dir; returns stdout, stderr and exit code.",
                {"command": {"type": "string"}, "timeout": _TIMEOUT_PROP},
                ["command"],
            ),
            _bash,
        ),
        Tool(
            _spec(
                "python",
                "Run Python code (python3 -c) in the sandbox; returns its output and exit code.",
                {"code": {"type": "string"}, "timeout": _TIMEOUT_PROP},
                ["code"],
            ),
            _python,
        ),
        Tool(
            _spec("read_file", "Read a text file.", {"path": {"type": "string"}}, ["path"]),
            _read_file,
        ),
        Tool(
            _spec(
                "write_file",
                "Create or overwrite a file with the given content (parent dirs are created).",
                {"path": {"type": "string"}, "content": {"type": "string"}},
                ["path", "content"],
            ),
            _write_file,
        ),
        Tool(
            _spec(
                "edit_file",
                "Replace the one exact occurrence of old_string in a file with new_string.",
                {
                    "path": {"type": "string"},
                    "old_string": {"type": "string"},
                    "new_string": {"type": "string"},
                },
                ["path", "old_string", "new_string"],
            ),
            _edit_file,
        ),
    ]
}


def check_arguments(spec: ToolSpec, raw: str) -> dict[str, Any] | str:
    """Parsed arguments, or an error message for the model."""
    name = spec.function.name
    try:
        args = json.loads(raw) if raw and raw.strip() else {}
    except json.JSONDecodeError as e:
        return f"error: arguments of {name} are not valid JSON ({e.msg} at char {e.pos})"
    if not isinstance(args, dict):
        return f"error: arguments of {name} must be a JSON object, got {type(args).__name__}"
    schema = spec.function.parameters
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"error: {name} is missing required argument(s): {', '.join(missing)}"
    unknown = [k for k in args if k not in props]
    if unknown:
        return f"error: {name} got unknown argument(s) {unknown}; it takes {sorted(props)}"
    for key, value in args.items():
        types = _JSON_TYPES.get(props[key].get("type", ""), (object,))
        wrong_bool = isinstance(value, bool) and bool not in types
        if not isinstance(value, types) or wrong_bool:
            return f"error: argument {key!r} of {name} must be {props[key].get('type')}, got {type(value).__name__}"
    return args


class ToolBox:
    """A set of tools bound to one sandbox."""

    def __init__(
        self,
        sandbox: Sandbox,
        names: Sequence[str] = tuple(BUILTIN_TOOLS),
        extra: Sequence[Tool] = (),
        max_output_chars: int = 8000,
        max_exec_timeout_s: float | None = None,
    ) -> None:
        unknown = [n for n in names if n not in BUILTIN_TOOLS]
        if unknown:
            raise ValueError(f"unknown built-in tool(s) {unknown}; known: {sorted(BUILTIN_TOOLS)}")
        self.sandbox = sandbox
        self.tools: dict[str, Tool] = {n: BUILTIN_TOOLS[n] for n in names}
        self.tools.update({t.name: t for t in extra})
        self.max_output_chars = max_output_chars
        self.max_exec_timeout_s = max_exec_timeout_s or sandbox.limits.timeout

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self.tools.values()]

    async def call(self, tool_call: ToolCall) -> ToolResult:
        name = tool_call.function.name
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(
                f"error: unknown tool {name!r}; available: {sorted(self.tools)}", ok=False
            )
        args = check_arguments(tool.spec, tool_call.function.arguments)
        if isinstance(args, str):
            return ToolResult(args, ok=False)
        try:
            result = await tool.run(self.sandbox, args, self)
        except SandboxFileError as e:
            return ToolResult(f"error: {e}", ok=False)
        return ToolResult(clip(result.content, self.max_output_chars), ok=result.ok)
