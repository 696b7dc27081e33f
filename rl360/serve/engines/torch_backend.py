"""The reference engine backend: Llama-shaped HF causal LMs in plain torch, batched
continuously.

One named background task runs the engine loop. Between two decode steps it applies a
pending weight update, drops cancelled rows, and admits waiting requests into free rows of the
running batch (an idle engine first waits up to `batch_wait_ms` for company), lowest
`SamplingParams.priority` first and in arrival order within a priority (the rollout controller
gives each group its start order, so the oldest batch's turns go first); then one step
runs on the engine's thread: a prefill of the newly admitted rows (prompt suffixes past a
prefix-cache hit, grouped by length) and one decode token for every other row. Rows that
finish leave at once; the K/V cache is the engine's own (`torch_model.SlotKV`), and finished
sequences leave their K/V in an LRU prefix cache (`prefix_cache.PrefixCache`) for the next turn.
While nothing needs the loop (no finished row, new request, update or cancellation), the engine
thread runs decode steps back to back instead of handing back after each one.

Weight updates: `weight_update = "inflight"` swaps weights between two decode steps without
waiting for running sequences, so a sequence may span versions and each token carries the
version that sampled it (`Generation.token_versions`). The swap runs on the engine thread at the
start of its next step, inside a decode burst (the loop is not woken, no thread hand-off), and
that step decodes only the running rows: a running sequence waits for the swap plus one decode
step, no more. `sync_log` / the `sync_pause_max_s` stat record, per swap, the longest gap
between two tokens of a row that ran across it (measured on the engine thread). `"drain"` stops
admitting, waits until the running rows finish, then swaps (every sequence has one version).
Either way the prefix cache is cleared. An adapter version (`trainer.lora`) swaps the same way:
each version is merged into the base weights it adapts (rl360.serve.engines.torch_adapter). The logprob of each token is its log-probability under the distribution it
was sampled from (after temperature, top-k and top-p; the raw distribution for greedy).

This module is the backend (the contract, set-up, health); the engine loop and its steps are
rl360.serve.engines.torch_scheduler, a request's row and the batching rules
rl360.serve.engines.torch_requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rl360.policies.affinity import pin_to_cpus
from rl360.policies.devices import place_for_generation, select_device
from rl360.policies.loading import load_tokenizer, resolve_model_path
from rl360.policies.native_llama import load_native_llama, native_config
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.serve.engines.prefix_cache import PrefixCache
from rl360.serve.engines.sampling import processed_logprobs
from rl360.serve.engines.torch_adapter import EngineAdapter
from rl360.serve.engines.torch_model import LlamaRunner
from rl360.serve.engines.torch_requests import Request, Update, WaitQueue, quantile
from rl360.serve.engines.torch_scheduler import Scheduler
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import AdapterUpdate, PackedUpdate, TensorUpdate, WeightUpdate, refuse
from rl360.weights.plan import held_checksums
from rl360.weights.receiver import Intake, WeightChecksums

log = logging.getLogger("rl360.engine.torch")

__all__ = ["TorchBackend", "load_causal_lm", "processed_logprobs"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(model: str, dtype: str, num_gpus: float = 0.0,
                   native: bool = True) -> tuple[Any, Any]:
    """The model (on the reserved GPU when num_gpus > 0, see rl360.policies.devices) and
    its tokenizer. `native`: a plain Llama checkpoint loads into the engine's own modules
    (native_llama.py: no transformers modeling import; a replica's import + load 5.3 -> 3.1
    CPU s); other models, or native = False, through transformers."""
    placement = select_device(num_gpus, dtype, gpus_key="engine.num_gpus", dtype_key="model.dtype")
    path = resolve_model_path(model)
    tok = load_tokenizer(str(path))
    cfg = native_config(path) if native else None
    if cfg is not None:
        return load_native_llama(path, cfg, placement.dtype, placement.device), tok
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    lm = place_for_generation(lm, placement)
    lm.eval()
    return lm, tok


class TorchBackend(Scheduler):
    def __init__(self, engine: EngineSection, model_cfg: ModelSection, seed: int = 0,
                 model: Any = None, tokenizer: Any = None) -> None:
        """`model`/`tokenizer`: an already loaded HF model (tests, benches) instead of
        loading `model_cfg.path`."""
        if model_cfg.dtype not in _DTYPES:
            raise ValueError(f"model.dtype {model_cfg.dtype!r} not in {sorted(_DTYPES)}")
        pin_to_cpus(engine.cpu_affinity, "engine.cpu_affinity")
        if engine.threads > 0:
            torch.set_num_threads(engine.threads)
        self.engine_cfg, self.model_cfg = engine, model_cfg
        # "auto" is in-flight here (the recipe refuses "inflight" for backends that drain)
        self.weight_update = "drain" if engine.weight_update == "drain" else "inflight"
        if model is None:
            model, tokenizer = load_causal_lm(model_cfg.path, model_cfg.dtype, engine.num_gpus,
                                              native=engine.native_llama)
        self.model = model
        self.tokenizer = tokenizer
        self.runner = LlamaRunner(model)
        self.adapter = EngineAdapter(model)  # adapter versions (trainer.lora), merged
        self.prefix = PrefixCache(int(engine.prefix_cache_mb * 2**20))
        self._version = 0
        self._waiting = WaitQueue()
        self._rows: list[Request] = []  # row i lives in KV slot i
        self._updates: deque[Update] = deque()  # appended by the loop, taken by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fatal: BaseException | None = None  # a packed load failed half-way: stop serving
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        self._interrupt = False  # set by the loop's thread, read by the engine's between steps
        self._rng = random.Random(seed)
        self._failure: BaseException | None = None
        self._stats: dict[str, Any] = {
            "batches": 0, "steps": 0, "requests": 0, "tokens": 0, "cancelled": 0, "prefills_shared": 0,
            "busy_s": 0.0, "updates": 0, "last_step_s": 0.0, "last_step_cpu_s": 0.0,
            "last_step_faults": 0, "last_swap_faults": 0,
            "last_swap_s": 0.0, "last_swap_cpu_s": 0.0, "last_update_wait_s": 0.0,
            "sync_pause_max_s": 0.0, "sync_pause_excess_max_s": 0.0,
            "sync_pause_over_budget_max_s": float("-inf"),
        }
        self.step_times: deque[float] = deque(maxlen=4096)  # seconds of the latest steps
        # per in-flight swap with rows running: {"version", "swap_s", "pause_s", "step_s",
        # "step_before_s", "wait_s", "rows", "steps_across"} (pause: the longest gap between two
        # tokens of a row across it; step / step_before: the decode steps right after / before
        # it; wait: from the update's arrival to the swap's start; steps_across: engine steps
        # between a row's last old and first new token)
        self.sync_log: deque[dict[str, float]] = deque(maxlen=256)
        # seconds by which a plain decode step took longer than the plain step of the same rows
        # right before it (negative: shorter): the step-to-step change no swap is involved in
        self.step_changes: deque[float] = deque(maxlen=4096)
        self._last_plain: tuple[int, float] | None = None
        self._step_end = 0.0  # perf_counter at the end of the last step
        # per in-flight swap whose step before was a plain decode step of the same rows (and no
        # row left in the step after): pause - swap - that step, the figure the bar is about
        self.swap_overs: deque[float] = deque(maxlen=4096)
        # all model work on ONE long-lived thread: torch's intra-op pool and the allocator's
        # arenas are per calling thread, and hopping between executor threads made a batch
        # ~15x slower (and the process 4 GB larger) inside a Serve replica
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rl360-torch-engine")
        self._started = time.monotonic()

    # ------------------------------------------------------------------ contract

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        check_prompt(prompt_ids, self.model_cfg.max_model_len)
        self._ensure_started()
        assert self._wake is not None
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(self._poke)  # a cancelled caller frees its row at the next step
        self._waiting.push(Request(list(prompt_ids), sampling, fut))
        self._poke()
        return await fut  # cancelling the caller cancels fut: its row leaves at the next step

    def weight_intake(self) -> Intake:
        return Intake(packed=True)  # packed versions load into its parameters in place

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        if not isinstance(update, PackedUpdate | TensorUpdate | AdapterUpdate):
            raise refuse("torch", update, "packed (full, slot, delta), tensor or adapter")
        self._ensure_started()
        assert self._wake is not None
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._updates.append(Update(version, update, done, time.perf_counter()))
        if self.weight_update == "inflight":
            self._wake.set()  # no interrupt: a decode burst takes it before its next step
        else:
            self._poke()
        return await done

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        held = {**self.model.state_dict(), **self.adapter.tensors}  # + an adapter's A and B
        return await asyncio.to_thread(held_checksums, held, names)

    async def pause(self) -> None:
        self._ensure_started()
        self._paused = True

    async def resume(self) -> None:
        self._ensure_started()
        assert self._wake is not None
        self._paused = False
        self._poke()

    def health(self) -> dict[str, Any]:
        return {
            "ok": self._failure is None,
            "error": repr(self._failure) if self._failure else None,
            "version": self._version,
            "paused": self._paused,
            "queued": len(self._waiting),
            "running": len(self._rows),
            "weight_update": self.weight_update,
            "uptime_s": time.monotonic() - self._started,
            "torch_threads": torch.get_num_threads(),
            "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
            "step_median_s": statistics.median(list(self.step_times)) if self.step_times else 0.0,
            # the control for sync_pause_over_budget_max_s (docs/weight-sync.md): the largest
            # and the 95th percentile of step_changes
            "step_change_max_s": max(self.step_changes, default=0.0),
            "step_change_p95_s": quantile(self.step_changes, 0.95),
            # per comparable swap, pause - swap - the plain step of the same rows before it:
            # the typical (median) and the worst, judged against the control above
            "sync_over_median_s": statistics.median(self.swap_overs) if self.swap_overs else 0.0,
            "sync_over_max_s": max(self.swap_overs, default=0.0),
            "sync_over_n": len(self.swap_overs),
            "kv_bytes": self.runner.kv.nbytes,
            "prefix_entries": len(self.prefix),
            "prefix_bytes": self.prefix.nbytes,
            **self.prefix.stats,
            **self._stats,
        }

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False)
