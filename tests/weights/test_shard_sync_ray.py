"""Sharded weight sync end to end on CPU (gloo): 2 and 4 FSDP2 trainer ranks, each sending
only its own shards (the trainer keeps no gathered copy), to 2 torch engine replicas serving
bf16. The replicas serve bit-identical weights to a full-gather sync of the same step (the
ranks gather, rank 0 broadcasts over the flat gloo collective): the per-tensor checksums of
what each replica serves after each sync are equal, and equal to the sum of the ranks' parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policies.conftest import random_samples
from tests.serving import serving

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_sync_serves_what_a_full_gather_serves(ray_cluster, tiny_dir: Path,  # type: ignore[no-untyped-def]
                                                       ranks: int) -> None:
    import ray

    from rl360.actors.trainer_group import TrainerGroup
    from rl360.recipe import CollectiveSync, TrainerSection
    from rl360.types import Batch
    from rl360.weights.sender_calls import Gather
    from rl360.weights.shard_transport import ShardedTransport
    from rl360.weights.transports import CollectiveTransport

    with serving(["engine.replicas=2", "model.dtype='bfloat16'"]) as handles:
        cfg = TrainerSection(backend="fsdp", workers=ranks, num_cpus=0, lr=1e-2,
                             micro_batch_size=4)
        trainer = TrainerGroup(cfg, tiny_dir, sharded_sync=True)
        pub = handles.publisher
        try:
            trainer.train_step(Batch(samples=random_samples(8, seed=5), step=0))  # weights move
            opts = CollectiveSync(sharded=True, bucket_mb=0.05, checksum=True)
            sharded = ShardedTransport(handles, trainer, 2, opts, dtype="bfloat16")
            assert sharded.publish(1)
            reports = sharded.last_reports
            assert len(reports) == 2 and all(r.ok for r in reports), [r.summary() for r in reports]
            last = sharded.last
            assert last["epoch"] == 1 and last["replicas"] == 2
            assert len(last["ranks"]) == ranks and all(r["bytes"] for r in last["ranks"])
            after_sharded = ray.get(pub.wait_checksums.remote(1, 2, 60.0))

            # the full-gather path on the same weights: every rank gathers, rank 0 sends
            assert ray.get([w.weights.remote(Gather()) for w in trainer.workers])[0] > 0
            full = CollectiveTransport(handles, trainer.workers[0], 2,
                                       options=CollectiveSync(checksum=True))
            assert full.publish(2)
            assert all(r.ok for r in full.last_reports)
            after_full = ray.get(pub.wait_checksums.remote(2, 2, 60.0))
            assert sorted(after_sharded) == sorted(after_full)
            for replica in after_full:
                assert after_sharded[replica]["dtype"] == "torch.bfloat16"
                assert after_sharded[replica]["sums"] == after_full[replica]["sums"], replica
        finally:
            trainer.shutdown()
