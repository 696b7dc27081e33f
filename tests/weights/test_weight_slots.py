"""Weight slots (rl360.weights.slots): shared memory the sender rewrites in place. A
replica serves a version out of a slot, bit-exact and read-only; the sender never rewrites a
slot the publisher says is claimed (served, handed out, hinted, or the newest), nor the one it
wrote last; with every slot claimed it makes no more than its limit and the version goes to
the object store. The slot promised for the next version (a hint) is where that version goes;
a replica asleep on it wakes when it is written."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
import torch

from rl360.weights.packing import WeightPacker, apply_packed, fetch_update
from rl360.weights.payloads import SlotUpdate
from rl360.weights.publisher import WeightPublisher
from rl360.weights.slots import CAN_WAIT, SlotReader, SlotWatch, SlotWriter
from tests.weights.test_weight_delta import Net, _step, _trainer_state


def _chain(version: int, packed: object, desc: dict[str, object]) -> dict[str, object]:
    """What the publisher hands a replica for a version in a slot."""
    layout = packed.layout  # type: ignore[attr-defined]
    return {"kind": "packed", "base": version, "version": version, "full": desc,
            "layout": msgspec.to_builtins(layout), "deltas": []}


def _write(writer: SlotWriter, version: int, state: dict[str, torch.Tensor]
           ) -> tuple[object, dict[str, object]]:
    packed = WeightPacker(dtype="bfloat16").pack(version, state)
    reserved = writer.reserve(packed.data.arrays)  # type: ignore[union-attr]
    assert reserved is not None
    slot, desc = reserved
    writer.fill(slot, packed.data.arrays, version)  # type: ignore[union-attr]
    return packed, desc


def test_a_replica_serves_a_slot_in_place_bit_exact_and_read_only() -> None:
    state, writer, reader = _trainer_state(), SlotWriter(max_slots=3), SlotReader()
    model = Net(torch.bfloat16)
    serving = ""
    for version in (1, 2, 3, 4):
        _step(state, 1e-2, version)
        packed, desc = _write(writer, version, state)
        # claimed at the publish: the slot the replica serves and the new one
        busy = [s for s in (serving, str(desc["slot"])) if s]
        assert writer.published({"ok": True, "busy": busy}, str(desc["slot"]))
        serving = str(desc["slot"])
        update = asyncio.run(fetch_update(_chain(version, packed, desc), version - 1, True,
                                          reader))
        assert isinstance(update, SlotUpdate) and update.slot == desc["slot"]
        assert update.full is not None and update.full.mapped == (version == 4)  # v1's slot again
        apply_packed(update, model)
        assert update.borrowed == 3  # three parameters view the slot; the buffer is copied
        want = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
                for k, v in state.items()}
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
        view = update.full.arrays[0]
        assert not view.flags.writeable  # mapped read-only: nothing can write a slot's bytes
        with pytest.raises(ValueError):
            view[0] = 0
        assert reader.stamp(desc) == version
    assert len(writer.slots) == 3
    writer.close()


def test_the_sender_never_rewrites_a_claimed_slot_and_stops_at_its_limit() -> None:
    writer = SlotWriter(max_slots=3)
    arrays = [np.arange(1000, dtype=np.int32)]

    def write(version: int) -> str:
        reserved = writer.reserve(arrays)
        assert reserved is not None
        slot, desc = reserved
        writer.fill(slot, arrays, version)
        return str(desc["slot"])

    a = write(1)
    assert writer.published({"ok": True, "busy": [a]}, a)
    b = write(2)  # a is the newest and claimed: a new slot
    assert b != a
    assert writer.published({"ok": True, "busy": [a, b]}, b)  # a replica still serves a
    c = write(3)
    assert c not in (a, b)
    assert writer.published({"ok": True, "busy": [a, c]}, c)  # b was let go: reused
    assert write(4) == b
    assert writer.published({"ok": True, "busy": [a, b, c]}, b)  # every slot claimed
    assert writer.reserve(arrays) is None and len(writer.slots) == 3  # the object store
    # a refused version keeps its slot out of use (a replica asleep on it may have loaded
    # it); "stop" turns slots off for good
    assert not writer.published({"ok": False, "why": "restarted"}, c)
    assert writer.last == b and writer.busy == {a, b, c}
    assert not writer.published({"ok": False, "stop": "replica r1: not this node"}, c)
    writer.busy = set()
    assert writer.reserve(arrays) is None and writer.disabled.startswith("replica r1")
    writer.close()


def _meta(version: int, slot: str) -> dict[str, object]:
    """What a sender publishes for a version written into `slot` (no tensors)."""
    return {"kind": "full", "version": version, "nbytes": 0,
            "layout": {"entries": [], "buckets": []}, "ref": [{"slot": slot}]}


def test_the_publisher_keeps_every_claim_on_a_slot() -> None:
    async def run() -> None:
        pub = WeightPublisher()
        answer = await pub.publish_slot(1, _meta(1, "A"))
        assert answer == {"ok": True, "busy": ["A"]}  # the newest is claimed
        _, chain = await pub.wait_newer(0, 0.0, "r1")  # handed to r1: r1 claims A
        assert chain["full"] == {"slot": "A"}
        assert (await pub.publish_slot(2, _meta(2, "B")))["busy"] == ["A", "B"]
        await pub.report_applied("r1", 1, {"slot": "A"})  # r1 serves A
        assert pub.claimed() == {"A", "B"}
        refused = await pub.publish_slot(3, _meta(3, "A"))  # a served slot is never taken
        assert not refused["ok"] and "claimed" in refused["why"] and pub.version == 2
        await pub.wait_newer(1, 0.0, "r1")
        await pub.report_applied("r1", 2, {"slot": "B"})  # r1 moved to B: A is free
        assert (await pub.publish_slot(3, _meta(3, "A")))["busy"] == ["A", "B"]
        await pub.report_stats("r2", {}, 0, "")  # r2 serves no slot; a copied version frees
        await pub.report_applied("r1", 3, {"slot": ""})
        assert pub.claimed() == {"A"}
        await pub.slot_unusable("r2", "cannot open /proc/1/fd/9")
        stop = await pub.publish_slot(4, _meta(4, "B"))
        assert not stop["ok"] and "r2" in stop["stop"]

    asyncio.run(run())


def _publish(writer: SlotWriter, arrays: list[np.ndarray], version: int, busy: list[str],
             layout: str = "L") -> str:
    reserved = writer.reserve(arrays, layout)
    assert reserved is not None
    slot, desc = reserved
    writer.fill(slot, arrays, version)
    assert writer.published({"ok": True, "busy": [*busy, str(desc["slot"])]}, str(desc["slot"]))
    return str(desc["slot"])


@pytest.mark.skipif(not CAN_WAIT, reason="no futex(2) on this platform: no hints")
def test_a_replica_asleep_on_the_promised_slot_wakes_when_the_next_version_is_written() -> None:
    writer, reader = SlotWriter(max_slots=3), SlotReader()
    arrays = [np.arange(4096, dtype=np.int32)]
    first = _publish(writer, arrays, 1, [])
    promised = writer.promise("L")
    assert promised is not None and promised["slot"] != first
    reader.map(promised)
    stop = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        asleep = pool.submit(reader.wait_newer, promised, 1, stop)
        time.sleep(0.3)
        assert not asleep.done()  # nothing newer than version 1 there yet
        newer = [arrays[0] + 7]
        assert _publish(writer, newer, 2, []) == promised["slot"]  # the promise is kept
        assert asleep.result(timeout=10) == 2
        view = reader.arrays(promised, [np.dtype(np.int32)], [4096])[0][0]
        assert np.array_equal(view, newer[0])  # written before the stamp woke it
        # a stopped sleeper returns 0 (it re-checks every slice)
        again = pool.submit(reader.wait_newer, promised, 2, stop, 0.05)
        stop.set()
        assert again.result(timeout=10) == 0
    writer.close()


@pytest.mark.skipif(not CAN_WAIT, reason="no futex(2) on this platform: no hints")
def test_a_watch_hands_out_the_version_as_the_publisher_would_and_stops_on_demand() -> None:
    async def run() -> None:
        writer, reader = SlotWriter(max_slots=3), SlotReader()
        arrays = [np.arange(4096, dtype=np.int32)]
        _publish(writer, arrays, 1, [])
        promised = writer.promise("L")
        assert promised is not None
        watch = SlotWatch.start(reader, 1, promised, "L", name="test-watch")
        assert watch is not None
        await asyncio.sleep(0.1)
        assert not watch.task.done()
        await asyncio.to_thread(_publish, writer, [arrays[0] + 1], 2, [])
        await asyncio.wait_for(watch.task, 10)
        version, payload = watch.payload()
        assert version == 2 and payload is not None
        assert payload["full"] == promised and payload["base"] == payload["version"] == 2
        watch.stop()
        # asleep on a slot nobody writes: stop wakes it at once (a kernel wake, no slice)
        idle = SlotWatch.start(reader, 2, promised, "L", name="test-watch-2")
        assert idle is not None
        await asyncio.sleep(0.1)
        idle.stop()
        await asyncio.wait_for(idle.task, 1.0)
        assert idle.payload() == (0, None)
        writer.close()

    asyncio.run(run())


def test_a_promise_is_kept_only_for_the_layout_it_was_made_for() -> None:
    writer = SlotWriter(max_slots=3)
    arrays = [np.arange(1000, dtype=np.int32)]
    _publish(writer, arrays, 1, [])
    promised = writer.promise("L") if CAN_WAIT else None
    if promised is None:
        pytest.skip("no futex(2) on this platform: no hints")
    # another layout: not into the promised slot, which stays out of use (replicas may be
    # asleep on it, expecting the promised layout)
    reserved = writer.reserve(arrays, "other")
    assert reserved is not None and reserved[1]["slot"] != promised["slot"]
    assert promised["slot"] in writer.busy  # until the publisher's answer (its hint claim)
    # a version outside the slots breaks the promise the same way
    writer.busy = set()
    p2 = writer.promise("other")
    assert p2 is not None
    writer.broken_promise()
    assert writer.promised is None and p2["slot"] in writer.busy
    writer.close()


def test_the_publisher_hands_out_hints_and_keeps_their_claims() -> None:
    async def run() -> None:
        pub = WeightPublisher()
        assert (await pub.publish_slot(1, _meta(1, "A")))["ok"]
        await pub.wait_newer(0, 0.0, "r1")
        await pub.report_applied("r1", 1, {"slot": "A"})
        assert not await pub.hint_slot(0, {"slot": "B"})  # only for the newest version
        waiting = asyncio.create_task(pub.wait_newer(1, 30.0, "r1"))
        await asyncio.sleep(0.05)
        assert await pub.hint_slot(1, {"slot": "B"})
        version, chain = await asyncio.wait_for(waiting, 5)  # the hint wakes the poll
        assert version == 1 and chain["next"] == {"slot": "B"}
        # a poll that has not seen the hint is answered at once; one that has, waits
        assert (await asyncio.wait_for(pub.wait_newer(1, 30.0, "r2"), 5))[1]["next"]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pub.wait_newer(1, 30.0, "r2"), 0.2)
        assert pub.claimed() == {"A", "B"}  # B is claimed against later versions...
        assert pub.claimed(upcoming=True) == {"A"}  # ...not against the one it was hinted for
        # r1 slept on B and serves version 2 before the publisher hears of it
        await pub.report_applied("r1", 2, {"slot": "B", "watched": True})
        assert "r1" not in pub.hinted  # moved past its hint: its serving slot claims B
        answer = await pub.publish_slot(2, _meta(2, "B"))
        assert answer["ok"] and answer["busy"] == ["B"]  # r2's hint was for B: claimed anyway
        # r2 never moved on: its hint still claims B against version 3 and later
        await pub.report_applied("r1", 2, {"slot": "B"})
        assert "B" in pub.claimed(upcoming=True)
        status = await pub.status()
        assert status["slots"]["hinted"] == {"r2": "B"}

    asyncio.run(run())
