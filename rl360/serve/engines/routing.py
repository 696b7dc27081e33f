"""Session-sticky request routing for engine replicas (a Ray Serve request router).

Every call of one session goes to the same engine replica, so the replica can reuse the
session's prefix. The replica is chosen by rendezvous hashing of the session id over the
live replicas: when replicas come or go, only the sessions of those replicas move. Calls
without a session id fall back to a random pair ranked by queue length (as Serve's default).
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)


def _score(session_id: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}|{replica_id}".encode(), digest_size=8).digest())


def rank_replicas(session_id: str, replica_ids: list[str]) -> list[str]:
    """Replica ids in preference order for a session (pure; tested without Serve)."""
    return sorted(replica_ids, key=lambda r: _score(session_id, r), reverse=True)


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = ""
        if pending_request is not None:
            key = pending_request.metadata.session_id or pending_request.metadata.multiplexed_model_id
        if key:
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            order = rank_replicas(key, list(by_id))
            # first choice alone in rank 1: the router retries it while it is busy; the rest
            # only if it cannot take the request (gone or over max_ongoing_requests)
            return [[by_id[order[0]]], [by_id[r] for r in order[1:]]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
