"""The real torch engine behind Serve: sticky sessions over 2 replicas, versioned weights
published to every replica, and a session over /v1/completions."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serving import open_session, serving

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", params=[False, True], ids=["in-replica", "core-process"])
def app(request, ray_cluster):  # type: ignore[no-untyped-def]
    """Each test with the engine in its replica, then as engine.core_process (the engine in a
    child process; session shards reach it over its channel)."""
    with serving(["engine.replicas=2", "serve.default_max_tokens=8",
                  f"engine.core_process={str(request.param).lower()}"]) as h:
        h.core_process = request.param
        yield h


def chat(app, sid: str, token: str, msgs: list[dict]) -> dict:  # type: ignore[no-untyped-def]
    r = httpx.post(f"{app.base_url}/sessions/{sid}/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {token}"},
                   json={"messages": msgs, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_session_sticks_to_one_replica(app) -> None:  # type: ignore[no-untyped-def]
    seen: dict[str, set[str]] = {}
    for _ in range(12):  # all on one replica by chance: 2 / 2**12 (with 6: 3%, and it happened)
        sid, token = open_session(app.base_url)
        for _ in range(3):  # the first turn, then two retries of it
            out = chat(app, sid, token, [{"role": "user", "content": f"q{sid[:4]}"}])
            seen.setdefault(sid, set()).add(out["rl360"]["engine_replica"])
    assert all(len(v) == 1 for v in seen.values()), seen
    assert len(set().union(*seen.values())) == 2, "sessions should spread over both replicas"


def test_published_weights_reach_every_replica(app) -> None:  # type: ignore[no-untyped-def]
    from rl360.policies.loading import resolve_model_path

    sids = [open_session(app.base_url) for _ in range(6)]
    msgs = [{"role": "user", "content": "hello"}]
    before = {chat(app, s, t, msgs)["rl360"]["policy_version"] for s, t in sids}
    assert before == {0}
    from safetensors.torch import load_file

    state = load_file(str(resolve_model_path("tiny") / "model.safetensors"))
    state = {k: v + 0.01 for k, v in state.items()}
    assert app.publish_weights(1, state)
    assert not app.publish_weights(1, state)  # versions only move forward
    deadline = time.monotonic() + 30
    while len(app.weight_status()["applied"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert {v for v, _ in app.weight_status()["applied"].values()} == {1}
    replicas = set()
    for s, t in sids:  # retries of the same turn, now answered by version 1
        out = chat(app, s, t, msgs)
        assert out["rl360"]["policy_version"] == 1
        replicas.add(out["rl360"]["engine_replica"])
    traj = httpx.get(f"{app.base_url}/sessions/{sids[0][0]}/trajectory",
                     headers={"Authorization": f"Bearer {sids[0][1]}"}).json()
    assert {v for v, m in zip(traj["versions"], traj["mask"], strict=True) if m} == {1}


def test_completions_session_extends_its_prompt(app) -> None:  # type: ignore[no-untyped-def]
    sid, token = open_session(app.base_url)
    h = {"Authorization": f"Bearer {token}"}
    url = f"{app.base_url}/sessions/{sid}/v1/completions"
    r1 = httpx.post(url, headers=h, json={"prompt": "def f(x):", "max_tokens": 5}, timeout=60).json()
    prompt2 = "def f(x):" + r1["choices"][0]["text"] + "\n"
    traj = httpx.get(f"{app.base_url}/sessions/{sid}/trajectory", headers=h).json()
    # extending the recorded tokens is accepted; text that re-tokenizes differently is not
    r2 = httpx.post(url, headers=h, json={"prompt": traj["tokens"] + [10], "max_tokens": 5}, timeout=60)
    assert r2.status_code == 200, r2.text
    # a prompt that does not extend the recorded tokens opens a new root of the forest
    r3 = httpx.post(url, headers=h, json={"prompt": "something else", "max_tokens": 5}, timeout=60)
    assert r3.status_code == 200, r3.text
    traj = httpx.get(f"{app.base_url}/sessions/{sid}/trajectory", headers=h).json()
    assert [n["parent"] for n in traj["forest"]] == [None, 0, None]
    assert sum(traj["branches"][0]["mask"]) == 10 and sum(traj["mask"]) == 5
    assert len(prompt2) > 0


@pytest.mark.parametrize("app", [True], indirect=True, ids=["core-process"])
def test_core_process_engines_take_the_shards_calls_over_their_channels(app) -> None:  # type: ignore[no-untyped-def]
    assert app.core_process
    engines = app.weight_status()["engines"]
    assert len(engines) == 2 and all(e["core_process"] and e["channel"] for e in engines.values())
    deadline = time.monotonic() + 30
    while True:  # health reaches the publisher every poll (2 s)
        sid, token = open_session(app.base_url)
        out = chat(app, sid, token, [{"role": "user", "content": "over the channel"}])
        assert out["rl360"]["engine_replica"] in engines
        direct = sum(e.get("direct_requests", 0) for e in app.weight_status()["engines"].values())
        if direct > 0:
            break
        assert time.monotonic() < deadline, "no generation came over a core's channel"
        time.sleep(0.5)
