"""Recipe sections of a training run: [train] with its nested tables (weight_sync,
rolling_start, breaker, parking, tail, curriculum, checkpoints, sampling) and [sft].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rl360.recipe.base import NonNegFloat, NonNegInt, PosInt, Prob, Section
from rl360.recipe.serving import SamplingSection


class ObjectStoreSync(Section, tag_field="transport", tag="object_store"):
    """[train.weight_sync] transport = "object_store": trainer rank 0 puts each version into
    the Ray object store as one packed object (in the engines' dtype); every engine replica
    fetches zero-copy views and loads them into its weights in place (CPU; the default).

    delta: send a version as the bits changed since the one before (torch engines; pays off in
      bf16, where ~99% of elements survive an RL step; an fp32 step changes nearly all, so it
      falls back to full versions). Replicas verify per-bucket checksums and reload the last
      full version on a mismatch. Costs the trainer one extra copy of the weights.
    delta_max_fraction: send a full version instead when the delta, or the deltas since the
      last full version, would exceed this fraction of a full one.
    bucket_mb: tensors per checksum bucket (what one mismatch names).
    zero_copy: a torch engine serves a full version straight out of the object store (its
      parameters become read-only views of the version's object, swapped by pointer: no copy
      per replica, one copy of the weights per node) instead of copying it into its own
      parameters. Full versions only: with `delta` the replicas keep private weights.
    slots: with `zero_copy`, replicas on the sender's node get full versions through up to
      this many shared-memory buffers (each one version in size, in the sender's memory
      accounting) that the sender maps once and rewrites in place
      (rl360.weights.slots): one memcpy a version instead of an object-store put into
      pages never touched before (a page fault per 4 KiB). Versions go into the object store
      when every slot is in use or a replica cannot map them. After each version the sender
      names the slot of the next one; replicas sleep on it and load it as soon as it is
      written. 0: object store only.
    """

    delta: bool = False
    zero_copy: bool = True
    slots: Annotated[int, Meta(ge=0, le=16)] = 3
    delta_max_fraction: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.25
    bucket_mb: Annotated[float, Meta(gt=0.0)] = 64.0


class CollectiveSync(Section, tag_field="transport", tag="collective"):
    """[train.weight_sync] transport = "collective": a gloo (CPU) or NCCL (GPU) group of
    trainer rank 0 and every engine replica.

    backend: "gloo" (CPU tensors, any machine) or "nccl" (GPU tensors, trainer rank 0 and the
      engine workers each on their own GPU).
    bucket_mb: tensors are sent in buckets of at most this many MB (one bigger tensor is a
      bucket of its own); bounds the extra GPU memory of a sync to one bucket.
    layout: "flat" packs a bucket into one buffer per dtype (our own receivers); "per_tensor"
      broadcasts each tensor of a bucket in order (what SGLang's and vLLM's
      update_weights_from_distributed receive). "auto" picks by engine backend (and, with
      gloo, keeps the original unbucketed path: one flat buffer per dtype).
    checksum: after a sync, engines report per-tensor checksums of what they now serve; the
      sender compares them with its own and reports every mismatch by name (debug: costs a
      pass over the weights on both sides).
    ipc: "auto" uses CUDA IPC handles instead of NCCL when the sender and an engine share one
      physical GPU (NCCL cannot put two ranks on one device); "never" forbids it.
    sharded: every trainer rank sends the weights it holds (fsdp: its shards; torch: a share of
      the tensors) in the engines' dtype, in buckets of `bucket_mb`, over a group of its own
      with every replica; no rank gathers the full model (a rank's extra memory during a sync
      is one bucket). The groups are formed again whenever replicas join or leave (a new
      epoch), and a (re)started replica takes the newest version before it serves. Buckets
      carry an xxh3 checksum (checked on gloo always, on NCCL with `checksum`).
      rl360.weights.shards, docs/weight-sync.md.
    timeout_s: with `sharded`, the bound on a sync that forms groups (the first, and each one
      after replicas joined or left) and on a wait for a live replica to register (the first
      sync waits at least 10 minutes for the engines to load).
    timeout_factor, timeout_min_s: with `sharded`, every other broadcast and every wait on a
      replica is bounded by timeout_factor x the slowest of the last syncs, at least
      timeout_min_s. A replica that does not take a version within it is named in one line.
    on_failure: with `sharded`, what a replica that did not take a version costs: "replace"
      (kill it, Serve starts another, which takes the newest version before it serves; the
      version is sent again to the others) or "stop" (the run ends with that line).
    """

    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_mb: Annotated[float, Meta(gt=0.0)] = 512.0
    layout: Literal["auto", "flat", "per_tensor"] = "auto"
    checksum: bool = False
    ipc: Literal["auto", "never"] = "auto"
    group_name: str = "rl360-weights"
    sharded: bool = False
    timeout_s: Annotated[float, Meta(gt=0.0)] = 120.0
    timeout_factor: Annotated[float, Meta(ge=1.0)] = 5.0
    timeout_min_s: Annotated[float, Meta(gt=0.0)] = 10.0
    on_failure: Literal["replace", "stop"] = "replace"


WeightSync = ObjectStoreSync | CollectiveSync


class RollingStartSection(Section):
    size: NonNegInt = 0  # groups per wave; 0 = no rolling start (all groups at once)
    interval_s: NonNegFloat = 5.0  # seconds between waves


class BreakerSection(Section):
    """[train.breaker]: the circuit breaker stops the run (naming the top failure reasons) after
    `groups` groups in a row that failed entirely on the infrastructure, or when more than
    `infra_rate` of the last `window` episodes did (actors/breaker.py)."""

    groups: PosInt = 8
    infra_rate: Prob = 0.9
    window: PosInt = 256


class ParkingSection(Section):
    """[train.parking]: with `after` > 0, a task is parked after this many all-failed groups in a
    row (every scored episode the same reward, <= 0: no GRPO signal); the stream then skips it
    `passes` times before one probe group (actors/parking.py). after = 0: every task always
    runs."""

    after: NonNegInt = 0
    passes: PosInt = 4


class TailSection(Section):
    """[train.tail]: tail cancellation. With `keep` > 0, once all but `keep` groups of the oldest
    open batch are done, a group that has run longer than `factor` x the batch's median group
    time is cancelled and its task re-queued at the back (actors/controller.py)."""

    keep: NonNegInt = 0
    factor: Annotated[float, Meta(ge=1.0)] = 3.0


class CurriculumSection(Section):
    """[train.curriculum]: `mode = "positive-first"` scales non-positive advantages by a factor
    ramping linearly from `floor` at step 1 to 1 at step `steps` (applied by the buffer when it
    cuts a batch); "none": advantages as computed."""

    mode: Literal["none", "positive-first"] = "none"
    steps: PosInt = 20
    floor: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class CheckpointsSection(Section):
    """[train.checkpoints]: a checkpoint every `every` steps and at the end (every = 0: only at
    the end), the newest `keep` of them kept."""

    every: NonNegInt = 10
    keep: PosInt = 2


class TrainSection(Section):
    init: str = ""  # the policy to start from (e.g. `rl360 sft`'s output); "" = model.path
    tasks: list[str] = msgspec.field(default_factory=lambda: ["examples/tasks"])
    task_limit: NonNegInt = 0
    # each pass over the tasks comes in a new order, drawn from a window of this many tasks
    # (the files are streamed, never loaded whole; a window >= the task count is a full
    # shuffle), seeded by run.seed and the pass number so a resume replays it; 0 = file order
    shuffle_window: NonNegInt = 4096
    steps: PosInt = 100
    group_size: PosInt = 8  # attempts per task (one group)
    groups_per_batch: PosInt = 32
    max_staleness: NonNegInt = 1  # 0 = synchronous on-policy
    stale_policy: Literal["drop", "keep"] = "drop"
    filter_zero_variance: bool = False
    max_in_flight_groups: PosInt = 64
    capacity_groups: PosInt = 256
    # an episode that fails on the infrastructure (or whose env actor dies) runs again on
    # another actor up to this many times, so its group keeps group_size samples
    episode_reruns: NonNegInt = 1
    breaker: BreakerSection = msgspec.field(default_factory=BreakerSection)
    parking: ParkingSection = msgspec.field(default_factory=ParkingSection)
    tail: TailSection = msgspec.field(default_factory=TailSection)
    # open the first groups in waves of `size` groups every `interval_s` seconds instead of
    # all max_in_flight_groups at once (spares the engines and sandboxes a cold-start burst)
    rolling_start: RollingStartSection = msgspec.field(default_factory=RollingStartSection)
    # true: a filtered group (zero variance, all infra errors) or a tail-cancelled one frees its
    # batch slot for another group, every batch has groups_per_batch groups; false: exactly
    # groups_per_batch groups are started per batch and the batch is whatever survived
    # (a variable batch; the token-mean reducer normalizes by its own token count)
    oversampling: bool = True
    curriculum: CurriculumSection = msgspec.field(default_factory=CurriculumSection)
    sync_every: PosInt = 1  # publish weights every k steps
    # how weights reach the engines: [train.weight_sync] transport = "object_store" (default)
    # or "collective" (with backend, bucket_mb, layout, checksum, ipc)
    weight_sync: WeightSync = msgspec.field(default_factory=ObjectStoreSync)
    # wall-clock budget of the whole run (start-up included): after the step that crosses it
    # the run checkpoints and ends as if it had reached `steps`; 0 = no limit
    max_minutes: NonNegFloat = 0.0
    checkpoints: CheckpointsSection = msgspec.field(default_factory=CheckpointsSection)
    wandb: Literal["offline", "online", "disabled"] = "offline"
    # N > 0: N sampled trajectories of every step's batch (decoded text, reward, components,
    # versions) appended to <run dir>/trajectories.jsonl
    log_trajectories: NonNegInt = 0
    # K > 0: every K steps, one attempt at each held-out task (eval.tasks, eval.limit, with
    # eval.sampling) on the current policy, alongside training; logged as eval/* when done
    eval_every: NonNegInt = 0
    sampling: SamplingSection = msgspec.field(default_factory=SamplingSection)
    # fault drills (tests/launch/test_faults.py, bench/faults.py): "PART@N" kills one PART of
    # the run right after step N (env_actor, engine, shard, publisher); Ray or Serve restarts
    # it and the run must go on, losing no task (<run dir>/ledger.jsonl says what happened).
    # engine_stall stops (SIGSTOP) an engine replica on this node just before step N's weight
    # sync: the sync must name it within its timeout and follow train.weight_sync.on_failure
    inject_faults: list[Annotated[str, Meta(
        pattern=r"^(env_actor|engine|engine_stall|shard|publisher)@[1-9][0-9]*$")]] = \
        msgspec.field(default_factory=list)


class SftSection(Section):
    data: str = "examples/demo/families.py:warmstart_chats"  # .jsonl chats or "module:function"
    samples: PosInt = 4096  # for a generator: how many chats to draw
    base: str = "tiny"  # the model to start from ("tiny" + [sft.init]: a fresh tiny model)
    init: dict[str, Any] = msgspec.field(default_factory=dict)  # TinyModelSpec fields
    steps: PosInt = 100
    batch_size: PosInt = 32
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 1e-3
    out: str = "runs/warmstart"
    # > 0: a fresh tiny model (sft.base "tiny[:preset]") with a byte-level BPE of this many
    # tokens trained on the SFT data instead of one token per byte (256..65536)
    tokenizer_vocab: Annotated[int, Meta(ge=0, le=65536)] = 0
