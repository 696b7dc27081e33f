"""The receiver protocol: what weight sync needs of an engine, declared.

Every engine backend implements `WeightReceiver` (rl360.serve.engines.base.EngineBackend extends
it). A replica's follow loop (rl360.weights.follow) asks the engine once how it takes versions
(`weight_intake`), registers that with the publisher so the transport can plan a collective
group, turns each published version into the `WeightUpdate` the engine takes, and, with the
checksum option, asks the engine what it now serves (`weight_checksums`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from rl360.weights.payloads import WeightUpdate


class Intake(msgspec.Struct, frozen=True, kw_only=True):
    """How an engine takes weight versions.

    `packed`: it loads packed versions (FullUpdate, SlotUpdate, DeltaUpdate) into its own
    parameters in place (the in-process torch engine); otherwise object-store versions reach it
    as TensorUpdates and deltas are not sent. `own_group`: it joins collective groups in its own
    workers and takes CollectiveUpdate / IpcUpdate (SGLang); otherwise its replica receives a
    collective version and hands it over as a TensorUpdate. `group_width`: the ranks it takes in
    a collective group (one per tensor-parallel worker of an engine with its own group)."""

    packed: bool = False
    own_group: bool = False
    group_width: int = 1


class WeightChecksums(msgspec.Struct):
    """What an engine serves after a version, for the checksum option: the dtype it holds the
    weights in and, per name, (elements compared or None for all, checksum)."""

    dtype: str | None
    sums: dict[str, tuple[int | None, int]]


@runtime_checkable
class WeightReceiver(Protocol):
    """The engine side of weight sync."""

    @property
    def version(self) -> int: ...

    def weight_intake(self) -> Intake: ...

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        """Apply `update` as `version`, between batches. Returns False (and logs why) when
        `version` is not newer than the current one; a kind of update the engine does not take
        (see `weight_intake`) raises TypeError."""
        ...

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        """Checksums of the named weights the engine serves now that it applied `update`; an
        engine that cannot read its weights back checksums the tensors of `update`
        (rl360.weights.plan.update_checksums)."""
        ...

    def health(self) -> dict[str, Any]: ...
