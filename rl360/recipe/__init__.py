"""Recipes: one TOML file decoded by msgspec into typed Structs with defaults and bounds.

Unknown keys and out-of-range values fail with the key's dotted path; `--set a.b=c`
overrides any field before decoding; a key that moved is refused with the key it moved
to. Imports nothing heavy, so `rl360 --help` and checks stay fast.

The sections live by topic: `serving` ([run], [ray], [model], [engine], [serve],
[search], [cluster]), `envs` ([env], [eval]), `trainer` ([trainer]), `train` ([train],
[sft]), `schema` (the whole `Recipe`), `loading` (TOML, overrides, errors).
"""

from rl360.recipe.base import (
    Niceness,
    NonNegFloat,
    NonNegInt,
    Port,
    PosInt,
    Prob,
    Section,
    T,
)
from rl360.recipe.envs import (
    EnvSection,
    EvalSection,
    SandboxLimits,
)
from rl360.recipe.loading import (
    MOVED,
    RecipeError,
    apply_overrides,
    checked,
    decode,
    decode_recipe,
    explain,
    load,
    load_recipe,
    moved_key,
    parse_value,
    read_toml,
)
from rl360.recipe.schema import (
    Recipe,
)
from rl360.recipe.serving import (
    ClusterRole,
    ClusterSection,
    EngineSection,
    ModelSection,
    RaySection,
    RunSection,
    SamplingSection,
    SearchSection,
    ServeSection,
)
from rl360.recipe.train import (
    BreakerSection,
    CheckpointsSection,
    CollectiveSync,
    CurriculumSection,
    ObjectStoreSync,
    ParkingSection,
    RollingStartSection,
    SftSection,
    TailSection,
    TrainSection,
    WeightSync,
)
from rl360.recipe.trainer import (
    LORA_TARGETS,
    LoraSection,
    LossSection,
    MegatronSection,
    TrainerSection,
)

__all__ = [
    "LORA_TARGETS",
    "MOVED",
    "BreakerSection",
    "CheckpointsSection",
    "ClusterRole",
    "ClusterSection",
    "CollectiveSync",
    "CurriculumSection",
    "EngineSection",
    "EnvSection",
    "EvalSection",
    "LoraSection",
    "LossSection",
    "MegatronSection",
    "ModelSection",
    "Niceness",
    "NonNegFloat",
    "NonNegInt",
    "ObjectStoreSync",
    "ParkingSection",
    "Port",
    "PosInt",
    "Prob",
    "RaySection",
    "Recipe",
    "RecipeError",
    "RollingStartSection",
    "RunSection",
    "SamplingSection",
    "SandboxLimits",
    "SearchSection",
    "Section",
    "ServeSection",
    "SftSection",
    "T",
    "TailSection",
    "TrainSection",
    "TrainerSection",
    "WeightSync",
    "apply_overrides",
    "checked",
    "decode",
    "decode_recipe",
    "explain",
    "load",
    "load_recipe",
    "moved_key",
    "parse_value",
    "read_toml",
]
