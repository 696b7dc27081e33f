"""Packed weight versions (rl360.weights.packing) without Ray: a replica that follows
full and delta versions ends bit-identical to one that loads every version in full; missed
versions, a drifted replica and oversized deltas take the documented fallbacks."""

from __future__ import annotations

import pytest
import torch

from rl360.weights.packing import (
    ChecksumMismatch,
    Packet,
    WeightPacker,
    apply_packed,
    own_weights,
    packed_tensors,
    plan_fetch,
)
from rl360.weights.payloads import DeltaPacket, DeltaUpdate, FullPacket, FullUpdate, PackedUpdate


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 48).to(dtype)
        self.b = torch.nn.Linear(48, 64, bias=False).to(dtype)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


def _trainer_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(48, 64, generator=g) * 0.02,
            "a.bias": torch.randn(48, generator=g) * 0.02,
            "b.weight": torch.randn(64, 48, generator=g) * 0.02,
            "steps": torch.zeros(3, dtype=torch.int64)}


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """An Adam-like step on fp32 master weights: every element moves by ~lr."""
    g = torch.Generator().manual_seed(seed)
    for v in state.values():
        if v.is_floating_point():
            v.add_(torch.randn(v.shape, generator=g).sign() * lr)
        else:
            v.add_(1)


def _bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for k, v in model.state_dict().items()}


def _update(p: Packet, chain: list[Packet]) -> PackedUpdate:
    """What a replica that already holds the previous version gets for packet `p`."""
    def fetch_full() -> tuple[FullPacket, list[DeltaPacket]]:
        base = max(i for i, q in enumerate(chain) if q.kind == "full")
        return chain[base].data, [q.data for q in chain[base + 1:]]

    if p.kind == "full":
        return FullUpdate(version=p.data.version, layout=p.layout, full=p.data,
                          fetch_full=fetch_full)
    return DeltaUpdate(version=p.data.version, layout=p.layout, deltas=[p.data],
                       fetch_full=fetch_full)


def test_delta_chain_is_bit_exact_with_full_syncs() -> None:
    torch.manual_seed(0)
    state = _trainer_state()
    delta_packer = WeightPacker(delta=True, max_delta_fraction=0.5, bucket_mb=0.004,
                                dtype="bfloat16")
    full_packer = WeightPacker(delta=False, bucket_mb=0.004, dtype="bfloat16")
    by_delta, by_full = Net(torch.bfloat16), Net(torch.bfloat16)
    chain: list[Packet] = []
    kinds = []
    for version in range(1, 7):
        _step(state, 1e-6, version)  # bf16 rounds ~99% of these steps away
        p = delta_packer.pack(version, state)
        chain.append(p)
        kinds.append(p.kind)
        update = _update(p, chain)
        apply_packed(update, by_delta)
        assert not update.fell_back  # the deltas alone got there
        f = full_packer.pack(version, state)
        apply_packed(_update(f, [f]), by_full)
        assert _bits(by_delta) == _bits(by_full), f"version {version}"
        if p.kind == "delta":
            assert p.nbytes < 0.5 * f.nbytes
    assert kinds[0] == "full" and "delta" in kinds
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    assert all(torch.equal(by_delta.state_dict()[k], v) for k, v in want.items())


def test_drifted_replica_falls_back_to_the_full_version() -> None:
    state = _trainer_state()
    packer = WeightPacker(delta=True, max_delta_fraction=0.9, dtype="bfloat16")
    model = Net(torch.bfloat16)
    chain = [packer.pack(1, state)]
    apply_packed(_update(chain[0], chain), model)
    with torch.no_grad():
        model.a.weight[0, 0] += 1.0  # the replica's weights are not what the sender diffed
    _step(state, 1e-6, 2)
    chain.append(packer.pack(2, state))
    assert chain[-1].kind == "delta"
    update = _update(chain[-1], chain)
    apply_packed(update, model)
    assert update.fell_back
    assert torch.equal(model.a.weight, state["a.weight"].to(torch.bfloat16))


