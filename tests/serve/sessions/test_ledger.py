"""The token ledger (TITO) invariants on multi-turn tool conversations. See docs/TITO.md."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from rl360.recipe import EngineSection, ModelSection, ServeSection
from rl360.serve.engines.scripted import ScriptedBackend
from rl360.serve.sessions.openai_types import ApiError, ChatCompletionRequest
from rl360.serve.sessions.service import LocalEngineClient, SessionService
from rl360.types import Generation, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
TWO_CALLS = (
    "Let me look.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"ls\"}}\n</tool_call>"
    "\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"pwd\"}}\n</tool_call>"
)
RULES = [
    ["BROKEN", "<tool_call>\n{\"name\": bash}\n</tool_call>"],
    ["/w\n</tool_response>", "There are 2 files."],
    ["list files", TWO_CALLS],
]


def make_service(renderer, rules=RULES, config: ServeSection | None = None,  # type: ignore[no-untyped-def]
                 **opts: Any) -> SessionService:
    be = ScriptedBackend(EngineSection(options={"rules": rules, **opts}), ModelSection(),
                         tokenizer=renderer.tokenizer)
    return service(renderer, LocalEngineClient(be), config)


def service(renderer, engine, config: ServeSection | None = None) -> SessionService:  # type: ignore[no-untyped-def]
    return SessionService(renderer, engine, config or ServeSection(),
                          max_model_len=ModelSection().max_model_len, model_name="rl360")


def req(messages: list[dict[str, Any]], **kw: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": messages, "tools": TOOLS, **kw}, ChatCompletionRequest)


def answer_tools(msgs: list[dict[str, Any]], reply: dict[str, Any]) -> None:
    msgs.append(reply)
    for tc in reply["tool_calls"]:
        out = "a.txt" if "ls" in tc["function"]["arguments"] else "/w"
        msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": out})


def state(traj: dict[str, Any]) -> dict[str, Any]:
    """What a rejected request must leave unchanged (counters may count the rejection)."""
    return {k: v for k, v in traj.items() if k != "counters"}


def check_invariants(traj: dict[str, Any]) -> None:
    n = len(traj["tokens"])
    assert len(traj["mask"]) == len(traj["logprobs"]) == len(traj["versions"]) == n
    assert len(traj["provenance"]) == n
    for m, lp, v, p in zip(traj["mask"], traj["logprobs"], traj["versions"], traj["provenance"],
                           strict=True):
        assert (m == 1) == (p == "generated")  # mask <=> provenance
        if m:
            assert lp is not None and lp <= 0 and v is not None
        else:
            assert lp is None and v is None


async def run_tool_conversation(svc: SessionService) -> tuple[dict[str, str], list[dict[str, Any]]]:
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "list files"}]
    out = await svc.chat(s["id"], s["token"], req(msgs))
    assert not isinstance(out, ApiError), out
    reply = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert [json.loads(tc["function"]["arguments"]) for tc in reply["tool_calls"]] == [
        {"cmd": "ls"}, {"cmd": "pwd"}]
    answer_tools(msgs, reply)
    out = await svc.chat(s["id"], s["token"], req(msgs))
    assert out["choices"][0]["message"]["content"] == "There are 2 files."
    msgs.append(out["choices"][0]["message"])
    return s, msgs


async def test_multi_turn_tool_conversation_rerenders_exactly(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s, _msgs = await run_tool_conversation(svc)
    traj = svc.trajectory(s["id"], s["token"])
    check_invariants(traj)
    assert traj["rerender"] == {"match": True}
    assert traj["turns"] == 2
    # the junction "\n" after <|im_end|> is in the ledger but was never generated
    assert "junction" in traj["provenance"]
    # the two parallel tool results were rendered as one group (one user turn)
    text = renderer.decode(traj["tokens"])
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 2


async def test_prompt_of_each_turn_extends_the_previous_turn(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    engine = svc.engine.backend  # type: ignore[attr-defined]
    s, _ = await run_tool_conversation(svc)
    first, second = engine.calls
    traj = svc.trajectory(s["id"], s["token"])
    gen1 = [t for t, p in zip(traj["tokens"], traj["provenance"], strict=True)][len(first):]
    assert second[: len(first)] == first  # prefix growth
    assert traj["tokens"][: len(second)] == second  # engine fidelity
    assert gen1[0] == traj["tokens"][len(first)]


async def test_truncated_turn_rejected_when_configured_but_can_be_retried(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer, config=ServeSection(truncated="reject"))
    s = svc.open()
    msgs = [{"role": "user", "content": "list files"}]
    out = await svc.chat(s["id"], s["token"], req(msgs, max_tokens=5))
    assert out["choices"][0]["finish_reason"] == "length"
    msgs.append(out["choices"][0]["message"])
    msgs.append({"role": "user", "content": "go on"})
    before = svc.trajectory(s["id"], s["token"])
    err = await svc.chat(s["id"], s["token"], req(msgs))
    assert isinstance(err, ApiError) and err.status == 409 and err.code == "truncated"
    assert state(svc.trajectory(s["id"], s["token"])) == state(before)  # atomic rejection
    # the same first request again branches from before the cut (a retry)
    out = await svc.chat(s["id"], s["token"], req(msgs[:1]))
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    traj = svc.trajectory(s["id"], s["token"])
    assert traj["counters"]["retry"] == 1 and traj["turns"] == 1
    check_invariants(traj)
    # the cut node stays a leaf (TITO invariant 11); both attempts are kept as samples
    forest = {n["id"]: n for n in traj["forest"]}
    assert all(not n["children"] for n in forest.values() if n["finish_reason"] == "length")
    assert len(traj["picked"]) == 2 and len(traj["branches"]) == 1


async def test_divergent_history_branches_and_changed_tools_open_a_root(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s, msgs = await run_tool_conversation(svc)
    before = svc.trajectory(s["id"], s["token"])
    edited = [dict(m) for m in msgs]
    edited[1]["content"] = "list ALL files"
    edited.append({"role": "user", "content": "thanks"})
    out = await svc.chat(s["id"], s["token"], req(edited))
    assert not isinstance(out, ApiError), out
    other_tools = msgspec.convert({"messages": [*msgs, {"role": "user", "content": "x"}],
                                   "tools": []}, ChatCompletionRequest)
    out = await svc.chat(s["id"], s["token"], other_tools)
    assert not isinstance(out, ApiError), out
    traj = svc.trajectory(s["id"], s["token"])
    # nothing stored was changed: the old line is still a picked leaf, token for token
    old = [b for b in traj["branches"] if b["tokens"] == before["tokens"]]
    assert len(old) == 1 and old[0]["rerender"] == {"match": True}
    assert traj["counters"]["new_root"] == 2 and traj["counters"]["render_config_changed"] == 1
    assert len([n for n in traj["forest"] if n["parent"] is None]) == 3
    check_invariants(traj)


async def test_client_reserialised_arguments_still_match(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    out = await svc.chat(s["id"], s["token"], req(msgs))
    reply = out["choices"][0]["message"]
    for tc in reply["tool_calls"]:  # a client that re-serialises arguments compactly
        tc["function"]["arguments"] = json.dumps(json.loads(tc["function"]["arguments"]),
                                                 separators=(",", ":"))
    reply["content"] = reply["content"] or None
    answer_tools(msgs, reply)
    out = await svc.chat(s["id"], s["token"], req(msgs))
    assert not isinstance(out, ApiError)


async def test_malformed_tool_call_is_content_and_counted(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s = svc.open()
    out = await svc.chat(s["id"], s["token"], req([{"role": "user", "content": "BROKEN"}]))
    msg = out["choices"][0]["message"]
    assert "tool_calls" not in msg and "<tool_call>" in msg["content"]
    assert out["rl360"]["malformed_tool_calls"] == 1
    assert svc.trajectory(s["id"], s["token"])["counters"]["malformed_tool_calls"] == 1


async def test_client_injected_assistant_is_prompt_not_trained(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    out = await svc.chat(s["id"], s["token"], req(msgs))
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "example?"},
             {"role": "assistant", "content": "an injected example"},
             {"role": "user", "content": "now you"}]
    out = await svc.chat(s["id"], s["token"], req(msgs))
    traj = svc.trajectory(s["id"], s["token"])
    check_invariants(traj)
    injected = [t for t, p in zip(traj["tokens"], traj["provenance"], strict=True)
                if p == "client_assistant"]
    assert "an injected example" in renderer.decode(injected)
    assert traj["rerender"]["match"]


class _FixedEngine:
    """Returns given ids; used for alternate-EOS and stop-string cases."""

    def __init__(self, outputs: list[Generation]) -> None:
        self.outputs = outputs

    async def generate(self, ids: list[int], sp: SamplingParams, key: str | None) -> Generation:
        return self.outputs.pop(0)


def _gen(ids: list[int], kind: str, stop_string: str | None = None) -> Generation:
    return Generation(ids, [-0.5] * len(ids), "stop", 3, [3] * len(ids), stop_kind=kind,
                      stop_string=stop_string)


async def test_alternate_eos_is_kept_and_counted(renderer) -> None:  # type: ignore[no-untyped-def]
    alt = renderer.alt_eos_ids[0]
    ids = [*renderer.encode("hi"), alt]
    svc = service(renderer, _FixedEngine([_gen(ids, "eos"), _gen(ids, "eos")]))
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    out = await svc.chat(s["id"], s["token"], req(msgs))
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "b"}]
    await svc.chat(s["id"], s["token"], req(msgs))
    traj = svc.trajectory(s["id"], s["token"])
    assert traj["counters"]["eos_alias"] == 2
    assert traj["tokens"].count(alt) == 2  # the model's own id is kept
    assert traj["rerender"]["eos_alias"] >= 1 and traj["rerender"]["special_token_type"] == 0
    check_invariants(traj)


async def test_stop_string_gets_a_synthetic_end_of_turn(renderer) -> None:  # type: ignore[no-untyped-def]
    ids = renderer.encode("answer: 42 END")
    svc = service(renderer, _FixedEngine([_gen(ids, "stop_string", "END"),
                                          _gen([*renderer.encode("ok"), renderer.end_of_turn_id], "eos")]))
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    out = await svc.chat(s["id"], s["token"], req(msgs, stop=["END"]))
    assert out["choices"][0]["message"]["content"] == "answer: 42 "
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "more"}]
    await svc.chat(s["id"], s["token"], req(msgs))
    traj = svc.trajectory(s["id"], s["token"])
    assert traj["counters"]["synthetic_eos"] == 1 and traj["counters"]["stopped_on_string"] == 1
    eot_positions = [i for i, t in enumerate(traj["tokens"]) if t == renderer.end_of_turn_id]
    assert any(traj["provenance"][i] == "junction" for i in eot_positions)
    check_invariants(traj)


async def test_concurrent_requests_in_one_session_become_siblings(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer, delay_s=0.05)
    s = svc.open()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    out = await svc.chat(s["id"], s["token"], req(msgs))
    msgs += [out["choices"][0]["message"], {"role": "user", "content": "list files"}]
    a, b = await asyncio.gather(svc.chat(s["id"], s["token"], req(msgs)),
                                svc.chat(s["id"], s["token"], req(msgs)))
    assert not isinstance(a, ApiError) and not isinstance(b, ApiError)
    traj = svc.trajectory(s["id"], s["token"])
    forest = traj["forest"]
    assert [n["parent"] for n in forest] == [None, 0, 0]
    assert {n["response_id"] for n in forest[1:]} == {a["id"], b["id"]}
    assert traj["turns"] == 2 and len(traj["branches"]) == 1
    check_invariants(traj)


async def test_control_fields_and_n_are_refused(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s = svc.open()
    for extra in ({"input_ids": [1, 2]}, {"n": 0}, {"n": 100}, {"max_tokens": 0},
                  {"temperature": -1}):
        out = await svc.chat(s["id"], s["token"], req([{"role": "user", "content": "x"}], **extra))
        assert isinstance(out, ApiError) and out.status in (400, 422), extra
    assert svc.trajectory(s["id"], s["token"])["tokens"] == []


async def test_auth_and_unknown_session(renderer) -> None:  # type: ignore[no-untyped-def]
    svc = make_service(renderer)
    s = svc.open()
    r = req([{"role": "user", "content": "x"}])
    assert (await svc.chat(s["id"], "wrong", r)).status == 401  # type: ignore[union-attr]
    assert (await svc.chat(s["id"], None, r)).status == 401  # type: ignore[union-attr]
    assert (await svc.chat("nope", s["token"], r)).status == 404  # type: ignore[union-attr]


def test_unknown_matcher_is_a_clear_error(renderer) -> None:  # type: ignore[no-untyped-def]
    from rl360.serve.sessions.ledger import LedgerError

    with pytest.raises(LedgerError, match="unknown message matcher"):
        make_service(renderer).open(matcher="fuzzy")


async def test_priority_reaches_the_engine_and_a_bad_one_is_refused(renderer) -> None:  # type: ignore[no-untyped-def]
    """vLLM's `priority` extension: lower is scheduled first (the torch engine's queue)."""
    be = ScriptedBackend(EngineSection(options={"rules": RULES}), ModelSection(),
                         tokenizer=renderer.tokenizer)
    seen: list[int] = []
    inner = be.generate

    async def generate(ids: list[int], sampling: Any) -> Any:
        seen.append(sampling.priority)
        return await inner(ids, sampling)

    be.generate = generate  # type: ignore[method-assign]
    svc = service(renderer, LocalEngineClient(be))
    s = svc.open()
    for extra, want in (({"priority": 7}, 7), ({}, 0)):
        out = await svc.chat(s["id"], s["token"], req([{"role": "user", "content": "x"}], **extra))
        assert not isinstance(out, ApiError) and seen[-1] == want
    bad = await svc.chat(s["id"], s["token"],
                         req([{"role": "user", "content": "y"}], priority=2**40))
    assert isinstance(bad, ApiError) and bad.code == "bad_priority" and len(seen) == 2
