"""The whole recipe (`Recipe`): its sections and the checks that span several of them.
"""

from __future__ import annotations

import msgspec

from rl360.recipe.base import Section
from rl360.recipe.envs import EnvSection, EvalSection
from rl360.recipe.serving import (
    ClusterSection,
    EngineSection,
    ModelSection,
    RaySection,
    RunSection,
    SearchSection,
    ServeSection,
)
from rl360.recipe.train import CollectiveSync, SftSection, TrainSection
from rl360.recipe.trainer import TrainerSection


class Recipe(Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    ray: RaySection = msgspec.field(default_factory=RaySection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    serve: ServeSection = msgspec.field(default_factory=ServeSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    search: SearchSection = msgspec.field(default_factory=SearchSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)
    sft: SftSection = msgspec.field(default_factory=SftSection)
    train: TrainSection = msgspec.field(default_factory=TrainSection)

    def __post_init__(self) -> None:
        if self.engine.core_process and getattr(self.train.weight_sync, "delta", False):
            raise ValueError("train.weight_sync.delta = true needs engines that load weights in "
                             "place; engine.core_process = true loads whole versions (set one "
                             "of them to false)")
        sync = self.train.weight_sync
        if self.trainer.lora is not None and self.engine.core_process:
            raise ValueError("engine.core_process = true takes whole weight versions; with "
                             "trainer.lora the versions are adapters, which the in-process "
                             "torch engine serves (set engine.core_process = false)")
        if self.trainer.lora is not None and getattr(sync, "delta", False):
            raise ValueError("train.weight_sync.delta = true: with trainer.lora a version is the "
                             "adapter alone, sent whole (set delta = false)")
        if self.trainer.lora is not None and isinstance(sync, CollectiveSync) and (
                sync.backend != "gloo" or sync.layout != "auto"):
            raise ValueError("train.weight_sync: adapter versions (trainer.lora) go through "
                             "transport 'object_store', or 'collective' with backend 'gloo' and "
                             f"layout 'auto' (got backend {sync.backend!r}, layout "
                             f"{sync.layout!r})")
        loss, staleness = self.trainer.loss, self.train.max_staleness
        if staleness > 0 and (loss.name == "reinforce" or loss.tis_cap == 0):
            raise ValueError(
                f"trainer.loss: train.max_staleness = {staleness} trains on tokens sampled by "
                "older policies, which needs a clipped loss with truncated importance weights "
                f"(name 'ppo' or 'gspo' and tis_cap >= 1), got name {loss.name!r}, tis_cap "
                f"{loss.tis_cap:g}; or set train.max_staleness = 0")
