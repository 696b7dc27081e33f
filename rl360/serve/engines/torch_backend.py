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
the base weights stay, the adapter's tensors go into place (rl360.serve.engines.torch_adapter). The logprob of each token is its log-probability under the distribution it
was sampled from (after temperature, top-k and top-p; the raw distribution for greedy).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import random
import resource
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rl360.policies.affinity import pin_to_cpus
from rl360.policies.devices import place_for_generation, select_device
from rl360.policies.loading import load_tokenizer, resolve_model_path
from rl360.policies.native_llama import load_native_llama, native_config
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.serve.engines.prefix_cache import PrefixCache
from rl360.serve.engines.sampling import processed_logprobs, sample_rows
from rl360.serve.engines.torch_adapter import EngineAdapter
from rl360.serve.engines.torch_model import LlamaRunner
from rl360.types import Generation, SamplingParams
from rl360.weights.packing import apply_packed, own_weights
from rl360.weights.payloads import AdapterUpdate, PackedUpdate, TensorUpdate, WeightUpdate, refuse
from rl360.weights.plan import held_checksums
from rl360.weights.receiver import Intake, WeightChecksums

log = logging.getLogger("rl360.engine.torch")
_MAX_BURST = 64  # decode steps the engine thread may run before handing back to the loop

__all__ = ["TorchBackend", "load_causal_lm", "processed_logprobs", "split_by_length"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Generation]
    generator: random.Random | None = None  # the row's own draws (sampling.sample_rows)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_kind: str = ""
    stop_string: str | None = None
    kv_len: int = 0  # positions of this row's slot holding valid K/V
    prefix_len: int = 0  # of those, reused from the prefix cache
    prefix_kv: Any = None  # the prefix cache's K/V for it, until loaded into its slot
    joined_step: int = -1  # engine step that prefilled it
    kv_version: int = -1  # weights that computed its oldest K/V (the prompt's, cached or not)
    t_last: float = 0.0  # when its newest token was sampled


@dataclass
class _Update:
    version: int
    state: PackedUpdate | TensorUpdate
    done: asyncio.Future[bool]
    arrived: float = 0.0  # perf_counter when it was queued


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


