"""Merging RL expert checkpoints of one base model into one model.

Methods (see `rl360.merge.strategies.METHODS`): uniform and greedy soup, task arithmetic,
TIES, DARE (linear / TIES), RAM and RAM+, ULP-gate, Gram-soup, Model Stock, Iso-C and
Iso-CTS. The merge streams tensor by tensor over sharded safetensors checkpoints, serially
or as Ray tasks (one per output shard). Importing this package is cheap: torch and ray are
imported by the modules that compute.

Modules: `recipe` (msgspec Structs of `rl360 merge merge.toml`), `methods` / `iso` / `ulp` /
`kth` (pure tensor kernels), `strategies` (the factory `build_method` and the registry
`METHODS`), `io` (streaming safetensors reader and shard writer), `shards` (one output shard:
the unit of a Ray task), `runner` (orchestration), `report`, `greedy`, `evaluators`, `cli`.
"""

from __future__ import annotations

from rl360.merge.errors import MergeError

__all__ = ["MergeError"]
