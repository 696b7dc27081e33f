"""`load_tokenizer`'s direct path for the generic tokenizers-library class: the same tokenizer
AutoTokenizer builds, without importing torch (a session shard's start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl360.policies.chat import ChatRenderer
from rl360.policies.loading import load_tokenizer, resolve_model_path
from rl360.types import FunctionCall, FunctionSpec, Message, ToolCall, ToolSpec
from tests.fresh import last_line

CHATS = [
    [Message(role="system", content="be brief"), Message(role="user", content="héllo <x> 12+3")],
    [Message(role="user", content="list files"),
     Message(role="assistant", content="", tool_calls=[ToolCall(
         id="c1", function=FunctionCall(name="bash", arguments='{"cmd": "ls"}'))]),
     Message(role="tool", content="a.py\nb.py", tool_call_id="c1")],
]
TOOLS = [ToolSpec(function=FunctionSpec(name="bash", description="run a command",
                                        parameters={"type": "object"}))]


def _models() -> list[str]:
    out = ["tiny", "tiny:demo"]
    smol = Path.home() / ".cache" / "rl360" / "smollm2-135m-instruct"
    if (smol / "tokenizer.json").is_file():  # converted by an earlier smollm2 test run
        out.append(str(smol))
    return out


@pytest.mark.parametrize("model", _models())
def test_direct_path_matches_auto_tokenizer(model: str) -> None:
    from transformers import AutoTokenizer

    path = resolve_model_path(model)
    cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    ours, auto = load_tokenizer(model), AutoTokenizer.from_pretrained(path)
    assert cls in ("TokenizersBackend", "PreTrainedTokenizerFast")  # the direct path ran
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert ours.all_special_ids == auto.all_special_ids
    assert (ours.eos_token, ours.eos_token_id) == (auto.eos_token, auto.eos_token_id)
    a, b = ChatRenderer(ours), ChatRenderer(auto)
    assert (a.end_of_turn_id, a.alt_eos_ids, a.special_ids) == \
           (b.end_of_turn_id, b.alt_eos_ids, b.special_ids)
    for chat in CHATS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                assert a.render(chat, tools, gen) == b.render(chat, tools, gen)
    text = "def f(x):\n    return x * 12  # ünï"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == auto.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == auto.decode(ids) == text


def test_other_classes_go_through_auto_tokenizer(tmp_path: Path) -> None:
    """A tokenizer_config.json naming a model-specific class (or none) is AutoTokenizer's."""
    from rl360.policies.loading import _tokenizer_class

    src = resolve_model_path("tiny")
    for f in src.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    assert _tokenizer_class(tmp_path) == "TokenizersBackend"
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert _tokenizer_class(tmp_path) == "GPT2Tokenizer"
    (tmp_path / "tokenizer.json").unlink()
    assert _tokenizer_class(tmp_path) == ""  # the generic class needs tokenizer.json


def test_a_session_shard_starts_without_torch() -> None:
    """The shard's constructor (tokenizer, renderer, service) in a fresh interpreter."""
    code = (
        "import sys\n"
        "from rl360.recipe import ModelSection, ServeSection\n"
        "from rl360.serve.sessions.shard import SessionShard\n"
        "SessionShard(ModelSection(path='tiny'), ServeSection(), 'm', object())\n"
        "print('torch' in sys.modules)\n"
    )
    assert last_line(code) == "False"
