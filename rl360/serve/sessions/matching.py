"""What the ledger compares: message matchers (TITO case 9), the token-level delta guard
(invariant 6), tool-group splitting (case 11) and the re-render comparison (invariant 7)."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from rl360.policies.chat import ChatRenderer
from rl360.types import Message, ToolSpec


class GuardFailed(Exception):
    pass


def guard(prefix: list[int], full: list[int]) -> None:
    """TITO invariant 6: full[:len(prefix)] == prefix, at token level."""
    if full[: len(prefix)] != prefix:
        i = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), len(full))
        raise GuardFailed(f"render of the longer conversation differs at token {i}")


def group_messages(msgs: list[Message]) -> list[list[Message]]:
    groups: list[list[Message]] = []
    for m in msgs:
        if groups and m.role == "tool" and groups[-1][-1].role == "tool":
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


def tools_key(tools: list[ToolSpec] | None) -> str:
    return json.dumps(msgspec.to_builtins(tools or []), sort_keys=True)


def _content(m: Message) -> str:
    return m.content or ""


def _same_strict(a: Message, b: Message) -> bool:
    """Roles, content (None == ""), tool call names and argument text; ids/index ignored."""
    if a.role != b.role or _content(a) != _content(b) or a.tool_call_id != b.tool_call_id:
        return False
    ca, cb = a.tool_calls or [], b.tool_calls or []
    return len(ca) == len(cb) and all(
        x.function.name == y.function.name and x.function.arguments == y.function.arguments
        for x, y in zip(ca, cb, strict=True)
    )


def _json_or_text(s: str) -> Any:
    try:
        return json.loads(s)
    except (json.JSONDecodeError, ValueError):
        return s


_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


def _without_reasoning(text: str) -> str:
    return _THINK.sub("", text, count=1).strip()


def _same_content_loose(a: Message, b: Message) -> bool:
    """Content equal, or (assistant turns) equal once a leading <think>...</think> block is
    dropped: clients that keep reasoning apart (`reasoning_content`) resend the answer only."""
    ta, tb = _content(a), _content(b)
    if ta == tb:
        return True
    return a.role == "assistant" and _without_reasoning(ta) == _without_reasoning(tb)


def _same_loose_tool_call(a: Message, b: Message) -> bool:
    """As strict, but tool arguments compare as JSON objects, tool_call_id is ignored when
    one side lacks it, and an assistant's dropped leading reasoning block still matches."""
    if a.role != b.role or not _same_content_loose(a, b):
        return False
    if a.tool_call_id and b.tool_call_id and a.tool_call_id != b.tool_call_id:
        return False
    ca, cb = a.tool_calls or [], b.tool_calls or []
    return len(ca) == len(cb) and all(
        x.function.name == y.function.name
        and _json_or_text(x.function.arguments) == _json_or_text(y.function.arguments)
        for x, y in zip(ca, cb, strict=True)
    )


MATCHERS = {"strict": _same_strict, "loose_tool_call": _same_loose_tool_call}


def first_divergence(a: list[Message], b: list[Message], same: Any) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not same(x, y):
            return i
    return min(len(a), len(b))


def compare_segments(ledger: list[int], rendered: list[int], r: ChatRenderer,
                     mask: list[int] | None = None) -> dict[str, Any]:
    """Split both sequences at special tokens and classify the differences (TITO inv. 7). A
    text segment is assistant text when it starts with the assistant header or, given the
    ledger's `mask`, holds a token the engine generated: a special token the model generated
    mid-reply splits its reply, and the rest is still the model's text."""

    def split(ids: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        specials: list[int] = []
        spans: list[tuple[int, int]] = []
        start = 0
        for i, t in enumerate(ids):
            if t in r.special_ids:
                specials.append(t)
                spans.append((start, i))
                start = i + 1
        spans.append((start, len(ids)))
        return specials, spans

    sa, ta = split(ledger)
    sb, tb = split(rendered)
    out: dict[str, Any] = {
        "special_token_count": abs(len(sa) - len(sb)),
        "special_token_type": 0,
        "eos_alias": 0,
        "assistant_text": 0,
        "non_assistant_text": 0,
    }
    for x, y in zip(sa, sb, strict=False):
        if x != y:
            if x in r.alt_eos_ids and y == r.end_of_turn_id:
                out["eos_alias"] += 1
            else:
                out["special_token_type"] += 1
    for (a0, a1), (b0, b1) in zip(ta, tb, strict=False):
        x, y = ledger[a0:a1], rendered[b0:b1]
        if x != y:
            text = r.decode(y[:3]) if y else r.decode(x[:3])
            generated = mask is not None and any(mask[a0:a1])
            key = "assistant_text" if text.startswith("ass") or generated else \
                "non_assistant_text"
            out[key] += 1
    return out