def test_mismatch_that_the_full_version_does_not_fix_raises() -> None:
    state = _trainer_state()
    packer = WeightPacker(delta=True, dtype="bfloat16")
    model = Net(torch.bfloat16)
    full = packer.pack(1, state)
    apply_packed(FullUpdate(version=1, layout=full.layout, full=full.data), model)
    with torch.no_grad():
        state["a.bias"][:3] += 1.0
    delta = packer.pack(2, state)
    assert delta.kind == "delta"
    delta.data.checksums[0] ^= 1  # corrupt in transit
    with pytest.raises(ChecksumMismatch, match="version 2"):
        apply_packed(DeltaUpdate(version=2, layout=delta.layout, deltas=[delta.data]), model)
    again = DeltaUpdate(version=2, layout=delta.layout, deltas=[delta.data],
                        fetch_full=lambda: (full.data, [delta.data]))
    with pytest.raises(ChecksumMismatch, match="version 2"):
        apply_packed(again, model)
    assert again.fell_back


def test_large_or_accumulated_deltas_become_full_versions() -> None:
    state = _trainer_state()
    packer = WeightPacker(delta=True, max_delta_fraction=0.25)  # fp32: a step changes all
    assert packer.pack(1, state).kind == "full"
    _step(state, 1e-3, 2)
    assert packer.pack(2, state).kind == "full"
    with torch.no_grad():  # ~10% of one tensor: a small delta, then the chain budget runs out
        state["a.weight"][:5] += 1.0
    kinds = []
    for v in range(3, 8):
        with torch.no_grad():
            state["a.weight"][v % 40: v % 40 + 4] += 1.0
        kinds.append(packer.pack(v, state).kind)
    assert kinds[0] == "delta" and "full" in kinds


def test_versions_only_move_forward() -> None:
    packer = WeightPacker()
    packer.pack(2, _trainer_state())
    with pytest.raises(ValueError, match="not after"):
        packer.pack(2, _trainer_state())


def _as_object_store(p: Packet) -> Packet:
    """The arrays as a replica gets them out of the object store: a copy (the put), in
    read-only memory."""
    p.data.arrays = [a.copy() for a in p.data.arrays]  # type: ignore[union-attr]
    for a in p.data.arrays:  # type: ignore[union-attr]
        a.flags.writeable = False
    return p


def test_full_versions_are_served_in_place_and_never_written() -> None:
    """zero_copy (the default, no deltas): the replica's parameters become views of the
    version's arrays (a pointer swap); a later load that writes gives them private memory
    first, so the version's bytes (shared by every replica of a node) never change."""
    state = _trainer_state()
    v1 = _as_object_store(WeightPacker(dtype="float32").pack(1, state))
    assert v1.data.shareable  # type: ignore[union-attr]
    kept = [a.copy() for a in v1.data.arrays]  # type: ignore[union-attr]
    model = Net(torch.float32)
    up = FullUpdate(version=1, layout=v1.layout, full=v1.data)
    apply_packed(up, model)
    assert up.borrowed == 3 and up.detail()["borrowed"] == 3  # the buffer "steps" was copied
    arrays = dict(zip((e.name for e in v1.layout.entries), v1.data.arrays, strict=True))  # type: ignore[union-attr]
    assert model.a.weight.data_ptr() == arrays["a.weight"].ctypes.data
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    ref, x = Net(torch.float32), torch.randn(2, 64)
    ref.load_state_dict(state)
    assert torch.equal(model.b(model.a(x)), ref.b(ref.a(x)))  # it serves from the views

    _step(state, 1e-3, 2)  # a copied version (zero_copy off) writes: into private memory
    v2 = WeightPacker(dtype="float32", zero_copy=False).pack(2, state)
    assert not v2.data.shareable  # type: ignore[union-attr]
    apply_packed(FullUpdate(version=2, layout=v2.layout, full=v2.data), model)
    assert model.a.weight.data_ptr() != arrays["a.weight"].ctypes.data
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert all((a == k).all() for a, k in zip(v1.data.arrays, kept, strict=True))  # type: ignore[union-attr]
    assert own_weights(model) == 0  # nothing borrowed any more


