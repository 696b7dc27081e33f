"""Connecting to Ray: an existing cluster, or a local one started (and stopped) for the user.

A local cluster binds 127.0.0.1, turns usage stats off and token auth off (so `ray job submit`
and the dashboard work against it without a token), and is shut down on exit, Ctrl-C or
SIGTERM without leaving processes behind. Inside `ray job submit`, RAY_ADDRESS is set and the
job joins that cluster instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("rl360.cluster")

LOCAL_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# Serve's controller gives its HTTP proxy 5 s to answer a readiness check (10 s a health
# check) and replaces it after 3 misses in a row, failing the handles that wait on it. On a
# 2-core machine whose cores a trainer step and an engine fill (load average 5-17), the proxy
# missed three 5 s checks while a run started and the run died with ActorDiedError; a local
# cluster gives the checks a minute (defaults only: a value already set is kept).
# With the HAProxy ingress, a stopping replica stays reachable for Serve's draining period
# (30 s) so that load balancers can take it out; the local HAProxy reloads without it in
# under a second (0.3-0.5 s measured), so the 30 s only delayed every stop: `rl360 serve` with
# `serve.ingress = "haproxy"` took 35 s to stop on SIGTERM, 6 s with 2 s here.
LOCAL_SERVE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                   "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                   "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


class StopFlag:
    """Set by the first Ctrl-C / SIGTERM: long loops check it and wind down cleanly (Ray's
    blocking calls can swallow a KeyboardInterrupt). A second signal interrupts at once."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nrl360: {signal.Signals(signum).name}: stopping after the current step "
              "(again to stop now)", flush=True)


STOP = StopFlag()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a rendezvous or a server the session starts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def ray_session(
    address: str = "",
    num_cpus: int = 0,
    dashboard: bool = True,
    namespace: str = "rl360",
    runtime_env: dict[str, Any] | None = None,
    env_vars: dict[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yields {"address", "dashboard_url", "local"}; shuts Ray (and Serve) down on exit.
    `env_vars` reach every Ray process of the session: on a local cluster they are set for the
    cluster's processes (and restored here on exit), on an existing one they join the job's
    runtime env."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS", "")
    local = not address
    for k, v in LOCAL_ENV.items():
        if local or k == "RAY_USAGE_STATS_ENABLED":
            os.environ.setdefault(k, v)
    if local:  # the cluster's processes (Serve's controller among them) inherit these
        for k, v in LOCAL_SERVE_ENV.items():
            os.environ.setdefault(k, v)
    saved = {k: os.environ.get(k) for k in (env_vars or {})} if local else {}
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": True}
    if env_vars and local:
        os.environ.update(env_vars)
    elif env_vars:
        runtime_env = dict(runtime_env or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env_vars}
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if local:
        kwargs.update(
            address="local",  # always a new cluster of our own, never one found on disk
            num_cpus=num_cpus or None,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
        )
    else:
        kwargs["address"] = address
    try:
        ctx = ray.init(**kwargs)
    except BaseException:
        _restore_env(saved)
        raise
    STOP.requested = False
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, STOP)
    info = {
        "address": ctx.address_info.get("address", address),
        "dashboard_url": ("http://" + ctx.dashboard_url) if ctx.dashboard_url else "",
        "local": local,
    }
    try:
        yield info
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if local:
            with contextlib.suppress(Exception):
                from ray import serve

                serve.shutdown()
        ray.shutdown()
        _restore_env(saved)


def _restore_env(saved: dict[str, str | None]) -> None:
    """Put back the variables ray_session set for a local cluster (None: it was unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
