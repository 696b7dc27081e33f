"""A turn's template delta costs the new turn only (serve.delta_context = "turn"), with the
TITO invariants intact; "conversation" renders in the whole conversation's context."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from rl360.policies.chat import ChatRenderer
from rl360.recipe import EngineSection, ModelSection, ServeSection
from rl360.serve.engines.scripted import ScriptedBackend
from rl360.serve.sessions.openai_types import ApiError, ChatCompletionRequest
from rl360.serve.sessions.service import LocalEngineClient, SessionService
from tests.serve.sessions.tito import check_trajectory

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
CALL = "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"ls\"}}\n</tool_call>"


class CountingRenderer(ChatRenderer):
    """Records how many messages each render was given."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.sizes: list[int] = []

    def render(self, messages: Any, tools: Any, add_generation_prompt: bool) -> list[int]:
        self.sizes.append(len(messages))
        return super().render(messages, tools, add_generation_prompt)


def make(renderer: ChatRenderer, delta_context: str = "turn") -> SessionService:
    be = ScriptedBackend(EngineSection(options={"rules": [["tool_response", CALL]],
                                                "default": CALL}),
                         ModelSection(), tokenizer=renderer.tokenizer)
    return SessionService(renderer, LocalEngineClient(be), ServeSection(delta_context=delta_context),
                          max_model_len=ModelSection().max_model_len, model_name="rl360")


async def agent_episode(svc: SessionService, turns: int) -> tuple[dict[str, Any], list[int]]:
    """A tool-calling episode of `turns` turns; returns the trajectory and, per append turn,
    the most messages one render was given."""
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "list files"}]
    widest: list[int] = []
    renderer = svc.renderer
    for t in range(turns):
        if isinstance(renderer, CountingRenderer):
            renderer.sizes.clear()
        req = msgspec.convert({"messages": msgs, "tools": TOOLS}, ChatCompletionRequest)
        out = await svc.chat(s["id"], s["token"], req)
        assert not isinstance(out, ApiError), out
        if t and isinstance(renderer, CountingRenderer):
            widest.append(max(renderer.sizes))
        reply = out["choices"][0]["message"]
        msgs.append(reply)
        for tc in reply["tool_calls"]:
            msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": f"file{t}.txt"})
    return svc.trajectory(s["id"], s["token"]), widest


async def test_append_renders_the_new_turn_only(tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    r = CountingRenderer(tiny_tokenizer)
    traj, widest = await agent_episode(make(r), 12)
    # system + the previous turn (tool results, reply) + the new tool result: never the
    # whole conversation (which reaches 2 + 2 * 11 messages)
    assert max(widest) <= 4, widest
    assert traj["turns"] == 12
    check_trajectory(traj)
    assert traj["rerender"] == {"match": True}
    assert "delta_full_context" not in traj["counters"]


async def test_turn_and_conversation_contexts_give_the_same_ledger(tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    a, _ = await agent_episode(make(ChatRenderer(tiny_tokenizer), "turn"), 6)
    b, _ = await agent_episode(make(ChatRenderer(tiny_tokenizer), "conversation"), 6)
    for k in ("tokens", "mask", "provenance", "logprobs", "versions"):
        assert a[k] == b[k], k


def numbered(tokenizer: Any) -> Any:
    """The tiny template with each user block's header naming its position in the
    conversation: the render of a new message depends on everything before it."""
    tok = copy.deepcopy(tokenizer)
    old = "'<|im_start|>user' }}"
    assert old in tok.chat_template
    tok.chat_template = tok.chat_template.replace(old, "'<|im_start|>user' + loop.index0|string }}")
    return tok


async def test_position_dependent_template_needs_the_conversation_context(tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = numbered(tiny_tokenizer)
    good, _ = await agent_episode(make(ChatRenderer(tok), "conversation"), 4)
    check_trajectory(good)
    assert good["rerender"] == {"match": True}
    # "turn" cannot see such a template through the prefix guard; the re-render check of
    # the finished trajectory (TITO invariant 7) reports it instead of hiding it
    bad, _ = await agent_episode(make(ChatRenderer(tok), "turn"), 4)
    assert bad["rerender"]["match"] is False


def test_unknown_delta_context_is_a_clear_error(renderer) -> None:  # type: ignore[no-untyped-def]
    from rl360.serve.sessions.ledger import SessionLedger

    with pytest.raises(ValueError, match=r"serve\.delta_context"):
        SessionLedger("s", renderer, delta_context="nope")
