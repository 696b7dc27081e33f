"""The device-independent half of collective weight sync: what goes in which bucket, which
trainer name lands on which engine name, and per-tensor checksums to prove a sync arrived
intact. Pure functions of tensor metadata (and of tensors for checksums); the NCCL half lives in
rl360.weights.nccl.

A *spec* is the trainer's `[(name, shape, dtype_str), ...]` in send order
(rl360.weights.gloo.tensor_spec). Buckets keep that order, so sender and receivers agree on
the byte stream without any extra handshake.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import msgspec

from rl360.weights.payloads import AdapterUpdate, TensorUpdate, WeightUpdate
from rl360.weights.receiver import WeightChecksums

if TYPE_CHECKING:
    import torch

Spec = list[tuple[str, list[int], str]]

DTYPE_BYTES: dict[str, int] = {
    "torch.float64": 8, "torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2,
    "torch.int64": 8, "torch.int32": 4, "torch.int16": 2, "torch.int8": 1, "torch.uint8": 1,
    "torch.bool": 1, "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1,
}


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def nbytes(shape: Iterable[int], dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} in weight spec; known: {sorted(DTYPE_BYTES)}")
    return numel(shape) * DTYPE_BYTES[dtype]


def plan_buckets(spec: Spec, bucket_mb: float) -> list[Spec]:
    """Cut `spec` (in order) into consecutive buckets of at most `bucket_mb` MB each; a tensor
    larger than the limit gets a bucket of its own. Every tensor appears exactly once."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    limit = int(bucket_mb * 1024 * 1024)
    buckets: list[Spec] = []
    current: Spec = []
    size = 0
    seen: set[str] = set()
    for name, shape, dtype in spec:
        if name in seen:
            raise ValueError(f"weight spec names {name!r} twice")
        seen.add(name)
        b = nbytes(shape, dtype)
        if current and size + b > limit:
            buckets.append(current)
            current, size = [], 0
        current.append((name, list(shape), dtype))
        size += b
    if current:
        buckets.append(current)
    return buckets


def bucket_bytes(bucket: Spec) -> int:
    return sum(nbytes(s, d) for _, s, d in bucket)


# ----------------------------------------------------------------------------- names


