"""`serve.ingress`: the environment each choice gives the Serve processes, a one-line refusal
when HAProxy is asked for and there is none, and ray_session setting that environment for a
local cluster only while the session lasts."""

from __future__ import annotations

import os

import pytest

from rl360.launch import ingress
from rl360.recipe import RecipeError, ServeSection


def test_proxy_turns_haproxy_off_and_haproxy_gets_ports_of_its_own() -> None:
    assert ingress.ingress_env(ServeSection(), local=True) == {ingress.HAPROXY_FLAG: "0"}
    env = ingress.ingress_env(ServeSection(ingress="haproxy"), local=True)
    assert env[ingress.HAPROXY_FLAG] == "1"
    # HAProxy bounds an answer as Serve's request_timeout_s does for its Python proxy
    assert float(env[ingress.HAPROXY_SERVER_TIMEOUT]) == ingress.HTTP_REQUEST_TIMEOUT_S
    ports = {int(env[k]) for k in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")}
    assert len(ports) == 2 and not ports & {8404, 9101}  # not Serve's fixed defaults
    # on an existing cluster the nodes' own ports are not ours to pick
    assert ingress.ingress_env(ServeSection(ingress="haproxy"), local=False) == {
        ingress.HAPROXY_FLAG: "1", ingress.HAPROXY_SERVER_TIMEOUT: "960"}


def test_haproxy_without_a_binary_is_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress, "haproxy_binary", lambda: None)
    ingress.check_ingress(ServeSection())  # the proxy needs nothing
    with pytest.raises(RecipeError, match=r"^serve\.ingress: 'haproxy' needs the HAProxy binary"):
        ingress.check_ingress(ServeSection(ingress="haproxy"))


def test_ray_session_sets_the_env_for_a_local_cluster_and_restores_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from rl360 import ray_session as rs

    seen: dict[str, object] = {}

    class Ctx:
        address_info = {"address": "local"}
        dashboard_url = ""

    def fake_init(**kw: object) -> Ctx:
        seen["flag"] = os.environ.get(ingress.HAPROXY_FLAG)
        seen["runtime_env"] = kw.get("runtime_env")
        return Ctx()

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv(ingress.HAPROXY_FLAG, "was-set")
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with rs.ray_session(dashboard=False, env_vars={ingress.HAPROXY_FLAG: "1"}):
        assert os.environ[ingress.HAPROXY_FLAG] == "1"
    assert seen == {"flag": "1", "runtime_env": None}
    assert os.environ[ingress.HAPROXY_FLAG] == "was-set"
    # joining an existing cluster: the variables travel in the job's runtime env instead
    with rs.ray_session("127.0.0.1:6379", dashboard=False,
                        runtime_env={"env_vars": {"A": "b"}},
                        env_vars={ingress.HAPROXY_FLAG: "1"}):
        pass
    assert seen["runtime_env"] == {"env_vars": {"A": "b", ingress.HAPROXY_FLAG: "1"}}
    assert os.environ[ingress.HAPROXY_FLAG] == "was-set"
    # a local cluster that fails to start leaves the environment as it found it
    def failing_init(**kw: object) -> Ctx:
        raise RuntimeError("no cluster")

    monkeypatch.setattr(ray, "init", failing_init)
    with pytest.raises(RuntimeError, match="no cluster"), rs.ray_session(
            dashboard=False, env_vars={ingress.HAPROXY_FLAG: "1", "RL360_TEST_UNSET": "x"}):
        pass
    assert os.environ[ingress.HAPROXY_FLAG] == "was-set" and "RL360_TEST_UNSET" not in os.environ
