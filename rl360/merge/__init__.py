"""Merging RL expert checkpoints of one base model into one model.

Methods (see `rl360.merge.strategies.METHODS`): uniform and greedy soup, task arithmetic,
TIES, DARE (linear / TIES), RAM and RAM+, ULP-gate, Gram-soup, Model Stock, Iso-C and
Iso-CTS. The merge streams tensor by tensor over sharded safetensors checkpoints, serially
or as Ray tasks (one per output shard). Importing this package is cheap: torch and ray are
imported by the modules that compute.
"""

from __future__ import annotations

from rl360.merge.errors import MergeError

__all__ = ["MergeError"]
