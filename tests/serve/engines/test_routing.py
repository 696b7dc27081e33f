"""Session-sticky routing: rendezvous hashing keeps sessions put when replicas change."""

from rl360.serve.engines.routing import rank_replicas


def test_same_session_same_replica_and_minimal_movement() -> None:
    replicas = [f"r{i}" for i in range(4)]
    sessions = [f"s{i}" for i in range(400)]
    first = {s: rank_replicas(s, replicas)[0] for s in sessions}
    assert first == {s: rank_replicas(s, list(reversed(replicas)))[0] for s in sessions}
    counts = {r: sum(1 for v in first.values() if v == r) for r in replicas}
    assert min(counts.values()) > 50  # spread over every replica
    after = {s: rank_replicas(s, replicas[:3])[0] for s in sessions}  # r3 goes away
    moved = [s for s in sessions if first[s] != after[s]]
    assert all(first[s] == "r3" for s in moved)
