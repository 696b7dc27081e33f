"""The WeightPublisher actor: the newest weight version, announced to every engine replica.

Serve does not let a caller address every replica of a deployment, so replicas pull: the
trainer side puts a version in the object store (or a weight slot, or starts a collective
broadcast) and publishes it here; every engine replica long-polls the publisher in a named
background task (rl360.weights.follow.follow_weights) and applies newer versions between
batches. A replica that starts late fetches the newest version at once. Versions only move
forward; an older or equal version is ignored by the backend, which logs it.

Sharded collective syncs (rl360.weights.shard_transport) also carry an epoch of membership: the
same version may be announced again in a newer epoch (sent again to a re-formed group), and a
replica polling with the epoch it last took part in is woken by a newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rl360.weights")

# a publisher that Ray restarted knows nobody's weight slot until every replica has reported
# once (each does every poll, ~2 s): it takes no version in a slot for this long
SLOT_GRACE_S = 10.0


class WeightPublisher:
    """Ray actor: holds the newest (version, [state ref]) and wakes waiting replicas."""

    def __init__(self) -> None:
        self.version = 0
        self.epoch = 0  # the sharded collective's epoch of membership (0: none yet)
        # [ObjectRef] (wrapped so Ray does not resolve it), or a collective-group payload
        self.refs: list[Any] | dict[str, Any] = []
        self.published_at = 0.0
        self._changed = asyncio.Event()
        self._applied_changed = asyncio.Event()
        self.applied: dict[str, tuple[int, float]] = {}
        self.engine_stats: dict[str, dict[str, Any]] = {}
        self.stats_at: dict[str, float] = {}  # when each replica last reported its health
        self.ranks: dict[str, int] = {}
        self._members: dict[str, dict[str, Any]] = {}  # replica -> offset, width, gpu, layout
        self._next_rank = 1
        self.checksums: dict[int, dict[str, dict[str, Any]]] = {}  # version -> replica -> report
        self.details: dict[str, dict[str, Any]] = {}  # replica -> its last packed fetch
        # weight slots (rl360.weights.slots): the slot each replica serves, the slot of
        # the version handed to it and not yet applied, and why slots are off ("" while on)
        self.serving: dict[str, str] = {}
        self.loading: dict[str, tuple[int, str]] = {}
        # the sender's hint handed to each replica: (the version it follows, the slot the
        # version after it goes to); a replica may load from that slot without asking
        self.hinted: dict[str, tuple[int, str]] = {}
        self.no_slots = ""
        self._grace_until = 0.0
        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # outside an actor (tests): never restarted
            import ray

            if ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed:
                self._grace_until = time.monotonic() + SLOT_GRACE_S

    async def publish(self, version: int, wrapped_ref: list[Any] | dict[str, Any]) -> bool:
        if version <= self.version:
            log.warning("not publishing version %d: %d is already out", version, self.version)
            return False
        self.version, self.refs, self.published_at = version, wrapped_ref, time.time()
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def publish_sharded(self, version: int, payload: dict[str, Any]) -> bool:
        """A version sent over a sharded collective's groups of epoch `payload["epoch"]`
        (rl360.weights.shard_transport): newer than the newest, or the newest again in a newer
        epoch (sent again to a re-formed group)."""
        epoch = int(payload["epoch"])
        if version < self.version or (version == self.version and epoch <= self.epoch):
            log.warning("not publishing version %d (epoch %d): %d (epoch %d) is out", version,
                        epoch, self.version, self.epoch)
            return False
        self.epoch = epoch
        self.version, self.refs, self.published_at = version, payload, time.time()
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def forget(self, replica: str) -> None:
        """A replica that is gone (dead, or replaced): out of the membership and every
        record, so waits no longer count it. A replica that is in fact alive registers again
        with its next report."""
        for table in (self.ranks, self._members, self.applied, self.engine_stats, self.stats_at,
                      self.details, self.serving, self.loading, self.hinted):
            table.pop(replica, None)  # type: ignore[attr-defined]
        self._notify()

    async def wait_taken(self, version: int, epoch: int, replicas: list[str],
                         timeout_s: float) -> dict[str, str]:
        """Wait up to `timeout_s` until each of `replicas` answered for `version` in `epoch`
        (took it, or reported why not); returns those that did not take it: the reason each
        reported, "" for one that said nothing."""
        def answer(r: str) -> str | None:
            d = self.details.get(r, {})
            if d.get("epoch") != epoch:
                return ""
            if int(d.get("received", 0)) >= version:
                return None
            return str(d.get("failed", ""))

        await self._wait_for(lambda: all(answer(r) != "" for r in replicas), timeout_s)
        return {r: a for r in replicas if (a := answer(r)) is not None}

    async def publish_packed(self, version: int, meta: dict[str, Any]) -> bool:
        """A packed version (rl360.weights.packing): a full one starts a new chain, a
        delta extends the chain if it applies to the newest version. Replicas get the chain
        {"kind": "packed", "base", "full", "layout", "deltas": [(version, ref)]} and fetch
        what they lack."""
        if version <= self.version:
            log.warning("not publishing version %d: %d is already out", version, self.version)
            return False
        chain = self.refs if isinstance(self.refs, dict) and self.refs.get("kind") == "packed" \
            else None
        if meta["kind"] == "full":
            chain = {"kind": "packed", "base": version, "full": meta["ref"][0],
                     "layout": meta["layout"], "deltas": []}
        elif chain is None or meta["base"] != self.version:
            log.warning("not publishing delta version %d: it applies to %s, %d is out",
                        version, meta.get("base"), self.version)
            return False
        else:
            chain = {**chain, "deltas": [*chain["deltas"], (version, meta["ref"][0])]}
        chain["version"] = version
        return await self.publish(version, chain)

    def _slot_of_newest(self) -> str:
        full = self.refs.get("full") if isinstance(self.refs, dict) else None
        return str(full["slot"]) if isinstance(full, dict) else ""

    def claimed(self, upcoming: bool = False) -> set[str]:
        """Weight slots that must not be rewritten: served by a replica, handed to one that
        has not applied it yet, holding the newest version (about to be handed out), or
        hinted to a replica as where the next version goes. `upcoming`: for the version
        after the newest, which may go where the replicas were told it would."""
        # a replica that slept on the hinted slot may serve the upcoming version before
        # it is announced: its slot is that version's, not a claim against it
        ahead = {r for r, (v, _) in self.applied.items() if upcoming and v > self.version}
        out = {*(s for r, s in self.serving.items() if r not in ahead),
               *(s for _, s in self.loading.values()), self._slot_of_newest()}
        out |= {s for after, s in self.hinted.values()
                if not (upcoming and after == self.version)}
        out.discard("")
        return out

    async def publish_slot(self, version: int, meta: dict[str, Any]) -> dict[str, Any]:
        """A full version the sender wrote into a weight slot (meta["ref"] = [its descriptor]).
        Answers {"ok", "busy": the slots claimed now} ("why" when refused; "stop" when a
        replica cannot map slots: the sender stops using them)."""
        slot = str(meta["ref"][0]["slot"])
        if self.no_slots:
            return {"ok": False, "stop": self.no_slots}
        if time.monotonic() < self._grace_until:
            return {"ok": False, "why": "the publisher restarted and is learning the claims"}
        if slot in self.claimed(upcoming=True):  # the sender's rule keeps this out: a bug
            log.error("weight version %d: slot %s is claimed (%s); refused", version,
                      slot[:8], sorted(self.claimed(upcoming=True)))
            return {"ok": False, "why": f"slot {slot[:8]} is claimed"}
        ok = await self.publish_packed(version, meta)
        return {"ok": ok, "busy": sorted(self.claimed())}

    async def hint_slot(self, after: int, desc: dict[str, Any]) -> bool:
        """The sender's promise: the version after `after` goes to slot `desc`. Handed to the
        replicas with the newest version (waking their polls), so they can sleep on that
        slot and load the next version as soon as it is written."""
        full = self.refs.get("full") if isinstance(self.refs, dict) else None
        if after != self.version or not isinstance(full, dict) or self.no_slots:
            return False
        self.refs = {**self.refs, "next": desc}  # type: ignore[dict-item]
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    async def slot_unusable(self, replica: str, reason: str) -> None:
        """A replica could not map a weight slot: versions go through the object store."""
        if not self.no_slots:
            log.warning("weight slots off: replica %s cannot map them (%s)", replica, reason)
        self.no_slots = f"{replica}: {reason}"

    async def publish_collective(self, version: int, payload: dict[str, Any]) -> bool:
        """Announce a version sent over a collective group (see rl360.weights.transports)."""
        return await self.publish(version, payload)  # type: ignore[arg-type]

    async def register(self, replica: str, info: dict[str, Any] | None = None) -> int:
        """An engine replica's first rank in collective weight groups (the sender is 0). A
        replica takes `info["width"]` consecutive ranks (one per tensor-parallel worker of an
        engine that joins the group itself); `info` also carries its GPU's UUID and the
        broadcast layout it receives (see CollectiveTransport)."""
        if replica not in self.ranks:
            info = dict(info or {})
            width = max(1, int(info.get("width", 1)))
            self.ranks[replica] = self._next_rank
            self._members[replica] = {**info, "offset": self._next_rank, "width": width}
            self._next_rank += width
            self._notify()
        return self.ranks[replica]

    async def members(self) -> dict[str, dict[str, Any]]:
        return {r: dict(m) for r, m in self._members.items()}

    async def report_checksums(self, replica: str, version: int, report: dict[str, Any]) -> None:
        """A replica's {"dtype": ..., "sums": {name: [elements, checksum]}} after `version`."""
        self.checksums.setdefault(version, {})[replica] = report
        for old in [v for v in self.checksums if v < version - 4]:
            del self.checksums[old]
        self._notify()

    async def wait_checksums(self, version: int, replicas: int,
                             timeout_s: float) -> dict[str, dict[str, Any]]:
        if not await self._wait_for(lambda: len(self.checksums.get(version, {})) >= replicas,
                                    timeout_s):
            raise TimeoutError(f"{len(self.checksums.get(version, {}))} of {replicas} "
                               f"replicas reported weight checksums for version {version}")
        return dict(self.checksums[version])

    async def wait_registered(self, replicas: int, timeout_s: float) -> dict[str, int]:
        if not await self._wait_for(lambda: len(self.ranks) >= replicas, timeout_s):
            raise TimeoutError(f"only {len(self.ranks)} of {replicas} engine replicas "
                               f"registered for weight sync within {timeout_s:.0f}s")
        return dict(self.ranks)

    async def wait_newer(self, have: int, timeout_s: float, replica: str = "",
                         epoch: int = -1) -> tuple[int, Any]:
        """The newest version once it is newer than `have`, or announced in an epoch newer
        than `epoch` (a sharded collective's, when >= 0), or after `timeout_s`. A version
        in a weight slot handed to `replica` claims that slot until it applies a newer one;
        so does the sender's hint of the slot after it (answered at once if not yet handed)."""
        if self.version <= have and not self._hint_news(replica) and not \
                (epoch >= 0 and self.epoch > epoch):
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass
        slot = self._slot_of_newest()
        if replica and slot and self.version > have:
            self.loading[replica] = (self.version, slot)
        hint = self._hint_for(replica)
        if hint:
            self.hinted[replica] = (self.version, hint)
        return self.version, self.refs

    def _hint_for(self, replica: str) -> str:
        """The slot the newest version's hint names, for `replica` ("": none, or the replica
        already serves the version the hint is for: it slept on that slot)."""
        hint = self.refs.get("next") if isinstance(self.refs, dict) else None
        if not replica or not isinstance(hint, dict) or \
                self.applied.get(replica, (0, 0.0))[0] > self.version:
            return ""
        return str(hint["slot"])

    def _hint_news(self, replica: str) -> bool:
        """The newest version carries a hint `replica` has not been handed yet."""
        hint = self._hint_for(replica)
        return bool(hint) and self.hinted.get(replica) != (self.version, hint)

    async def report_applied(self, replica: str, version: int,
                             detail: dict[str, Any] | None = None) -> None:
        """`detail`: what the replica fetched for a packed version (full?, deltas, bytes,
        fell_back) and where its time went (fetch_s, update_s, apply_s, apply_cpu_s), kept
        per replica for status() and benches."""
        self.applied[replica] = (version, time.time() - self.published_at)
        if detail is not None:
            self.details[replica] = {"version": version, **detail}
            self.serving[replica] = str(detail.get("slot", ""))
        if self.loading.get(replica, (version + 1, ""))[0] <= version:
            del self.loading[replica]
        if self.hinted.get(replica, (version, ""))[0] < version:  # moved past the hint
            del self.hinted[replica]
        self._notify()

    async def wait_applied(self, version: int, replicas: int, timeout_s: float) -> int:
        """Wait up to `timeout_s` until `replicas` engine replicas serve >= `version`; returns
        the lowest version those replicas serve (0 before any update was applied)."""
        def low() -> int:
            served = sorted((v for v, _ in self.applied.values()), reverse=True)[:replicas]
            return min(served) if len(served) >= replicas else 0

        await self._wait_for(lambda: low() >= version, timeout_s)
        return low()

    def _notify(self) -> None:
        """Wake every waiter on registrations, applied versions and checksums."""
        self._applied_changed.set()
        self._applied_changed = asyncio.Event()

    async def _wait_for(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait up to `timeout_s` for `done()`, re-checked at each notification."""
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._applied_changed.wait(), remaining)
        return True

    async def report_stats(self, replica: str, stats: dict[str, Any], version: int = 0,
                           slot: str | None = None, info: dict[str, Any] | None = None
                           ) -> None:
        """A replica's health every poll, with the version (and weight slot) it serves: a
        restarted publisher learns what every replica serves again within one poll, and
        registers again (`info`, as `register`'s) a replica it does not know."""
        if info is not None and replica not in self.ranks:
            await self.register(replica, info)
        self.engine_stats[replica] = stats
        self.stats_at[replica] = time.monotonic()
        if slot is not None:
            self.serving[replica] = slot
        if version > self.applied.get(replica, (0, 0.0))[0]:
            self.applied[replica] = (version, 0.0)
            self._notify()

    async def channels(self, fresh_s: float = 10.0) -> dict[str, dict[str, str]]:
        """The engine cores session shards may call directly (engine.core_process): per
        replica that reported within `fresh_s`, healthy, with an open channel, its socket
        path and node.
        A replica opens its channel once it serves the published weights."""
        now = time.monotonic()
        return {r: {"path": str(s["channel"]), "node": str(s.get("core_node", ""))}
                for r, s in self.engine_stats.items()
                if s.get("channel") and s.get("ok", True)
                and now - self.stats_at.get(r, 0.0) <= fresh_s}

    async def status(self) -> dict[str, Any]:
        return {"version": self.version, "applied": dict(self.applied),
                "engines": dict(self.engine_stats), "fetched": dict(self.details),
                "slots": {"claimed": sorted(self.claimed()), "off": self.no_slots,
                          "hinted": {r: s for r, (_, s) in self.hinted.items()}}}