def test_a_version_in_another_dtype_is_copied_into_private_memory() -> None:
    """Entries the replica holds in another dtype than sent cannot be views: they are cast
    into the parameters, and a parameter that viewed the version before gets its own memory
    first, so the older version's bytes stay as they were."""
    state = _trainer_state()
    v1 = _as_object_store(WeightPacker(dtype="float32").pack(1, state))
    kept = [a.copy() for a in v1.data.arrays]  # type: ignore[union-attr]
    model = Net(torch.float32)
    apply_packed(FullUpdate(version=1, layout=v1.layout, full=v1.data), model)
    _step(state, 1e-2, 2)
    v2 = _as_object_store(WeightPacker(dtype="bfloat16").pack(2, state))
    up = FullUpdate(version=2, layout=v2.layout, full=v2.data)
    apply_packed(up, model)
    assert up.borrowed == 0 and own_weights(model) == 0
    assert torch.equal(model.a.weight, state["a.weight"].to(torch.bfloat16).float())
    assert all((a == k).all() for a, k in zip(v1.data.arrays, kept, strict=True))  # type: ignore[union-attr]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_stay_tied_when_borrowed_and_owned() -> None:
    model = Tied()
    state = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}
    p = _as_object_store(WeightPacker().pack(1, state))
    apply_packed(FullUpdate(version=1, layout=p.layout, full=p.data), model)
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.emb.weight, state["emb.weight"])
    ptr = model.emb.weight.data_ptr()
    assert own_weights(model) >= 1
    assert model.head.weight is model.emb.weight and model.emb.weight.data_ptr() != ptr
    assert torch.equal(model.head.weight, state["emb.weight"])
    with torch.no_grad():
        model.emb.weight.add_(1.0)  # private now: the version's bytes stay
    assert all(torch.equal(torch.from_numpy(a.copy()).view(torch.float32).view(10, 8),
                           state["emb.weight"])
               for a in p.data.arrays)  # type: ignore[union-attr]


def test_plan_fetch() -> None:
    chain = {"base": 4, "full": "F", "deltas": [(5, "d5"), (6, "d6")], "version": 6}
    assert plan_fetch(chain, 4, True) == (False, ["d5", "d6"])
    assert plan_fetch(chain, 5, True) == (False, ["d6"])  # missed none: just the newest
    assert plan_fetch(chain, 3, True) == (True, ["d5", "d6"])  # older than the base
    assert plan_fetch(chain, 5, False) == (True, ["d5", "d6"])  # cannot apply deltas itself


def test_full_versions_load_into_other_backends_as_state_dicts() -> None:
    state = _trainer_state()
    p = WeightPacker(dtype="float32").pack(1, state)
    views = packed_tensors(FullUpdate(version=1, layout=p.layout, full=p.data))
    assert all(torch.equal(views[k], v) for k, v in state.items())
    d = WeightPacker(delta=True)
    d.pack(1, state)
    with torch.no_grad():
        state["a.bias"][0] += 1
    q = d.pack(2, state)
    assert q.kind == "delta"
    with pytest.raises(ValueError, match="torch backend"):
        packed_tensors(DeltaUpdate(version=2, layout=q.layout, deltas=[q.data]))


def test_delta_is_an_object_store_key_in_the_recipe() -> None:
    from rl360.recipe import ObjectStoreSync, RecipeError, decode_recipe

    sync = {"transport": "object_store", "delta": True, "delta_max_fraction": 0.1}
    got = decode_recipe({"train": {"weight_sync": sync}}).train.weight_sync
    assert isinstance(got, ObjectStoreSync) and got.delta and got.delta_max_fraction == 0.1
    with pytest.raises(RecipeError, match="delta_max_fraction"):
        decode_recipe({"train": {"weight_sync": {**sync, "delta_max_fraction": 1.5}}})
    with pytest.raises(RecipeError, match=r"weight_sync\.delta: unknown key"):
        decode_recipe({"train": {"weight_sync": {"transport": "collective", "delta": True}}})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("n", [1, 7, 64, 1001])
def test_changed_positions_match_an_element_compare(dtype: torch.dtype, n: int) -> None:
    from rl360.weights.packing import changed_positions, raw

    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * 100).to(dtype)
    b = a.clone()
    hit = torch.randperm(n, generator=g)[: max(1, n // 10)]
    b[hit] += 1
    b[-1] += 1  # the tail beyond whole 8-byte words
    old, new = raw(a), raw(b)
    want = (new != old).nonzero()[0]
    assert changed_positions(new, old).tolist() == want.tolist()