class NameMap(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Trainer parameter names -> the names an engine loads.

    Applied in order: strip the first matching prefix (DDP's "module.", torch.compile's
    "_orig_mod.", ...), then each (regex, replacement) rename, then drop names matching any
    `drop` regex (e.g. "lm_head.weight" of a tied-embedding model when the engine ties itself).
    """

    strip_prefixes: list[str] = msgspec.field(
        default_factory=lambda: ["module.", "_orig_mod.", "_fsdp_wrapped_module."])
    renames: list[tuple[str, str]] = msgspec.field(default_factory=list)
    drop: list[str] = msgspec.field(default_factory=list)

    def map(self, name: str) -> str | None:
        changed = True
        while changed:  # wrappers nest: module._orig_mod.x
            changed = False
            for p in self.strip_prefixes:
                if p and name.startswith(p):
                    name, changed = name[len(p):], True
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        if any(re.search(d, name) for d in self.drop):
            return None
        return name

    def apply(self, spec: Spec) -> Spec:
        out: Spec = []
        origin: dict[str, str] = {}
        for name, shape, dtype in spec:
            mapped = self.map(name)
            if mapped is None:
                continue
            if mapped in origin:
                raise ValueError(f"name map sends both {origin[mapped]!r} and {name!r} to "
                                 f"{mapped!r}")
            origin[mapped] = name
            out.append((mapped, shape, dtype))
        return out


class NameCheck(msgspec.Struct):
    missing: list[str]  # the engine has it, the trainer does not send it
    unexpected: list[str]  # the trainer sends it, the engine has no such tensor

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unexpected


def check_names(sent: Iterable[str], engine: Iterable[str]) -> NameCheck:
    s, e = set(sent), set(engine)
    return NameCheck(missing=sorted(e - s), unexpected=sorted(s - e))


# ----------------------------------------------------------------------------- checksums

_INT_VIEW = {1: "uint8", 2: "int16", 4: "int32"}
_MOD = 2**61 - 1  # a Mersenne prime; the running total is reduced modulo it
_CHUNK = 1 << 22  # elements per step: (2**32 - 1) * 251 * 2**22 < 2**63, so sums are exact


def tensor_checksum(t: torch.Tensor, limit: int | None = None) -> int:
    """A position-weighted sum of the tensor's raw bits in exact integer arithmetic, so CPU and
    GPU, in any summation order, give the same value; catches flipped, shifted and swapped
    elements. 8-byte elements are read as two 32-bit words. `limit` checksums only the first
    `limit` elements (for engines that expose just a prefix of a weight, like SGLang's
    get_weights_by_name)."""
    flat = t.detach().contiguous().reshape(-1)
    if limit is not None:
        flat = flat[:limit]
    total, n, width = partial_checksum(flat, 0)
    return finish_checksum(total, n, width)


def partial_checksum(flat: torch.Tensor, start: int) -> tuple[int, int, int]:
    """The position-weighted part of `tensor_checksum` for the elements of a flat tensor that
    sit at [start, start + numel) of the whole one: (sum mod 2**61 - 1, elements, word
    width). Parts of disjoint ranges add up (mod 2**61 - 1) to the whole tensor's: ranks that
    each hold a shard checksum the full tensor without gathering it (finish_checksum)."""
    import torch

    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.element_size() == 8:  # two 32-bit words per element, at twice the position
        flat, start = flat.view(torch.int32), 2 * start
    width = flat.element_size()
    bits = flat.view(getattr(torch, _INT_VIEW[width]))
    mask = (1 << (8 * width)) - 1
    total = 0
    for at in range(0, bits.numel(), _CHUNK):
        chunk = bits[at:at + _CHUNK].to(torch.int64) & mask  # unsigned raw bits
        pos = (torch.arange(start + at, start + at + chunk.numel(), device=chunk.device)
               % 251 + 1)
        total = (total + int((chunk * pos).sum())) % _MOD
    return total, flat.numel(), width


def finish_checksum(total: int, words: int, width: int) -> int:
    """`tensor_checksum` from the sum of its parts (`words`: 32-bit words for 8-byte
    elements, else elements)."""
    return (total + words * 1_000_003 + width) % _MOD


def checksum_state(state: Mapping[str, torch.Tensor],
                   limits: Mapping[str, int | None] | None = None,
                   dtype: str | None = None) -> dict[str, int]:
    """Checksums of `state`, or of the names in `limits` only (each up to its element limit),
    after casting to `dtype` (e.g. "torch.bfloat16": the engine's dtype, so a trainer in fp32
    and an engine in bf16 compare what the engine should hold)."""
    import torch

    cast = getattr(torch, dtype.removeprefix("torch.")) if dtype else None
    names = list(limits) if limits is not None else list(state)
    out: dict[str, int] = {}
    for k in names:
        if k not in state:
            continue
        v = state[k]
        lim = limits.get(k) if limits is not None else None
        if lim is not None:
            v = v.detach().reshape(-1)[:lim]
        out[k] = tensor_checksum(v.to(cast) if cast is not None else v)
    return out


def held_checksums(held: Mapping[str, torch.Tensor], names: Iterable[str]) -> WeightChecksums:
    """What an engine holding `held` serves of `names` (every element, in the dtype held)."""
    tensors = {n: held[n] for n in names if n in held}
    dtype = str(next(iter(tensors.values())).dtype) if tensors else None
    return WeightChecksums(dtype, {n: (None, v) for n, v in checksum_state(tensors).items()})


def update_checksums(names: Iterable[str], update: WeightUpdate) -> WeightChecksums:
    """The checksums of an engine that cannot read its weights back: those of the tensors it
    was handed (a TensorUpdate or an AdapterUpdate; nothing for other kinds)."""
    held = update.tensors if isinstance(update, TensorUpdate | AdapterUpdate) else {}
    return held_checksums(held, names)


class Mismatch(msgspec.Struct):
    name: str
    reason: str  # "missing on engine" | "not sent" | "checksum differs"


class SyncReport(msgspec.Struct):
    version: int
    replica: str
    checked: int
    mismatches: list[Mismatch]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        if self.ok:
            return f"version {self.version} on {self.replica}: {self.checked} tensors match"
        names = ", ".join(f"{m.name} ({m.reason})" for m in self.mismatches[:10])
        more = f" and {len(self.mismatches) - 10} more" if len(self.mismatches) > 10 else ""
        return (f"version {self.version} on {self.replica}: {len(self.mismatches)} of "
                f"{self.checked} tensors differ: {names}{more}")


def compare_checksums(trainer: Mapping[str, int], engine: Mapping[str, int], *, version: int,
                      replica: str) -> SyncReport:
    """Every tensor the trainer sent must be on the engine with the same checksum."""
    mismatches = [Mismatch(n, "missing on engine") for n in sorted(trainer) if n not in engine]
    mismatches += [Mismatch(n, "not sent") for n in sorted(engine) if n not in trainer]
    mismatches += [Mismatch(n, "checksum differs") for n in sorted(trainer)
                   if n in engine and int(trainer[n]) != int(engine[n])]
    return SyncReport(version=version, replica=replica, checked=len(trainer),
                      mismatches=mismatches)
