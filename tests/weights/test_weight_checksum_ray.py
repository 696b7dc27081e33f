"""The collective transport's checksum option end to end on CPU (gloo): trainer rank 0 sends,
the torch engine replica applies and reports the checksums of what its model now holds, and
the transport finds them equal to the trainer's, tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serving import serving


@pytest.mark.ray
def test_gloo_sync_with_checksums(ray_cluster, tiny_dir: Path) -> None:  # type: ignore[no-untyped-def]
    import ray

    from rl360.actors.trainer_group import TrainerGroup
    from rl360.recipe import CollectiveSync, TrainerSection
    from rl360.weights.sender_calls import Spec
    from rl360.weights.transports import CollectiveTransport

    with serving(["engine.replicas=1"]) as handles:
        trainer = TrainerGroup(TrainerSection(num_cpus=0), tiny_dir)
        try:
            transport = CollectiveTransport(handles, trainer.workers[0], 1,
                                            options=CollectiveSync(checksum=True))
            assert transport.publish(1)
            assert ray.get(handles.publisher.wait_applied.remote(1, 1, 120.0)) == 1
            [report] = transport.last_reports
            sent = ray.get(trainer.workers[0].weights.remote(Spec()))
            assert report.ok, report.summary()
            assert report.checked == len(sent) and report.version == 1
            members = ray.get(handles.publisher.members.remote())
            assert [m["offset"] for m in members.values()] == [1]
            assert next(iter(members.values()))["layout"] == "flat"
        finally:
            trainer.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["per_tensor"])
def test_planned_bucketed_sync_over_gloo(ray_cluster, tiny_dir: Path, layout: str) -> None:  # type: ignore[no-untyped-def]
    """The GPU transport's planned path (member ranks, buckets, a named group joined by a
    receiver in the replica) with gloo in place of NCCL: two versions through one group."""
    import ray

    from rl360.actors.trainer_group import TrainerGroup
    from rl360.recipe import CollectiveSync, TrainerSection
    from rl360.weights.transports import CollectiveTransport

    with serving(["engine.replicas=1"]) as handles:
        trainer = TrainerGroup(TrainerSection(num_cpus=0), tiny_dir)
        try:
            opts = CollectiveSync(layout=layout, bucket_mb=0.02, checksum=True)
            transport = CollectiveTransport(handles, trainer.workers[0], 1, options=opts)
            for version in (1, 2):
                assert transport.publish(version)
                assert ray.get(handles.publisher.wait_applied.remote(version, 1, 120.0)) == version
                [report] = transport.last_reports
                assert report.ok and report.version == version, report.summary()
            plan = transport._gpu
            assert plan is not None and plan["backend"] == "gloo" and len(plan["buckets"]) > 1
        finally:
            trainer.shutdown()
