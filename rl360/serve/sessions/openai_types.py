"""OpenAI-compatible request and response bodies (msgspec), and their conversions.

Requests ignore fields we do not use (clients send many), except the ones that would change
what the ledger records (`input_ids`, `prompt_token_ids`): those are refused."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from rl360.types import Message, ToolCall, ToolSpec


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None

    def to_message(self) -> Message:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content if p.type == "text")
        return Message(
            role=self.role,
            content=content,
            tool_calls=self.tool_calls or None,
            tool_call_id=self.tool_call_id,
            name=self.name,
        )


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct):
    messages: list[ChatMessageIn]
    model: str = ""
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    # vLLM's extension: lower is scheduled first (types.SamplingParams.priority)
    priority: int | None = None
    # refused: the ledger, not the client, decides the prompt ids (TITO case 1)
    input_ids: Any = None
    prompt_token_ids: Any = None


class CompletionRequest(msgspec.Struct):
    prompt: str | list[int]
    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    logprobs: int | None = None
    priority: int | None = None


class OpenSessionRequest(msgspec.Struct, forbid_unknown_fields=True):
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    matcher: str | None = None


class ApiError(msgspec.Struct):
    status: int
    code: str
    message: str

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.code, "code": self.status}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _message_body(message: Message) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        msg["tool_calls"] = [
            {"id": tc.id, "type": "function",
             "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
            for tc in message.tool_calls
        ]
        if not message.content:
            msg["content"] = None
    return msg


def chat_completion_body(
    response_id: str,
    model: str,
    choices: list[tuple[Message, str, list[dict[str, Any]] | None]],
    prompt_tokens: int,
    completion_tokens: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """`choices`: (reply, finish_reason, per-token logprobs or None) for each of the n."""
    out = []
    for i, (message, finish_reason, logprobs) in enumerate(choices):
        choice: dict[str, Any] = {"index": i, "message": _message_body(message),
                                  "finish_reason": finish_reason}
        choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
        out.append(choice)
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "rl360": extra,
    }


def chat_stream_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """One complete response as SSE chunks. The engine call is not streamed: the ledger is
    committed first, so a streamed and a non-streamed run record the same tokens (TITO 20)."""
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for choice in body["choices"]:
        i, msg = choice["index"], choice["message"]
        chunks.append(base | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]})
        if msg.get("content"):
            chunks.append(base | {"choices": [{"index": i, "delta": {"content": msg["content"]}}]})
        for k, tc in enumerate(msg.get("tool_calls") or []):
            delta = {"tool_calls": [{"index": k, **tc}]}
            chunks.append(base | {"choices": [{"index": i, "delta": delta}]})
        last: dict[str, Any] = {"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}
        chunks.append(base | {"choices": [last]})
    if include_usage:
        chunks.append(base | {"choices": [], "usage": body["usage"]})
    return chunks
