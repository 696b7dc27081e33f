"""The torch engine's scheduler (rl360.serve.engines.torch_backend): the engine loop on the
event loop, the waiting queue and admission, weight swaps between steps with their pauses
measured, and the model work on the engine's one thread (prefill of admitted rows, decode
steps, sampling, finished rows). `Scheduler` is a part of TorchBackend, which holds the model,
the KV runner, the prefix cache and the state this works on."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.prefix_cache import PrefixCache
from rl360.serve.engines.sampling import sample_rows
from rl360.serve.engines.torch_adapter import EngineAdapter
from rl360.serve.engines.torch_model import LlamaRunner
from rl360.serve.engines.torch_requests import (
    Request,
    Update,
    WaitQueue,
    faults,
    find_stop_string,
    same_prompts,
    settle,
    split_by_length,
)
from rl360.types import Generation
from rl360.weights.packing import apply_packed, own_weights
from rl360.weights.payloads import AdapterUpdate, PackedUpdate

log = logging.getLogger("rl360.engine.torch")
MAX_BURST = 64  # decode steps the engine thread may run before handing back to the loop


class Scheduler:
    """The engine loop and the steps it runs, over the state TorchBackend sets up."""

    engine_cfg: EngineSection
    model_cfg: ModelSection
    weight_update: str
    model: Any
    tokenizer: Any
    runner: LlamaRunner
    adapter: EngineAdapter
    prefix: PrefixCache
    _version: int
    _waiting: WaitQueue
    _rows: list[Request]
    _updates: deque[Update]
    _loop: asyncio.AbstractEventLoop | None
    _fatal: BaseException | None
    _wake: asyncio.Event | None
    _task: asyncio.Task[None] | None
    _paused: bool
    _interrupt: bool
    _rng: random.Random
    _failure: BaseException | None
    _stats: dict[str, Any]
    step_times: deque[float]
    sync_log: deque[dict[str, float]]
    step_changes: deque[float]
    _last_plain: tuple[int, float] | None
    _step_end: float
    swap_overs: deque[float]
    _executor: ThreadPoolExecutor

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

    def _admit(self) -> list[Request]:
        blocked = self._paused or (self._updates and self.weight_update == "drain")
        admit: list[Request] = []
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
            t0, c0, f0 = time.perf_counter(), time.thread_time(), faults()
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
            self._stats["last_swap_faults"] = faults() - f0
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
        self._loop.call_soon_threadsafe(settle, fut, value)

    def _record_pause(self, before: dict[int, tuple[float, int]], swap: float, wait: float,
                      step_before: float, step_s: float, done: list[Request],
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

    def _finish(self, r: Request) -> None:
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

    def _steps(self, gone: list[int], admit: list[Request]) -> list[Request]:
        """One step, then more decode steps on the same thread while nothing needs the loop:
        no row finished and no request or cancellation arrived (each sets `_interrupt`; an
        in-flight weight update does not: the next step applies it). Saves two thread
        hand-offs per token on a busy CPU. Returns the finished rows."""
        done = self._timed_step(gone, admit)
        n = 1
        while not done and self._rows and not self._interrupt and n < MAX_BURST:
            done = self._timed_step([], [])
            n += 1
        return done

    def _timed_step(self, gone: list[int], admit: list[Request]) -> list[Request]:
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

    def _one_step(self, gone: list[int], admit: list[Request]) -> list[Request]:
        rows = len(self._rows)
        t0, c0, f0 = time.perf_counter(), time.thread_time(), faults()
        done = self._step(gone, admit, self._version)
        dt = time.perf_counter() - t0
        self._stats["busy_s"] += dt
        self._stats["last_step_s"] = dt
        self._stats["last_step_cpu_s"] = time.thread_time() - c0
        self._stats["last_step_faults"] = faults() - f0
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
    def _step(self, gone: list[int], admit: list[Request], version: int) -> list[Request]:
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

    def _sample_into(self, rows: list[Request], logits: torch.Tensor, version: int) -> None:
        picks = sample_rows(logits, [r.sampling for r in rows], [r.generator for r in rows])
        now = time.perf_counter()
        for r, (tok, lp) in zip(rows, picks, strict=True):
            r.out_ids.append(tok)
            r.out_logprobs.append(lp)
            r.out_versions.append(version)
            r.t_last = now
            self._check_finished(r)

    def _check_finished(self, r: Request) -> None:
        s = r.sampling
        tok = r.out_ids[-1]
        if tok in s.stop_token_ids:
            r.finish_reason, r.stop_kind = "stop", "stop_token"
        elif tok in s.eos_token_ids:
            r.finish_reason, r.stop_kind = "stop", "eos"
        elif s.stop and self.tokenizer is not None and (
                hit := find_stop_string(self.tokenizer, r.out_ids, s.stop)) is not None:
            r.finish_reason, r.stop_kind, r.stop_string = "stop", "stop_string", hit
        elif (len(r.out_ids) >= s.max_tokens
              or len(r.prompt_ids) + len(r.out_ids) >= self.model_cfg.max_model_len):
            r.finish_reason = "length"
