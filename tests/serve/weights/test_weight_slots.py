"""Weight slots (rl360.serve.weights.slots): shared memory the sender rewrites in place. A
replica serves a version out of a slot, bit-exact and read-only; the sender never rewrites a
slot the publisher says is claimed (served, handed out, or the newest), nor the one it wrote
last; with every slot claimed it makes no more than its limit and the version goes to the
object store."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch

from rl360.serve.weights.packing import PackedUpdate, WeightPacker, fetch_update
from rl360.serve.weights.publisher import WeightPublisher
from rl360.serve.weights.slots import SlotReader, SlotWriter
from tests.serve.weights.test_weight_delta import Net, _step, _trainer_state


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
        assert isinstance(update, PackedUpdate) and update.slot == desc["slot"]
        assert update.full is not None and update.full.mapped == (version == 4)  # v1's slot again
        update.apply_to(model)
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
    # a refused version changes nothing; "stop" turns slots off for good
    assert not writer.published({"ok": False, "why": "restarted"}, c)
    assert writer.last == b and writer.busy == {a, b, c}
    assert not writer.published({"ok": False, "stop": "replica r1: not this node"}, c)
    writer.busy = set()
    assert writer.reserve(arrays) is None and writer.disabled.startswith("replica r1")
    writer.close()


def test_the_publisher_keeps_every_claim_on_a_slot() -> None:
    async def run() -> None:
        pub = WeightPublisher()
        layout = {"entries": [], "buckets": []}

        def meta(version: int, slot: str) -> dict[str, object]:
            return {"kind": "full", "version": version, "nbytes": 0, "layout": layout,
                    "ref": [{"slot": slot}]}

        answer = await pub.publish_slot(1, meta(1, "A"))
        assert answer == {"ok": True, "busy": ["A"]}  # the newest is claimed
        _, chain = await pub.wait_newer(0, 0.0, "r1")  # handed to r1: r1 claims A
        assert chain["full"] == {"slot": "A"}
        assert (await pub.publish_slot(2, meta(2, "B")))["busy"] == ["A", "B"]
        await pub.report_applied("r1", 1, {"slot": "A"})  # r1 serves A
        assert pub.claimed() == {"A", "B"}
        refused = await pub.publish_slot(3, meta(3, "A"))  # a served slot is never taken
        assert not refused["ok"] and "claimed" in refused["why"] and pub.version == 2
        await pub.wait_newer(1, 0.0, "r1")
        await pub.report_applied("r1", 2, {"slot": "B"})  # r1 moved to B: A is free
        assert (await pub.publish_slot(3, meta(3, "A")))["busy"] == ["A", "B"]
        await pub.report_stats("r2", {}, 0, "")  # r2 serves no slot; a copied version frees
        await pub.report_applied("r1", 3, {"slot": ""})
        assert pub.claimed() == {"A"}
        await pub.slot_unusable("r2", "cannot open /proc/1/fd/9")
        stop = await pub.publish_slot(4, meta(4, "B"))
        assert not stop["ok"] and "r2" in stop["stop"]

    asyncio.run(run())
