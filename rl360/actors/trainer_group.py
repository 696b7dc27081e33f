"""The trainer group: W Ray actors (`TrainerWorker`, named `rl360-trainer-{rank}`), each
holding a trainer built by `rl360.policies.trainer_backends.build_trainer` (the recipe's
`trainer.backend`: "torch", "fsdp" or "megatron"), one data-parallel rank each.

With W > 1 the workers join a torch.distributed gloo group through rank 0's rendezvous store
(bound by rank 0 on a port the kernel picks and held open: no free-port race; its address is
handed to all ranks by the group). Per step the group counts
the loss tokens and sequences of the WHOLE batch, splits the samples over the ranks balanced
by token count, and every rank runs the same optimizer step on gradients summed over ranks;
the global denominators make the sum exact (no averaging), so W ranks step exactly like one.

Checkpoints: rank 0 writes (every rank with fsdp: its shards); every rank loads, so `load(dir)` needs a directory all trainer
nodes can read (one machine, or a shared filesystem).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import ray

from rl360.actors.buffer import RefBatch, to_samples
from rl360.policies.reducers import global_denominators
from rl360.ray_session import free_port
from rl360.recipe import TrainerSection
from rl360.types import Batch, TrainSample

if TYPE_CHECKING:
    from torch import Tensor

    from rl360.weights.sender import WeightSender
    from rl360.weights.sender_calls import SenderCall

log = logging.getLogger("rl360.trainer_group")

_SUMMED = ("local_tokens", "local_seqs")
STALENESS_PREFIX = "staleness_tokens/"


def split_by_tokens(lengths: list[int], world_size: int) -> list[list[int]]:
    """Indices per rank, longest first onto the rank with the fewest tokens (LPT), given each
    sequence's length."""
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


def staleness_tokens(samples: list[TrainSample], version: int) -> dict[str, float]:
    """Loss tokens by staleness (the trainer's version minus the version that sampled them),
    as summable metrics `staleness_tokens/<k>`."""
    hist: collections.Counter[int] = collections.Counter()
    for s in samples:
        for v, m in zip(s.versions, s.mask, strict=False):
            if m and v >= 0:
                hist[version - v] += 1
    return {f"{STALENESS_PREFIX}{k}": float(c) for k, c in sorted(hist.items())}


