"""The device-independent half of collective weight sync: bucket planning, trainer -> engine
name mapping, and per-tensor checksums that find a corrupted tensor by name."""

from __future__ import annotations

import pytest
import torch

from rl360.recipe import (
    CollectiveSync,
    ObjectStoreSync,
    RecipeError,
    checked,
    decode_recipe,
)
from rl360.weights.gloo import tensor_spec
from rl360.weights.plan import (
    NameMap,
    bucket_bytes,
    check_names,
    checksum_state,
    compare_checksums,
    plan_buckets,
    tensor_checksum,
)

MB = 1024 * 1024


def _spec(sizes_mb: list[float]) -> list[tuple[str, list[int], str]]:
    return [(f"t{i}", [int(s * MB) // 4], "torch.float32") for i, s in enumerate(sizes_mb)]


def test_buckets_keep_order_and_respect_the_limit() -> None:
    spec = _spec([1, 1, 1, 3, 0.5, 0.5, 2])
    buckets = plan_buckets(spec, bucket_mb=2)
    assert [n for b in buckets for n, _, _ in b] == [n for n, _, _ in spec]  # order, once each
    assert [[n for n, _, _ in b] for b in buckets] == [
        ["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    for b in buckets:  # only a lone oversized tensor may exceed the limit
        assert bucket_bytes(b) <= 2 * MB or len(b) == 1


def test_one_big_bucket_and_mixed_dtypes() -> None:
    state = {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(3, 4),
             "c": torch.zeros(2, dtype=torch.int64)}
    buckets = plan_buckets(tensor_spec(state), bucket_mb=512)
    assert len(buckets) == 1 and bucket_bytes(buckets[0]) == 10 * 2 + 12 * 4 + 2 * 8


def test_bad_plans_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets(_spec([1]), 0)
    with pytest.raises(ValueError, match="twice"):
        plan_buckets(_spec([1]) + _spec([1]), 4)
    with pytest.raises(ValueError, match="unknown dtype"):
        plan_buckets([("x", [2], "torch.complex64")], 4)
    with pytest.raises(ValueError, match="bucket_mb"):
        checked(CollectiveSync, bucket_mb=-1)
    with pytest.raises(ValueError, match="backend"):
        checked(CollectiveSync, backend="mpi")


def test_weight_sync_is_a_tagged_union_in_the_recipe() -> None:
    r = decode_recipe({"train": {"weight_sync": {"transport": "collective", "backend": "nccl",
                                                 "bucket_mb": 64}}})
    assert isinstance(r.train.weight_sync, CollectiveSync)
    assert (r.train.weight_sync.backend, r.train.weight_sync.bucket_mb) == ("nccl", 64)
    assert isinstance(decode_recipe({}).train.weight_sync, ObjectStoreSync)
    with pytest.raises(RecipeError, match="weight_sync"):  # collective keys on the object store
        decode_recipe({"train": {"weight_sync": {"transport": "object_store", "backend": "nccl"}}})


def test_name_map_strips_wrappers_renames_and_drops() -> None:
    nm = NameMap(renames=[(r"^decoder\.", "model.")], drop=[r"^lm_head\.weight$"])
    assert nm.map("module._orig_mod.decoder.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert nm.map("lm_head.weight") is None
    spec = [("module.decoder.norm.weight", [4], "torch.float32"),
            ("lm_head.weight", [8, 4], "torch.float32")]
    assert nm.apply(spec) == [("model.norm.weight", [4], "torch.float32")]
    with pytest.raises(ValueError, match="both"):
        NameMap().apply([("module.x", [1], "torch.float32"), ("x", [1], "torch.float32")])


def test_check_names_lists_both_sides() -> None:
    check = check_names(["a", "b", "extra"], ["a", "b", "c"])
    assert not check.ok and check.missing == ["c"] and check.unexpected == ["extra"]
    assert check_names(["a"], ["a"]).ok


def test_checksum_sees_flips_swaps_and_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 32, generator=g)
    base = tensor_checksum(t)
    assert tensor_checksum(t.clone()) == base
    flipped = t.clone()
    flipped.view(-1).view(torch.int32)[100] ^= 1  # one low mantissa bit
    assert tensor_checksum(flipped) != base
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert tensor_checksum(swapped) != base
    assert tensor_checksum(t.reshape(-1)) == base  # layout-free: the same elements in order
    assert tensor_checksum(t[:, :16].contiguous()) != base
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.float64, torch.bool):
        x = (t > 0).to(dtype) if dtype is torch.bool else t.to(dtype)
        assert tensor_checksum(x) == tensor_checksum(x.clone())
    # a prefix checksum equals the checksum of the prefix
    assert tensor_checksum(t, limit=100) == tensor_checksum(t.reshape(-1)[:100])


def test_compare_names_every_mismatch() -> None:
    state = {"w": torch.randn(8, 8), "b": torch.randn(8), "n": torch.ones(8)}
    sent = checksum_state(state)
    served = dict(state)
    served["b"] = state["b"] + 1e-3
    engine = checksum_state(served)
    del engine["n"]
    engine["ghost"] = 1
    report = compare_checksums(sent, engine, version=3, replica="r1")
    assert not report.ok and report.checked == 3
    assert {(m.name, m.reason) for m in report.mismatches} == {
        ("b", "checksum differs"), ("n", "missing on engine"), ("ghost", "not sent")}
    assert "b (checksum differs)" in report.summary() and "version 3 on r1" in report.summary()
    assert compare_checksums(sent, checksum_state(state), version=3, replica="r1").ok


def test_checksums_in_the_engine_dtype_and_by_prefix() -> None:
    state = {"w": torch.randn(16, 4), "b": torch.randn(4)}
    engine_side = {k: v.to(torch.bfloat16) for k, v in state.items()}
    as_engine = checksum_state(state, dtype="torch.bfloat16")
    assert as_engine == checksum_state(engine_side)
    assert as_engine != checksum_state(state)
    limits = {"w": 10, "b": None}
    sums = checksum_state(state, limits=limits)
    assert sums["w"] == tensor_checksum(state["w"].reshape(-1)[:10])
    assert sums["b"] == tensor_checksum(state["b"])