class TorchBackend:
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
        self.adapter = EngineAdapter(model)  # adapter versions (trainer.lora)
        self.prefix = PrefixCache(int(engine.prefix_cache_mb * 2**20))
        self._version = 0
        self._waiting = _WaitQueue()
        self._rows: list[_Request] = []  # row i lives in KV slot i
        self._updates: deque[_Update] = deque()  # appended by the loop, taken by the engine thread
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
        self._waiting.push(_Request(list(prompt_ids), sampling, fut))
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
        self._updates.append(_Update(version, update, done, time.perf_counter()))
        if self.weight_update == "inflight":
            self._wake.set()  # no interrupt: a decode burst takes it before its next step
        else:
            self._poke()
        return await done

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        return await asyncio.to_thread(held_checksums, self.model.state_dict(), names)

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
            "step_change_p95_s": _quantile(self.step_changes, 0.95),
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

    # ------------------------------------------------------------------ the engine loop

    def _poke(self, *_: Any) -> None:
        """Something for the loop to do: wake it, and end the engine thread's decode burst."""
        self._interrupt = True
        if self._wake is not None:
            self._wake.set()

    def _ensure_started(self) -> None:
        if self._task is not None and not self._task.done():
            return
        if self._failure is not None:
            raise RuntimeError(f"engine loop failed earlier: {self._failure!r}")
        self._wake = self._wake or asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.get_running_loop().create_task(
            self._engine_loop(), name="rl360-torch-engine-loop"
        )
        self._task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._failure = exc
            log.error("engine loop died: %r", exc)
            for r in list(self._waiting) + self._rows:
                if not r.future.done():
                    r.future.set_exception(RuntimeError(f"engine loop died: {exc!r}"))

    async def _engine_loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            if self._updates and not self._rows:  # idle (or drained): swap now, on the thread
                await loop.run_in_executor(self._executor, self._swap_pending)
            gone = [i for i, r in enumerate(self._rows) if r.future.done()]
            admit = self._admit()
            if not admit and not self._rows:
                self._wake.clear()
                if (self._waiting and not self._paused) or self._updates:
                    continue  # something became possible while we looked
                await self._wake.wait()
                if not self._rows and self._waiting and self.engine_cfg.batch_wait_ms > 0:
                    await asyncio.sleep(self.engine_cfg.batch_wait_ms / 1000.0)  # gather company
                continue
            self._interrupt = False
            try:
                done = await loop.run_in_executor(self._executor, self._steps, gone, admit)
            except Exception as exc:  # a failed step fails its rows, not the engine
                if self._fatal is not None:
                    raise
                log.exception("engine step failed with %d rows", len(self._rows) + len(admit))
                for r in self._rows + admit:
                    if not r.future.done():
                        r.future.set_exception(exc)
                self._rows = []
                await loop.run_in_executor(self._executor, self.runner.kv.release)
                continue
            self._stats["batches"] += bool(admit)
            for r in done:
                self._finish(r)

    def _admit(self) -> list[_Request]:
        blocked = self._paused or (self._updates and self.weight_update == "drain")
        admit: list[_Request] = []
        free = self.engine_cfg.max_batch_size - len(self._rows)
        while self._waiting and not blocked and len(admit) < free:
            r = self._waiting.pop()
            if not r.future.done():
                admit.append(r)
        return admit

    def _swap_pending(self) -> float | None:
        """On the engine thread: apply the updates that may go now (in drain mode only with no
        row running). Returns the seconds the swaps took, None when none was applied."""
        took: float | None = None
        while self._updates:
            if self.weight_update == "drain" and self._rows:
                return took  # admissions are closed; the running rows finish first
            u = self._updates.popleft()
            if u.version <= self._version:
                log.warning("ignoring weight update to version %d: this replica already serves %d",
                            u.version, self._version)
                self._settle(u.done, False)
                continue
            t0, c0, f0 = time.perf_counter(), time.thread_time(), _faults()
            self._stats["last_update_wait_s"] = t0 - u.arrived
            # a packed version (rl360.weights.packing) loads in place, checked
            packed = isinstance(u.state, PackedUpdate)
            try:
                if isinstance(u.state, PackedUpdate):
                    apply_packed(u.state, self.model)
                elif isinstance(u.state, AdapterUpdate):
                    self.adapter.apply(u.state)
                else:
                    self._load_state(u.state.tensors)
            except Exception as exc:
                self._settle(u.done, exc)
                if packed:  # parameters may be partly written: end the loop, fail its rows
                    self._fatal = exc
                    raise
                continue
            swap = time.perf_counter() - t0
            self._stats["last_swap_cpu_s"] = time.thread_time() - c0
            self._stats["last_swap_faults"] = _faults() - f0
            took = (took or 0.0) + swap
            self._version = u.version
            self.prefix.clear()  # its K/V came from the old weights
            self._stats["updates"] += 1
            self._stats["last_swap_s"] = swap
            log.info("weights -> version %d in %.3fs (%d rows running)", u.version, swap,
                     len(self._rows))
            self._settle(u.done, True)
        return took

    def _settle(self, fut: asyncio.Future[bool], value: bool | BaseException) -> None:
        """Settle an update's future from the engine thread (on the loop's thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_settle, fut, value)

    def _record_pause(self, before: dict[int, tuple[float, int]], swap: float, wait: float,
                      step_before: float, step_s: float, done: list[_Request],
                      cpu_before: float, same: bool, end_before: float,
                      faults_before: int) -> None:
        """The longest gap between two tokens of a sequence that ran across the last swap."""
        rows = [r for r in self._rows + done if id(r) in before]
        if not rows:
            return
        pause = max(r.t_last - before[id(r)][0] for r in rows)
        # from the end of the step before: a step that decoded the running rows and then
        # prefilled new ones stamped the running rows' tokens before its prefill, which a
        # sequence waits for with or without a swap
        held = max(r.t_last - max(before[id(r)][0], end_before) for r in rows)
        across = max(len(r.out_ids) - before[id(r)][1] for r in rows)
        self._stats["sync_pause_max_s"] = max(self._stats["sync_pause_max_s"], pause)
        # beyond the swap and the step right after it (the engine's own hand-offs; ~0), and
        # beyond the swap and one decode step of the same rows (the one right before it)
        self._stats["sync_pause_excess_max_s"] = max(self._stats["sync_pause_excess_max_s"],
                                                     held - swap - step_s)
        self._stats["sync_pause_over_budget_max_s"] = max(
            self._stats["sync_pause_over_budget_max_s"], pause - swap - step_before)
        if same:
            self.swap_overs.append(pause - swap - step_before)
        self.sync_log.append({"version": self._version, "swap_s": swap, "pause_s": pause,
                              "held_s": held,
                              "step_s": step_s, "step_before_s": step_before,
                              "wait_s": wait, "rows": len(rows),
                              "steps_across": across, "same_rows": same,
                              # the engine thread's CPU seconds in the same spans: wall far
                              # above CPU is time the thread was not running (another process
                              # on its core, or the GIL)
                              "swap_cpu_s": self._stats["last_swap_cpu_s"],
                              "step_cpu_s": self._stats["last_step_cpu_s"],
                              "step_before_cpu_s": cpu_before,
                              # minor page faults the engine thread took in each span
                              "swap_faults": self._stats["last_swap_faults"],
                              "step_faults": self._stats["last_step_faults"],
                              "step_before_faults": faults_before})

    def _finish(self, r: _Request) -> None:
        self._stats["requests"] += 1
        self._stats["tokens"] += len(r.out_ids)
        if r.future.done():  # the caller went away
            return
        r.future.set_result(Generation(
            token_ids=r.out_ids,
            logprobs=r.out_logprobs,
            finish_reason=r.finish_reason,  # type: ignore[arg-type]
            policy_version=r.out_versions[-1] if r.out_versions else self._version,
            token_versions=r.out_versions,
            stop_kind=r.stop_kind,
            stop_string=r.stop_string,
            mixed_versions=len(set(r.out_versions)) > 1,
        ))

    # ------------------------------------------------------------------ model work (thread)

    def _load_state(self, state: dict[str, Any]) -> None:
        own = self.model.state_dict()
        unknown = [k for k in state if k not in own]
        if unknown:
            raise ValueError(f"weight update has tensors the model lacks: {unknown[:5]}")
        for k, v in state.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"weight update {k}: shape {tuple(v.shape)} != {tuple(own[k].shape)}")
        if own_weights(self.model):  # the weights view a version: copy into private ones
            own = self.model.state_dict()
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(torch.as_tensor(v).to(own[k].dtype))

    def _steps(self, gone: list[int], admit: list[_Request]) -> list[_Request]:
        """One step, then more decode steps on the same thread while nothing needs the loop:
        no row finished and no request or cancellation arrived (each sets `_interrupt`; an
        in-flight weight update does not: the next step applies it). Saves two thread
        hand-offs per token on a busy CPU. Returns the finished rows."""
        done = self._timed_step(gone, admit)
        n = 1
        while not done and self._rows and not self._interrupt and n < _MAX_BURST:
            done = self._timed_step([], [])
            n += 1
        return done

    def _timed_step(self, gone: list[int], admit: list[_Request]) -> list[_Request]:
        """One engine step; in-flight mode first applies any pending weight update here, on
        the engine thread. Right after such a swap the running rows decode alone (new prompts
        prefill in a step of their own), so the swap delays a running sequence by the swap
        and one decode step."""
        if self.weight_update == "inflight" and self._updates and self._rows:
            wait_from = self._updates[0].arrived
            before = {id(r): (r.t_last, len(r.out_ids)) for r in self._rows}
            step_before = self._stats["last_step_s"]
            cpu_before = self._stats["last_step_cpu_s"]
            faults_before = self._stats["last_step_faults"]
            end_before = self._step_end
            # the step before compares with the step after only when it was a plain decode
            # step of the rows the step after decodes (a prefill or a finished row changes it)
            same = (self._last_plain is not None and not gone
                    and self._last_plain[0] == len(self._rows))
            t_swap = time.perf_counter()
            swap = self._swap_pending()
            if swap is not None:
                self._last_plain = None  # the step after a swap is not a control
                done = self._one_step(gone, [])
                self._record_pause(before, swap, t_swap - wait_from, step_before,
                                   self._stats["last_step_s"], done, cpu_before, same,
                                   end_before, faults_before)
                return done + (self._one_step([], admit) if admit else [])
        return self._one_step(gone, admit)

    def _one_step(self, gone: list[int], admit: list[_Request]) -> list[_Request]:
        rows = len(self._rows)
        t0, c0, f0 = time.perf_counter(), time.thread_time(), _faults()
        done = self._step(gone, admit, self._version)
        dt = time.perf_counter() - t0
        self._stats["busy_s"] += dt
        self._stats["last_step_s"] = dt
        self._stats["last_step_cpu_s"] = time.thread_time() - c0
        self._stats["last_step_faults"] = _faults() - f0
        self._step_end = t0 + dt
        self.step_times.append(dt)
        # the control for the pause across a swap: how much one plain decode step (no row
        # admitted or dropped) takes longer than the plain decode step of the same rows before it
        plain = (rows, dt) if not admit and not gone else None
        if plain and self._last_plain and self._last_plain[0] == rows:
            self.step_changes.append(dt - self._last_plain[1])
        self._last_plain = plain
        return done

    @torch.inference_mode()  # the slot cache's tensors are inference tensors: all work on them here
    def _step(self, gone: list[int], admit: list[_Request], version: int) -> list[_Request]:
        """One engine step; returns the rows that finished (already removed)."""
        self._remove(gone)
        self._stats["cancelled"] += len(gone)
        old = len(self._rows)
        step = self._stats["steps"]
        self._stats["steps"] = step + 1
        if old:  # one decode token for every running row
            logits = self.runner.forward(0, [[r.out_ids[-1]] for r in self._rows],
                                         [r.kv_len for r in self._rows])
            for r in self._rows:
                r.kv_len += 1
            self._sample_into(self._rows, logits, version)
        if admit:  # prefill the new rows, similar suffix lengths together
            for r in admit:
                seed = r.sampling.seed if r.sampling.seed is not None else self._rng.getrandbits(62)
                r.generator = random.Random(seed)
                r.joined_step = step
                r.kv_version = version  # the cache holds only K/V of the weights now served
            leaders, copies = same_prompts(admit)
            self._stats["prefills_shared"] += len(admit) - len(leaders)
            for r in leaders:  # a copy takes its leader's K/V whole: no lookup of its own
                r.prefix_len, r.prefix_kv = self.prefix.lookup(r.prompt_ids)
            first = old
            for chunk in split_by_length(leaders, key=lambda r: len(r.prompt_ids) - r.prefix_len):
                longest = max(len(r.prompt_ids) for r in chunk)
                self.runner.kv.ensure(first + len(chunk), longest)
                for i, r in enumerate(chunk):
                    if r.prefix_kv is not None:
                        self.runner.kv.load(first + i, r.prefix_kv, r.prefix_len)
                        r.prefix_kv = None
                logits = self.runner.forward(
                    first, [r.prompt_ids[r.prefix_len:] for r in chunk], [r.prefix_len for r in chunk])
                # the requests with a leader's prompt: its K/V copied into their rows (after the
                # chunk's), its last logits sampled once per request with the request's own
                # generator and settings
                rows, src = list(chunk), []
                for i, r in enumerate(chunk):
                    for c in copies.get(id(r), ()):
                        rows.append(c)
                        src.append(i)
                if src:
                    self.runner.kv.ensure(first + len(rows), longest)
                    for j, i in enumerate(src):
                        self.runner.kv.move(first + i, first + len(chunk) + j, len(chunk[i].prompt_ids))
                    logits = torch.cat([logits, logits[src]])
                for r in rows:
                    r.kv_len = len(r.prompt_ids)
                self._sample_into(rows, logits, version)
                self._rows.extend(rows)
                first += len(rows)
        done = [i for i, r in enumerate(self._rows) if r.finish_reason]
        finished = [self._rows[i] for i in done]
        for i in done:
            r = self._rows[i]
            # a row that ran across an in-flight swap holds K/V of the old weights: caching it
            # would let later requests (a group's next member, the next pass over the task)
            # sample from a prompt encoded by weights no longer served, while their tokens are
            # tagged with the new version
            if (self.prefix.budget and r.kv_len >= self.prefix.min_tokens
                    and r.kv_version == self._version):
                self.prefix.insert((r.prompt_ids + r.out_ids)[: r.kv_len], self.runner.kv.export(i, r.kv_len))
        self._remove(done)
        return finished

    def _remove(self, idx: list[int]) -> None:
        """Drop rows (by index) and keep the rest packed: the last row moves into each hole."""
        for i in sorted(idx, reverse=True):
            last = len(self._rows) - 1
            if i != last:
                self.runner.kv.move(last, i, self._rows[last].kv_len)
                self._rows[i] = self._rows[last]
            self._rows.pop()

    def _sample_into(self, rows: list[_Request], logits: torch.Tensor, version: int) -> None:
        picks = sample_rows(logits, [r.sampling for r in rows], [r.generator for r in rows])
        now = time.perf_counter()
        for r, (tok, lp) in zip(rows, picks, strict=True):
            r.out_ids.append(tok)
            r.out_logprobs.append(lp)
            r.out_versions.append(version)
            r.t_last = now
            self._check_finished(r)

    def _check_finished(self, r: _Request) -> None:
        s = r.sampling
        tok = r.out_ids[-1]
        if tok in s.stop_token_ids:
            r.finish_reason, r.stop_kind = "stop", "stop_token"
        elif tok in s.eos_token_ids:
            r.finish_reason, r.stop_kind = "stop", "eos"
        elif s.stop and self.tokenizer is not None and (
                hit := _find_stop_string(self.tokenizer, r.out_ids, s.stop)) is not None:
            r.finish_reason, r.stop_kind, r.stop_string = "stop", "stop_string", hit
        elif (len(r.out_ids) >= s.max_tokens
              or len(r.prompt_ids) + len(r.out_ids) >= self.model_cfg.max_model_len):
            r.finish_reason = "length"


class _WaitQueue:
    """Requests waiting for a row: lowest `sampling.priority` first, arrival order within one."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, _Request]] = []
        self._arrival = itertools.count()

    def push(self, r: _Request) -> None:
        heapq.heappush(self._heap, (r.sampling.priority, next(self._arrival), r))

    def pop(self) -> _Request:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Any:
        return (r for _, _, r in self._heap)


