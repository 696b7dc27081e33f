"""The weight sync wing's typed seams without Ray: the update union an engine receives, the
receiver protocol every engine backend declares, and the sender a trainer rank holds."""

from __future__ import annotations

import importlib
import inspect

import msgspec
import pytest
import torch

from rl360.recipe import apply_overrides, decode_recipe
from rl360.serve.engines.base import BACKENDS, CORE_PROCESS, EngineBackend
from rl360.weights.payloads import (
    AdapterUpdate,
    CollectiveUpdate,
    DeltaUpdate,
    FullUpdate,
    IpcUpdate,
    SlotUpdate,
    TensorUpdate,
    WeightUpdate,
    dtype_bytes,
)
from rl360.weights.plan import checksum_state
from rl360.weights.receiver import WeightReceiver
from rl360.weights.sender import WeightSender
from rl360.weights.sender_calls import Checksums, Send, Spec, sender_env
from rl360.weights.slots import writer_env

KINDS = [TensorUpdate, FullUpdate, SlotUpdate, DeltaUpdate, CollectiveUpdate, IpcUpdate,
         AdapterUpdate]


def test_every_torch_dtype_has_the_width_torch_gives_it() -> None:
    dtypes = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert len(dtypes) > 20
    for d in dtypes:
        assert dtype_bytes(str(d)) == torch.empty(0, dtype=d).element_size(), d
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        dtype_bytes("torch.opaque")


def test_the_update_kinds_are_one_tagged_union() -> None:
    assert set(WeightUpdate.__args__) == set(KINDS)  # type: ignore[attr-defined]
    tags = [k.__struct_config__.tag for k in KINDS]
    assert len(set(tags)) == len(tags) and all(tags)
    # the kinds that hold only plain data cross a wire as themselves, told apart by their tag
    for update in (CollectiveUpdate("g", [[("w", [2], "torch.float32")]], ("h", 1, 1, 2, "nccl")),
                   IpcUpdate([b"\x00\x01"])):
        wire = msgspec.msgpack.encode(update)
        assert msgspec.msgpack.decode(wire, type=CollectiveUpdate | IpcUpdate) == update


def _backends() -> dict[str, type]:
    out = {}
    for name, path in {**BACKENDS, "core_process": CORE_PROCESS}.items():
        module, _, cls = path.partition(":")
        out[name] = getattr(importlib.import_module(module), cls)
    return out


@pytest.mark.parametrize("name", [*BACKENDS, "core_process"])
def test_every_engine_backend_declares_the_receiver_protocol(name: str) -> None:
    """The follow loop asks the engine, it never probes it: each backend has the protocol's
    members, with the protocol's parameters."""
    cls = _backends()[name]
    for member in ("weight_intake", "update_weights", "weight_checksums", "health"):
        ours = inspect.signature(getattr(WeightReceiver, member))
        theirs = inspect.signature(getattr(cls, member))
        assert list(theirs.parameters) == list(ours.parameters), (name, member)
    assert WeightReceiver in EngineBackend.__mro__


def test_an_engine_refuses_a_kind_it_does_not_take_by_its_tag() -> None:
    from rl360.serve.engines.core_process import CoreProcessBackend

    backend = CoreProcessBackend.__new__(CoreProcessBackend)  # the check comes first
    with pytest.raises(TypeError, match="'collective'"):
        import asyncio

        asyncio.run(backend.update_weights(1, CollectiveUpdate("g", [])))


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.ones(4, dtype=torch.bfloat16)}


def test_the_sender_answers_the_transports_calls() -> None:
    state = _state()
    views = WeightSender(lambda: state)
    assert views.handle(Spec()) == [("a", [2, 3], "torch.float32"), ("b", [4], "torch.bfloat16")]
    limits: dict[str, int | None] = {"a": None, "b": 2}
    assert views.handle(Checksums(limits, None)) == checksum_state(state, limits)
    with pytest.raises(RuntimeError, match="before open_group"):
        views.handle(Send())
    with pytest.raises(TypeError, match="not a weight sender call"):
        views.handle("spec")  # type: ignore[arg-type]


def test_the_spec_and_checksums_come_from_the_snapshot() -> None:
    """The trainer's views go into copies (object store, slots, gloo); the spec and the
    checksums describe a snapshot that does not move while the trainer steps."""
    snap = {"a": torch.zeros(3)}
    sender = WeightSender(lambda: {"a": torch.zeros(5)}, lambda: snap)
    assert sender.handle(Spec()) == [("a", [3], "torch.float32")]


def test_only_a_sender_writing_weight_slots_gets_the_streaming_environment() -> None:
    def sync(*sets: str):  # type: ignore[no-untyped-def]
        return decode_recipe(apply_overrides({}, list(sets))).train.weight_sync

    assert sender_env(sync(), {}) == writer_env({})
    assert sender_env(sync("train.weight_sync={transport='object_store', slots=0}"), {}) == {}
    assert sender_env(sync("train.weight_sync={transport='object_store', delta=true}"), {}) == {}
    assert sender_env(sync("train.weight_sync={transport='collective'}"), {}) == {}
