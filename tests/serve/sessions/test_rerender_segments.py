"""The re-render check's classification (TITO invariant 7): a special token the model generates
in the middle of its reply splits the reply, and what follows it is still the model's text
(`assistant_text`, counted), never a difference in the prompt (`non_assistant_text`, which must
stay 0)."""

from __future__ import annotations

from rl360.serve.sessions.matching import compare_segments


def test_text_after_a_generated_special_token_is_assistant_text(renderer) -> None:  # type: ignore[no-untyped-def]
    r = renderer
    start = r.tokenizer.convert_tokens_to_ids("<|im_start|>")
    user = [start, *r.encode("user\nhi"), r.end_of_turn_id]
    head = [start, *r.encode("assistant\n")]
    reply = [*r.encode("ok"), start, *r.encode("zz")]  # generated, a special token inside
    ledger = user + head + reply
    mask = [0] * (len(user) + len(head)) + [1] * len(reply)
    # the re-render of the reply's text differs after the special token (bytes that did not
    # survive decoding, say)
    rendered = user + head + [*r.encode("ok"), start, *r.encode("z?")]
    assert compare_segments(ledger, rendered, r, mask)["assistant_text"] == 1
    assert compare_segments(ledger, rendered, r, mask)["non_assistant_text"] == 0
    # without the mask the split-off part was taken for a prompt difference
    assert compare_segments(ledger, rendered, r)["non_assistant_text"] == 1
    # a difference in the user's turn stays a prompt difference
    changed = [start, *r.encode("user\nho"), r.end_of_turn_id, *head, *reply]
    out = compare_segments(ledger, changed, r, mask)
    assert out["non_assistant_text"] == 1 and out["assistant_text"] == 0