def _quantile(xs: deque[float], q: float) -> float:
    """The q-quantile of xs (nearest rank), 0.0 when empty."""
    if not xs:
        return 0.0
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _settle(fut: asyncio.Future[bool], value: bool | BaseException) -> None:
    if fut.done():  # an update whose caller went away still applies; nobody to tell
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def same_prompts(batch: list[_Request]) -> tuple[list[_Request], dict[int, list[_Request]]]:
    """(leaders, copies): the first request of each distinct prompt, and per leader (by id)
    the later requests with the same prompt ids. A group's members arrive together with one
    prompt: one prefill serves them all (K/V copied row to row; a prefill of a 256-row batch
    of 80-token prompts took 0.4-0.5 s of one core here, a row's copy ~90 KB on tiny:demo)."""
    leaders: list[_Request] = []
    first: dict[tuple[int, ...], _Request] = {}
    copies: dict[int, list[_Request]] = {}
    for r in batch:
        key = tuple(r.prompt_ids)
        lead = first.get(key)
        if lead is None:
            first[key] = r
            leaders.append(r)
        else:
            copies.setdefault(id(lead), []).append(r)
    return leaders, copies


def split_by_length(batch: list[_Request], slack: float = 1.5, extra: int = 32,
                    key: Callable[[_Request], int] = lambda r: len(r.prompt_ids)
                    ) -> list[list[_Request]]:
    """Sort by length (prompt length unless `key` says otherwise) and cut where the longest
    of a chunk would exceed `slack` x its shortest + `extra` tokens: one long prompt must not
    right-pad a hundred short ones to its length in a prefill."""
    chunks: list[list[_Request]] = []
    for r in sorted(batch, key=key):
        if chunks and key(r) <= slack * key(chunks[-1][0]) + extra:
            chunks[-1].append(r)
        else:
            chunks.append([r])
    return chunks


def _find_stop_string(tokenizer: Any, out_ids: list[int], stops: list[str]) -> str | None:
    longest = max(len(s) for s in stops)
    # decode enough trailing tokens to hold the longest stop string plus the newest token
    # (checked after every token, so an earlier occurrence would already have stopped us)
    tail = tokenizer.decode(out_ids[-(longest + 8) :], skip_special_tokens=False)
    return next((s for s in stops if s in tail), None)


def _faults() -> int:
    """Minor page faults of the calling thread so far (first touches of memory)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
