"""The sharded collective transport (`train.weight_sync = {transport = "collective", sharded =
true}`): every trainer rank sends the weights it holds, over groups that heal, and fails loudly.

- Senders: each trainer rank sends its part (rl360.weights.shards: an fsdp rank its shards, in
  the engines' dtype, in buckets of `bucket_mb`) over a group of its own with every replica of
  the current epoch; the ranks send at once and a replica receives from all of them at once.
- Epochs of membership: the replicas of a group are the live registered ones (a replica's Ray
  actor still exists). When that set changes (a replica joined, died or was replaced) the next
  sync forms new groups (a new epoch) with the live set; a version that failed in flight is
  sent again in a new epoch (the publisher takes the same version again in a newer epoch; a
  replica that already serves it receives it and does not apply it). Between steps, while the
  trainer waits for its batch, `heal` forms an epoch with a replica that (re)started, so it
  takes the newest version before it serves; the others keep serving meanwhile.
- Timeouts: a sync that forms groups is bounded by `timeout_s`; every other one, every
  broadcast in it and every wait on a replica by `timeout_factor` x the slowest of the last
  syncs measured here, at least `timeout_min_s`. A replica that does not take a version
  within it is named in one line (`say`), then, by `on_failure`, replaced (its actor killed:
  Serve starts another) while the version goes to the others again, or the run stops with
  that line (`WeightSyncFailed`). A replica found dead is let go and the version sent again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rl360.recipe import CollectiveSync
from rl360.weights.sender_calls import ShardChecksums, ShardLayout, ShardListen, ShardSend

log = logging.getLogger("rl360.weights")

MAX_ATTEMPTS = 4  # tries of one version before the run stops
REPORT_GRACE_S = 2.0  # after a failed send: how long replicas' reports may still arrive
REGISTER_S = 600.0  # the first sync's wait for the replicas to register (engines loading)


class WeightSyncFailed(RuntimeError):
    """A version that could not reach the engines; its message is one line."""


class SyncClock:
    """The timeouts of a sharded sync, from the syncs measured so far."""

    def __init__(self, options: CollectiveSync, keep: int = 5) -> None:
        self.options = options
        self.recent: deque[float] = deque(maxlen=keep)

    def forming(self) -> float:
        return self.options.timeout_s

    def steady(self) -> float:
        if not self.recent:
            return self.options.timeout_s
        return max(self.options.timeout_min_s, self.options.timeout_factor * max(self.recent))


class ShardedTransport:
    """`trainer`: the TrainerGroup (or a list of sender actors, one per rank, whose
    `weights(call)` runs rl360.weights.sender calls); `replicas`: how many register before the
    first sync; `dtype`: the engines' dtype; `say`: where the one-line failure reports go."""

    def __init__(self, serving: Any, trainer: Any, replicas: int, options: CollectiveSync,
                 dtype: str | None = None, say: Callable[[str], None] | None = None) -> None:
        self.pub = serving.publisher
        self.senders = list(getattr(trainer, "workers", trainer))
        self.replicas, self.options, self.dtype = replicas, options, dtype
        self.say = say or log.warning
        self.clock = SyncClock(options)
        self.epoch = 0
        self.members: dict[str, int] = {}  # replica -> rank in this epoch's groups
        self.addrs: dict[int, tuple[str, int]] = {}  # sending rank -> its rendezvous
        self.plan: Any = None
        self._plan_ref: list[Any] = []
        self.published = 0
        self.last: dict[str, Any] = {}
        self.last_reports: list[Any] = []  # SyncReport per replica (the checksum option)

    # ------------------------------------------------------------------ the plan

    def _make_plan(self) -> None:
        import ray

        from rl360.weights.shards import bucket_limit, combine

        o = self.options
        # the first sync waits for the engines to load (at least REGISTER_S)
        ray.get(self.pub.wait_registered.remote(self.replicas, max(o.timeout_s, REGISTER_S)))
        parts = ray.get([s.weights.remote(ShardLayout(self.dtype, o.bucket_mb))
                         for s in self.senders], timeout=o.timeout_s)
        self.plan = combine(parts, bucket_limit(o.bucket_mb))
        self._plan_ref = [ray.put(self.plan)]

    # ------------------------------------------------------------------ membership

    def _alive(self, info: dict[str, Any]) -> bool:
        import ray

        if not info.get("actor"):
            return True  # not a named actor (a test's replica): only timeouts tell
        try:
            ray.get_actor(info["actor"], namespace=info.get("namespace") or None)
            return True
        except ValueError:
            return False

    def _live(self) -> dict[str, dict[str, Any]]:
        """The registered replicas whose actors still exist; the others are let go."""
        import ray

        members: dict[str, dict[str, Any]] = ray.get(self.pub.members.remote())
        live = {}
        for r, info in members.items():
            if self._alive(info):
                live[r] = info
            else:
                ray.get(self.pub.forget.remote(r))
                if r in self.members:
                    self.say(f"weight sync: replica {r} is gone; the groups re-form without it")
        return live

    def _form(self, live: list[str]) -> None:
        import ray

        self.epoch += 1
        self.members = {r: i + 1 for i, r in enumerate(sorted(live))}
        world = len(live) + 1
        ranks = self.plan.senders()
        got = ray.get([self.senders[r].weights.remote(
            ShardListen(self.epoch, world, self.clock.forming())) for r in ranks],
            timeout=self.clock.forming())
        self.addrs = {r: (str(a[0]), int(a[1])) for r, a in zip(ranks, got, strict=True)}
        log.info("weight sync: epoch %d, replicas %s", self.epoch, sorted(self.members))

    def changed(self) -> bool:
        """The registered replicas are not this epoch's (one joined, or one was let go)."""
        import ray

        return set(ray.get(self.pub.members.remote())) != set(self.members)

    # ------------------------------------------------------------------ a version

    def publish(self, version: int) -> bool:
        """Send `version` to every live replica; True once each took it. Raises
        WeightSyncFailed (one line) when it cannot."""
        if self.plan is None:
            self._make_plan()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            live = self._live() or self._await_members(version)
            forming = set(live) != set(self.members)
            if forming:
                self._form(list(live))
            if self._attempt(version, forming, live, attempt):
                self.published = version
                return True
            self.members = {}  # the next attempt forms a new epoch
        raise WeightSyncFailed(f"weight sync: version {version} did not reach the engines in "
                               f"{MAX_ATTEMPTS} attempts; stopping")

    def heal(self, version: int) -> bool:
        """Between steps (the trainer idle, its weights those of `version`): when replicas
        joined or left since the last sync, send `version` over a new epoch, so a replica
        that (re)started takes it before it serves. False when nothing changed."""
        if not self.published or not self.changed():
            return False
        return self.publish(version)

    def _await_members(self, version: int) -> dict[str, dict[str, Any]]:
        """The live replicas once one registers (Serve starting replacements)."""
        import ray

        deadline = time.monotonic() + self.clock.forming()
        while time.monotonic() < deadline:
            try:
                ray.get(self.pub.wait_registered.remote(1, deadline - time.monotonic()))
            except Exception:
                break
            live = self._live()
            if live:
                return live
            time.sleep(0.5)
        raise WeightSyncFailed(f"weight sync: no live engine replica registered within "
                               f"{self.clock.forming():g}s to take version {version}; stopping")

    def _attempt(self, version: int, forming: bool, live: dict[str, dict[str, Any]],
                 attempt: int) -> bool:
        import ray

        o = self.options
        limit = self.clock.forming() if forming else self.clock.steady()
        form_s = self.clock.forming()
        payload = {"kind": "sharded", "version": version, "epoch": self.epoch,
                   "members": dict(self.members), "senders": dict(self.addrs),
                   "world": len(self.members) + 1, "backend": o.backend,
                   "plan": self._plan_ref, "plan_id": id(self.plan),
                   "form_timeout_s": form_s, "timeout_s": limit,
                   "checksum": o.backend == "gloo" or o.checksum, "verify": o.checksum,
                   "names": self._names() if o.checksum else []}
        t0 = time.monotonic()
        if not ray.get(self.pub.publish_sharded.remote(version, payload)):
            raise WeightSyncFailed(f"weight sync: the publisher refused version {version} "
                                   f"(epoch {self.epoch}): a newer one is out")
        sends = [self.senders[r].weights.remote(ShardSend(
            self.epoch, version, o.backend, form_s, limit, payload["checksum"]))
            for r in self.plan.senders()]
        budget = (form_s if forming else 0.0) + limit
        done, _ = ray.wait(sends, num_returns=len(sends), timeout=budget + REPORT_GRACE_S)
        results, errors = [], []
        for ref in sends:
            if ref not in done:
                errors.append("a trainer rank's send did not return")
                continue
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayTaskError as exc:
                errors.append(str(exc.cause if exc.cause is not None else exc).splitlines()[0])
        # the replicas' answers: each took it, or reported why not (a receive that timed out
        # behind a sender stuck on another replica); one that says nothing is the one to blame
        left = max(0.0, t0 + budget + 2 * REPORT_GRACE_S - time.monotonic())
        missing = ray.get(self.pub.wait_taken.remote(version, self.epoch, list(self.members),
                                                     left))
        took = time.monotonic() - t0
        if not errors and not missing:
            # a measured sync: without forming the groups (the ranks' form_s)
            self.clock.recent.append(took - max((r["form_s"] for r in results), default=0.0))
            self._record(version, took, results, forming)
            if o.checksum:
                self.last_reports = self._verify(version, limit)
            return True
        self._failed(version, limit, missing, errors, live, attempt)
        return False

    def _names(self) -> list[str]:
        return [n for n, _, _ in self.plan.spec] + list(self.plan.aliases)

    def _verify(self, version: int, limit: float) -> list[Any]:
        """The checksum option: each replica's per-tensor checksums of what it serves against
        the sum of the ranks' parts (rl360.weights.shards.full_checksums); every mismatch is
        logged by name."""
        import ray

        from rl360.weights.plan import compare_checksums
        from rl360.weights.shards import full_checksums

        reports = ray.get(self.pub.wait_checksums.remote(version, len(self.members), limit))
        parts = ray.get([self.senders[r].weights.remote(ShardChecksums())
                         for r in self.plan.senders()], timeout=limit)
        want = full_checksums(parts, self.plan.aliases)
        out = []
        for replica, rep in sorted(reports.items()):
            got = {n: int(v[1]) for n, v in rep["sums"].items()}
            report = compare_checksums(want, got, version=version, replica=replica)
            (log.info if report.ok else log.error)("weight checksum: %s", report.summary())
            out.append(report)
        return out

    def _record(self, version: int, took: float, results: list[dict[str, Any]],
                forming: bool) -> None:
        peaks = [r["peak_extra_bytes"] for r in results if r.get("peak_extra_bytes") is not None]
        self.last = {"kind": "sharded", "version": version, "epoch": self.epoch,
                     "replicas": len(self.members), "nbytes": self.plan.nbytes,
                     "sync_s": took, "formed": forming,
                     "send_s": max((r["send_s"] for r in results), default=0.0),
                     "form_s": max((r["form_s"] for r in results), default=0.0),
                     "rank_peak_extra_bytes": max(peaks) if peaks else None,
                     "ranks": [{k: r[k] for k in ("rank", "bytes", "buckets", "send_s",
                                                  "peak_extra_bytes")} for r in results]}

    def _failed(self, version: int, limit: float, missing: dict[str, str], errors: list[str],
                live: dict[str, dict[str, Any]], attempt: int) -> None:
        """One line per replica that did not take the version (and said nothing), and the
        fault rules."""
        import ray

        dead = [r for r in self.members if not self._alive(live.get(r, {}))]
        for r in dead:
            ray.get(self.pub.forget.remote(r))
            self.say(f"weight sync: replica {r} died while taking version {version} (epoch "
                     f"{self.epoch}); sending it again without it")
        if dead:
            return
        silent = sorted(r for r, why in missing.items() if not why)
        if not silent:  # every replica answered: the failure is the senders'; send it again
            why = "; ".join(errors + [f"{r}: {w}" for r, w in sorted(missing.items())])
            self.say(f"weight sync: version {version} (epoch {self.epoch}) failed "
                     f"({why[:300]}); sending it again")
            return
        for r in silent:
            line = (f"weight sync: replica {r} did not take version {version} within "
                    f"{limit:.3g}s (epoch {self.epoch}, attempt {attempt})")
            if self.options.on_failure == "stop":
                raise WeightSyncFailed(f"{line}; stopping (train.weight_sync.on_failure = "
                                       "'stop')")
            self.say(f"{line}; replacing it")
            self._replace(r, live.get(r, {}))

    def _replace(self, replica: str, info: dict[str, Any]) -> None:
        """Kill the replica's actor (Serve starts another, which takes the newest version
        before it serves) and let it go."""
        import ray

        if info.get("actor"):
            try:
                ray.kill(ray.get_actor(info["actor"], namespace=info.get("namespace") or None),
                         no_restart=False)
            except ValueError:
                pass  # gone already
        ray.get(self.pub.forget.remote(replica))
