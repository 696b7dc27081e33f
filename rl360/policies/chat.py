"""Chat rendering and tool-call parsing over a HF tokenizer.

The renderer is the only place that turns messages into token ids. The session ledger uses
it for first prompts and for template deltas; it never re-encodes what the model generated.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rl360.types import FunctionCall, Message, ToolCall, ToolSpec

# tokens that end an assistant turn in common templates; the first one the tokenizer knows
# is the template's end-of-turn, the others are alternate EOS ids (TITO case 5)
_END_OF_TURN_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_ALT_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


@dataclass
class ParsedAssistant:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed_tool_calls: int = 0
    # one reason per malformed call ("not JSON", "no name", "unclosed <tool_call>", ...)
    malformed_reasons: list[str] = field(default_factory=list)


class ChatRenderer:
    """Renders OpenAI-style messages with the tokenizer's chat template and parses replies."""

    def __init__(
        self,
        tokenizer: Any,
        tool_call_open: str = "<tool_call>",
        tool_call_close: str = "</tool_call>",
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set one before serving chats")
        self.tokenizer = tokenizer
        self.tool_call_open = tool_call_open
        self.tool_call_close = tool_call_close
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._tool_re = re.compile(
            re.escape(tool_call_open) + r"(.*?)" + re.escape(tool_call_close), re.DOTALL
        )
        vocab = tokenizer.get_vocab()
        eot = next((t for t in _END_OF_TURN_CANDIDATES if t in vocab), None)
        if eot is None:
            eot = tokenizer.eos_token
        if eot is None:
            raise ValueError("cannot find the template's end-of-turn token in the tokenizer")
        self.end_of_turn_id: int = vocab[eot]
        alts = {vocab[t] for t in _ALT_EOS_CANDIDATES if t in vocab}
        if tokenizer.eos_token_id is not None:
            alts.add(tokenizer.eos_token_id)
        alts.discard(self.end_of_turn_id)
        self.alt_eos_ids: list[int] = sorted(alts)
        self.special_ids: set[int] = set(tokenizer.all_special_ids) | {self.end_of_turn_id}
        # render memo: a group's sessions render the same first prompt, and the ledger's
        # re-render check renders each finished conversation again (identical answers: the
        # same conversation). Small conversations only; LRU; shared by the render thread and
        # the event loop, hence the lock. Off for a template that reads the clock (a date in
        # the system prompt), whose render is not a function of the conversation alone.
        self._memo_on = "strftime" not in str(tokenizer.chat_template)
        self._memo: collections.OrderedDict[bytes, tuple[int, ...]] = collections.OrderedDict()
        self._memo_lock = threading.Lock()

    @property
    def eos_ids(self) -> list[int]:
        return [self.end_of_turn_id, *self.alt_eos_ids]

    # ------------------------------------------------------------------ rendering

    MEMO_ENTRIES = 4096
    MEMO_MAX_KEY = 8192  # bytes of a conversation's JSON; larger ones are rendered each time

    def render(
        self,
        messages: list[Message],
        tools: list[ToolSpec] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """The conversation's token ids (a pure function of its arguments: memoised)."""
        key = msgspec.json.encode((messages, tools, add_generation_prompt)) if self._memo_on else b""
        if len(key) > self.MEMO_MAX_KEY:
            key = b""
        with self._memo_lock:
            hit = self._memo.get(key) if key else None
            if hit is not None:
                self._memo.move_to_end(key)
                return list(hit)
        text = self.render_text(messages, tools, add_generation_prompt)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if key:
            with self._memo_lock:
                self._memo[key] = tuple(ids)
                if len(self._memo) > self.MEMO_ENTRIES:
                    self._memo.popitem(last=False)
        return ids

    def render_text(
        self,
        messages: list[Message],
        tools: list[ToolSpec] | None,
        add_generation_prompt: bool,
    ) -> str:
        msgs = [_message_for_template(m) for m in messages]
        tool_dicts = [_tool_for_template(t) for t in tools] if tools else None
        return self.tokenizer.apply_chat_template(
            msgs,
            tools=tool_dicts,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ parsing

    def parse_assistant(self, text: str) -> ParsedAssistant:
        """Split generated text into content and tool calls. A tagged span holds one call
        object (`{"name": ..., "arguments": {...}}`, Qwen's form) or a list of them (SmolLM2's
        form; `[]` is no call). A malformed span (bad JSON, no name, arguments that are no
        object) stays in the content as plain text and is counted with its reason; so is an
        opening marker with no closing one, and a closing one with no opening."""
        calls: list[ToolCall] = []
        reasons: list[str] = []
        kept: list[str] = []
        pos = 0
        for m in self._tool_re.finditer(text):
            got, why = _parse_tool_call_span(m.group(1))
            if why:
                reasons.extend(why)
            if not got and why:
                continue  # left in place: the span is kept as content below
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.extend(got)
        kept.append(text[pos:])
        content = "".join(kept)
        unclosed = content.count(self.tool_call_open) - content.count(self.tool_call_close)
        reasons.extend([f"unclosed {self.tool_call_open}"] * max(unclosed, 0))
        reasons.extend([f"{self.tool_call_close} without an opening tag"] * max(-unclosed, 0))
        if calls:
            content = content.rstrip()
        return ParsedAssistant(content=content, tool_calls=calls,
                               malformed_tool_calls=len(reasons), malformed_reasons=reasons)


def _parse_tool_call_span(body: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in one tagged span and the reasons of the malformed ones."""
    try:
        obj = json.loads(body.strip())
    except (json.JSONDecodeError, ValueError) as e:
        return [], [f"not JSON ({e.msg if isinstance(e, json.JSONDecodeError) else e})"]
    items = obj if isinstance(obj, list) else [obj]
    calls: list[ToolCall] = []
    reasons: list[str] = []
    for item in items:
        call = _tool_call_from(item)
        if isinstance(call, str):
            reasons.append(call)
        else:
            calls.append(call)
    return calls, reasons


def _tool_call_from(obj: Any) -> ToolCall | str:
    """A ToolCall from one decoded call object, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a call must be a JSON object, got {type(obj).__name__}"
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        return "no name"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, ValueError):
            return "arguments are a string that is not JSON"
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:16]}",
        function=FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)),
    )


def _tool_for_template(t: ToolSpec) -> dict[str, Any]:
    """A tool spec with every field, in the OpenAI order. Not msgspec.to_builtins: with
    omit_defaults it drops `type` only when the string is the default *object*, so a spec that
    crossed a process boundary (pickled by Ray) rendered with `"type": "function"` and a local
    one without: two prompts for the same tools."""
    f = t.function
    fn = {"name": f.name, "description": f.description, "parameters": f.parameters}
    return {"type": t.type, "function": fn}


def _message_for_template(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content if m.content is not None else ""}
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": tc.id,
                "type": tc.type,
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d