class TrainerWorker:
    """One rank: a trainer (TorchTrainer or another backend with its interface), plus its
    torch.distributed membership when W > 1."""

    def __init__(self, rank: int, world_size: int, threads: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.threads = threads
        self.trainer: Any = None
        self.weight_sender: WeightSender | None = None  # made at the first weight sync call
        self._store: Any = None  # rank 0's rendezvous store (torch.distributed.TCPStore)

    def address(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """Rank 0: open the group's rendezvous store on a port the kernel picks, held from here
        until the group forms, and return where it listens. (A port found free and released
        for init_process_group to bind later could be taken by another process in between:
        EADDRINUSE.)"""
        host = ray.util.get_node_ip_address()
        if self.world_size == 1:
            return host, 0
        import torch.distributed as dist

        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True,
                                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return host, int(self._store.port)

    def weight_group_address(self) -> tuple[str, int]:
        """Where the planned collective weight sync's group meets (rl360.weights.transports):
        this node's address and a port free on it now, for the weight group's own rendezvous
        (not the trainer group's store, which `address` holds)."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def setup(
        self, config: TrainerSection, model_path: str, master: tuple[str, int], timeout_s: float,
        temperature: float, seed: int, sharded_sync: bool = False,
    ) -> dict[str, Any]:
        import torch
        import torch.distributed as dist


        torch.set_num_threads(self.threads)
        if self.world_size > 1:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
            if master[0] == "127.0.0.1":
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            # gloo for CPU tensors; NCCL for CUDA ones when this rank trains on its GPU
            pg_backend = ("cpu:gloo,cuda:nccl" if config.device != "cpu" and config.num_gpus > 0
                          and torch.cuda.is_available()
                          else "gloo")
            store = self._store if self.rank == 0 else dist.TCPStore(
                master[0], master[1], self.world_size, is_master=False,
                timeout=timedelta(seconds=timeout_s))
            dist.init_process_group(
                pg_backend, store=store, rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        from rl360.policies.trainer_backends import build_trainer

        self.trainer = build_trainer(config, model_path, temperature=temperature, seed=seed,
                                     sharded_sync=sharded_sync)
        n = sum(p.numel() for p in self.trainer.params)
        # where this rank sits: ranks of one data-parallel replica (tensor-parallel peers) get
        # the same samples; a backend without model parallelism is one replica per rank
        return {"rank": self.rank, "params": n, "pid": os.getpid(),
                "dp_rank": int(getattr(self.trainer, "dp_rank", self.rank)),
                "tp_rank": int(getattr(self.trainer, "tp_rank", 0)),
                # a sharded backend (fsdp) saves with every rank (a collective)
                "collective_checkpoint": bool(getattr(self.trainer, "collective_checkpoint", False))}

    def train_step(self, batch_bytes: bytes, global_tokens: int, global_seqs: int) -> dict[str, float]:
        batch = msgspec.msgpack.decode(batch_bytes, type=Batch)
        return self.trainer.train_step(batch, global_tokens, global_seqs)

    def train_step_refs(self, wrapped: list[list[Any]], advantages: list[float], step: int,
                        version: int, global_tokens: int, global_seqs: int) -> dict[str, float]:
        """Train on this rank's shard of a RefBatch: fetch its trajectories here (the refs come
        inside a list, so Ray hands them over unresolved), turn them into samples."""
        items = wrapped[0]
        refs = [i for i, x in enumerate(items) if isinstance(x, ray.ObjectRef)]
        fetched = dict(zip(refs, ray.get([items[i] for i in refs]), strict=True)) if refs else {}
        trajs = [fetched.get(i, x) for i, x in enumerate(items)]
        samples = to_samples(trajs, advantages)
        batch = Batch(samples=samples, step=step, policy_version=version)
        metrics = self.trainer.train_step(batch, global_tokens, global_seqs)
        metrics.update(staleness_tokens(samples, version))
        return metrics

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        return self.trainer.state_dict_for_sync()

    def _sync_state(self) -> dict[str, Tensor]:
        """The weights to send under HF names. A torch trainer's CPU parameters go as they are
        (views): whoever sends copies them once anyway (into the object store, or into a
        socket), so the snapshot copy of state_dict_for_sync would be a second one."""
        from rl360.policies.trainer_torch import TorchTrainer

        t = self.trainer
        # exactly TorchTrainer: subclasses (FSDPTrainer) hold sharded parameters; with
        # adapters the weights to send are merged ones (state_dict_for_sync)
        if (type(t) is TorchTrainer and t.lora is None
                and all(p.device.type == "cpu" for p in t.params)):
            return {k: v.detach() for k, v in t.model.state_dict().items()}
        return t.state_dict_for_sync()

    def weights(self, call: SenderCall) -> Any:
        """Weight sync: run a transport's call on this rank's WeightSender
        (rl360.weights.sender; rank 0 is the sender). With trainer.lora the sender sends
        adapter versions: the adapter's tensors alone (rl360.weights.adapters)."""
        if self.weight_sender is None:
            from rl360.weights.sender import WeightSender

            lora = getattr(self.trainer, "lora", None)
            if lora is not None:
                adapter = self.trainer.adapter_for_sync
                self.weight_sender = WeightSender(adapter, adapter, adapter=lora)
            else:
                self.weight_sender = WeightSender(
                    self._sync_state, self.state_dict_for_sync, held=self._held_weights,
                    rank=self.rank, world=self.world_size,
                    gather=getattr(self.trainer, "gather_full", None))
        return self.weight_sender.handle(call)

    def _held_weights(self) -> dict[str, Tensor]:
        """The weights this rank holds, as it holds them, for sharded syncs
        (rl360.weights.shards): an fsdp rank's DTensor shards, a torch rank's parameters."""
        held = getattr(self.trainer, "held_weights", None)
        if held is not None:
            return held()
        from rl360.policies.trainer_torch import TorchTrainer

        if type(self.trainer) is not TorchTrainer:
            raise ValueError(f"{type(self.trainer).__name__} cannot send the weights it holds "
                             "(train.weight_sync.sharded needs trainer.backend fsdp or torch)")
        return dict(self.trainer.model.state_dict(keep_vars=True))

    def save(self, out_dir: str) -> str:
        return str(self.trainer.save(out_dir))

    def load(self, in_dir: str) -> int:
        self.trainer.load(in_dir)
        return int(self.trainer.step)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerGroup:
    """Driver-side handle on W TrainerWorker actors."""

    def __init__(
        self,
        config: TrainerSection,
        model_path: str | Path,
        *,
        temperature: float = 1.0,
        seed: int = 0,
        name_prefix: str = "rl360-trainer",
        timeout_s: float = 600.0,
        rank_options: Callable[[int], dict[str, Any]] | None = None,
        sharded_sync: bool = False,
    ) -> None:
        """`config.workers` ranks of `config.backend`, each with `config.num_cpus/num_gpus`
        unless `rank_options(rank)` gives that rank's Ray options (resources, placement group
        bundle: launch.roles.Placement.trainer_options). `temperature` is the engines' sampling
        temperature, `seed` the run's. `sharded_sync`: every rank sends the weights it holds
        (train.weight_sync.sharded; an fsdp trainer then keeps no gathered copy)."""
        workers, num_cpus, num_gpus = config.workers, config.num_cpus, config.num_gpus
        self.world_size = workers
        self.timeout_s = timeout_s
        self.names = [f"{name_prefix}-{r}" for r in range(workers)]
        threads = config.threads or max(1, int(num_cpus))
        cls = ray.remote(TrainerWorker)
        if rank_options is None:
            def rank_options(rank: int) -> dict[str, Any]:
                return {"num_cpus": num_cpus, "num_gpus": num_gpus}
        self.workers = [
            cls.options(name=name, max_restarts=0, **rank_options(rank))
            .remote(rank, workers, threads)
            for rank, name in enumerate(self.names)
        ]
        try:
            master = self._get(self.workers[0].address.remote(timeout_s), "address")
            self.info = self._get(
                [w.setup.remote(config, str(model_path), master, timeout_s, temperature, seed,
                                sharded_sync)
                 for w in self.workers],
                "setup",
            )
        except BaseException:
            self._kill()
            raise
        log.info("trainer group up: %d %s worker(s) %s", workers, config.backend, self.names)

    # ------------------------------------------------------------------ stepping

    def _shards(self, batch: Batch | RefBatch) -> list[Any]:
        """One train_step call per rank, each on its shard (balanced by tokens; tensor-parallel
        peers of one data-parallel replica get the same shard). A RefBatch's shards are refs
        that every rank fetches itself; a Batch at hand is encoded per rank."""
        dp = [int(i.get("dp_rank", r)) for r, i in enumerate(self.info)]
        if isinstance(batch, RefBatch):
            members = batch.members
            tokens, seqs = batch.loss_tokens, batch.seqs
            parts = split_by_tokens([m.tokens for m in members], max(dp) + 1)
            return [w.train_step_refs.remote(
                        [[members[i].ref for i in parts[d]]],
                        [members[i].advantage for i in parts[d]],
                        batch.step, batch.policy_version, tokens, seqs)
                    for w, d in zip(self.workers, dp, strict=True)]
        tokens, seqs = global_denominators(s.mask for s in batch.samples)
        parts = split_by_tokens([len(s.tokens) for s in batch.samples], max(dp) + 1)
        calls = []
        for w, d in zip(self.workers, dp, strict=True):
            shard = Batch(samples=[batch.samples[i] for i in parts[d]], step=batch.step,
                          policy_version=batch.policy_version)
            calls.append(w.train_step.remote(msgspec.msgpack.encode(shard), tokens, seqs))
        return calls

    def _merge(self, results: list[dict[str, float]]) -> dict[str, float]:
        merged = dict(results[0])  # ranks all-reduce their metrics: rank 0's are global
        # one result per data-parallel replica (tensor-parallel peers saw the same samples)
        results = [r for r, i in zip(results, self.info, strict=True) if not i.get("tp_rank", 0)]
        summed = set(_SUMMED) | {k for r in results for k in r if k.startswith(STALENESS_PREFIX)}
        for k in summed:
            merged[k] = sum(r.get(k, 0.0) for r in results)
        merged["step_time_s"] = max(r["step_time_s"] for r in results)
        merged["workers"] = float(self.world_size)
        loads = [r.get("local_tokens", 0.0) for r in results]
        mean = sum(loads) / len(loads)
        merged["rank_token_imbalance"] = max(loads) / mean if mean > 0 else 1.0
        return merged

    def train_step(self, batch: Batch | RefBatch) -> dict[str, float]:
        """The trainer's step(s) on the whole batch (blocking); merged metrics."""
        return self._merge(self._get(self._shards(batch), "train_step"))

    # ------------------------------------------------------------------ weights and state

    def state_dict_ref(self) -> ray.ObjectRef:
        """An object ref to rank 0's state dict, for engines to fetch without the driver."""
        return self.workers[0].state_dict_for_sync.remote()

    def state_dict_for_sync(self) -> dict[str, Tensor]:
        return self._get(self.state_dict_ref(), "state_dict_for_sync")

    def save(self, out_dir: str | Path) -> Path:
        """Every rank of data-parallel replica 0 writes its part (one rank without model
        parallelism; with TP, rank 0 the model and each TP rank its optimizer slice); with a
        sharded backend (fsdp) every rank writes its shards."""
        writers = [w for w, i in zip(self.workers, self.info, strict=True)
                   if not i.get("dp_rank", 0) or i.get("collective_checkpoint")]
        return Path(self._get([w.save.remote(str(out_dir)) for w in writers], "save")[0])

    def load(self, in_dir: str | Path) -> int:
        steps = self._get([w.load.remote(str(in_dir)) for w in self.workers], "load")
        return int(steps[0])

    def shutdown(self) -> None:
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        except Exception as exc:  # a dead worker is being shut down anyway
            log.warning("trainer worker shutdown: %r", exc)
        self._kill()

    # ------------------------------------------------------------------ helpers

    def _get(self, refs: Any, what: str) -> Any:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"trainer group {what} took over {self.timeout_s}s "
                               f"(workers {self.names})") from exc
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a trainer worker died during {what}: {exc}") from exc

    def _kill(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
