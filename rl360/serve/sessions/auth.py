"""Credentials of the session server: the server API key (for opening sessions, the
sessionless endpoints and /stats) and bearer-token parsing. Light: no FastAPI, no Ray."""

from __future__ import annotations

import ipaddress
import os
import secrets

API_KEY_ENV = "RL360_SERVE_API_KEY"


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_api_key(host: str, api_key: str) -> str:
    """The server API key (`serve.api_key`, else $RL360_SERVE_API_KEY); "" only on loopback."""
    key = api_key or os.environ.get(API_KEY_ENV, "")
    if key and not is_printable_ascii(key):
        raise ValueError("serve.api_key must be printable ASCII")
    if not key and not is_loopback(host):
        raise ValueError(
            f"serve.host={host!r} is reachable from other machines: set serve.api_key (or "
            f"{API_KEY_ENV}) so that opening sessions, /v1/* and /stats need it")
    return key


def is_printable_ascii(s: str) -> bool:
    return s.isascii() and s.isprintable()


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None when absent or malformed
    (non-ASCII, control characters, another scheme)."""
    if not header or len(header) > 4096:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not is_printable_ascii(token):
        return None
    return token


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison that never raises (non-ASCII input compares as bytes)."""
    if given is None:
        return False
    return secrets.compare_digest(given.encode("utf-8", "surrogatepass"),
                                  expected.encode("utf-8", "surrogatepass"))
