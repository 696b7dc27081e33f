"""Chat rendering and tool-call parsing."""

from __future__ import annotations

import json

from rl360.types import Message


def test_tool_call_parsing(renderer) -> None:  # type: ignore[no-untyped-def]
    text = 'ok\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>'
    p = renderer.parse_assistant(text)
    assert p.content == "ok" and p.malformed_tool_calls == 0
    assert p.tool_calls[0].function.name == "bash"
    assert json.loads(p.tool_calls[0].function.arguments) == {"cmd": "ls -la"}


def test_malformed_and_unclosed_calls_are_counted_and_kept(renderer) -> None:  # type: ignore[no-untyped-def]
    p = renderer.parse_assistant('<tool_call>{"name": 1}</tool_call> and <tool_call>{"name"')
    assert p.tool_calls == [] and p.malformed_tool_calls == 2
    assert p.content.startswith("<tool_call>")


def test_assistant_tool_call_rerenders_as_generated(renderer) -> None:  # type: ignore[no-untyped-def]
    text = 'hm\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    p = renderer.parse_assistant(text)
    msg = Message(role="assistant", content=p.content, tool_calls=p.tool_calls)
    rendered = renderer.render_text([Message(role="user", content="u"), msg], None, False)
    assert text + "<|im_end|>" in rendered


def test_end_of_turn_and_alternate_eos(renderer) -> None:  # type: ignore[no-untyped-def]
    tok = renderer.tokenizer
    assert renderer.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.convert_tokens_to_ids("<|endoftext|>") in renderer.alt_eos_ids


def test_tools_render_the_same_after_crossing_a_process(renderer) -> None:  # type: ignore[no-untyped-def]
    """msgspec's omit_defaults drops `type` only when it is the default string object: a spec
    pickled by Ray must render as the local one does (not with an extra `"type": "function"`)."""
    import pickle

    from rl360.envs.tools import BUILTIN_TOOLS

    local = [t.spec for t in BUILTIN_TOOLS.values()]
    moved = pickle.loads(pickle.dumps(local))
    msgs = [Message(role="user", content="u")]
    a = renderer.render_text(msgs, local, add_generation_prompt=True)
    assert a == renderer.render_text(msgs, moved, add_generation_prompt=True)
    assert a.count('"type": "function"') == len(local)


def test_render_memo_gives_fresh_equal_ids(renderer) -> None:  # type: ignore[no-untyped-def]
    """A repeated render comes from the memo: equal to a render from scratch, and a copy
    (a caller that appends to its ids does not change the next caller's)."""
    from rl360.policies.chat import ChatRenderer

    msgs = [Message(role="system", content="be brief"), Message(role="user", content="hi")]
    first = renderer.render(msgs, None, True)
    first.append(-1)
    again = renderer.render(msgs, None, True)
    assert again == first[:-1]
    assert again == ChatRenderer(renderer.tokenizer).render(msgs, None, True)
    assert renderer.render(msgs, None, False) != again  # the flag is part of the key


def test_render_memo_is_off_for_a_template_that_reads_the_clock(renderer) -> None:  # type: ignore[no-untyped-def]
    import copy

    from rl360.policies.chat import ChatRenderer

    tok = copy.deepcopy(renderer.tokenizer)
    tok.chat_template = "{{ strftime_now('%d %b %Y') }}" + tok.chat_template
    r = ChatRenderer(tok)
    r.render([Message(role="user", content="hi")], None, True)
    assert not r._memo
