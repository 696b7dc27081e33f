"""Serve processes of the session path run user code and handle routers on one event loop:
the env vars reach every actor's runtime env without dropping the placement's own options."""

from __future__ import annotations

from rl360.launch.serve_app import SAME_LOOP_ENV, with_env


def test_with_env_adds_env_vars_and_keeps_the_rest() -> None:
    opts = {"num_cpus": 1, "resources": {"rollout": 1},
            "runtime_env": {"env_vars": {"A": "1"}, "pip": ["x"]}}
    out = with_env(opts, SAME_LOOP_ENV)
    assert out["num_cpus"] == 1 and out["resources"] == {"rollout": 1}
    assert out["runtime_env"]["pip"] == ["x"]
    assert out["runtime_env"]["env_vars"] == {"A": "1", **SAME_LOOP_ENV}
    assert opts["runtime_env"]["env_vars"] == {"A": "1"}  # the caller's dict is not changed
    assert with_env({}, SAME_LOOP_ENV) == {"runtime_env": {"env_vars": SAME_LOOP_ENV}}


def test_serve_bounds_every_http_request_after_the_session_servers_own_504() -> None:
    from rl360.launch.serve_app import http_options
    from rl360.recipe import ServeSection
    from rl360.serve.sessions.http import SHARD_REQUEST_TIMEOUT_S

    opts = http_options(ServeSection(host="127.0.0.1", port=8123))
    assert (opts["host"], opts["port"]) == ("127.0.0.1", 8123)
    assert SHARD_REQUEST_TIMEOUT_S < opts["request_timeout_s"] < float("inf")
