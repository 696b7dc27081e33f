"""What a weight version costs on paper: its bytes, its time on the wire and a sending rank's
extra memory, for the full-gather path (every rank gathers, rank 0 keeps the full weights and
sends them) and the sharded one (every rank sends its own shard in buckets,
rl360.weights.shards). `rl360 plan --estimate` prints these for a recipe
(rl360.launch.estimate); bench/weight_sync_sharded.py measures the same quantities on CPU and
checks each rank's peak against `rank_peak`.

Model (per version, `params` parameters, W trainer ranks, link = one GPU's network bandwidth):
  version bytes   params x the engines' bytes per parameter
  sharded         each rank sends version / W; every replica takes the whole version over its
                  link from the W ranks at once: version / link
                  a rank's extra memory: its shard (version / W) + one bucket (the bound; the
                  sender itself only allocates the bucket and casts into it)
  full gather     the ranks all-gather the trainer's weights (each receives (W-1)/W of them
                  in the trainer's dtype), then rank 0 sends the version: (gathered + version)
                  / link
                  rank 0's extra memory: the full weights in the trainer's dtype (the copy it
                  keeps) + the version in the engines' dtype (what it sends from)
"""

from __future__ import annotations

import math

from msgspec import Struct


def dtype_size(dtype: str) -> int:
    """Bytes per parameter of a recipe dtype ("float32", "bfloat16", "torch.float16", ...)."""
    name = dtype.removeprefix("torch.")
    return 4 if name == "float32" else 8 if name == "float64" else 2


class SyncCost(Struct, kw_only=True):
    """One version, both paths. Bytes and seconds; `link_gb_per_s` the bandwidth assumed."""

    version_bytes: float
    shard_bytes: float  # a rank's part of the version (sharded)
    bucket_bytes: float
    link_gb_per_s: float
    sharded_s: float
    full_gather_s: float
    rank_peak_bytes: float  # sharded: a rank's extra memory during a sync (the bound)
    full_gather_peak_bytes: float  # full gather: rank 0's extra memory


def rank_peak(version_bytes: float, ranks: int, bucket_bytes: float) -> float:
    """A sending rank's extra memory during a sharded sync, at most: its shard + one bucket."""
    return math.ceil(version_bytes / max(1, ranks)) + bucket_bytes


def sync_cost(params: float, ranks: int, engine_dtype: str, trainer_dtype: str,
              bucket_mb: float, link_gb_per_s: float, gather_ways: int | None = None
              ) -> SyncCost:
    """`gather_ways`: how many ranks the full-gather path gathers from (fsdp: all `ranks`;
    megatron: the tensor-parallel peers; 1: rank 0 holds the whole model already)."""
    version = params * dtype_size(engine_dtype)
    trainer = params * dtype_size(trainer_dtype)
    link = link_gb_per_s * 1e9
    bucket = min(bucket_mb * 1024 * 1024, version)
    ways = ranks if gather_ways is None else max(1, gather_ways)
    gathered = trainer * (ways - 1) / ways
    return SyncCost(version_bytes=version, shard_bytes=version / max(1, ranks),
                    bucket_bytes=bucket, link_gb_per_s=link_gb_per_s,
                    sharded_s=version / link, full_gather_s=(gathered + version) / link,
                    rank_peak_bytes=rank_peak(version, ranks, bucket),
                    full_gather_peak_bytes=trainer + version)
