"""The reference engine backend: any HF causal LM in plain torch.

Requests that arrive together are batched by a small micro-batcher (one named background
task): it waits up to `batch_wait_ms` for more requests, left-pads the prompts and decodes
them together with a KV cache, dropping rows from the batch as they finish. Weights change
only between batches, under the same lock that a batch holds, so a sequence never mixes
versions. The returned logprob of each token is its log-probability under the distribution
it was sampled from (after temperature, top-k and top-p; the raw distribution for greedy).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rl360.policies.devices import place_for_generation, select_device
from rl360.policies.loading import resolve_model_path
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.types import Generation, SamplingParams

log = logging.getLogger("rl360.engine.torch")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future[Generation]
    generator: torch.Generator | None = None
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    stop_kind: str = ""
    stop_string: str | None = None


def load_causal_lm(model: str, dtype: str, num_gpus: float = 0.0) -> tuple[Any, Any]:
    """The model (on the reserved GPU when num_gpus > 0, see rl360.policies.devices) and
    its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = select_device(num_gpus, dtype, gpus_key="engine.num_gpus", dtype_key="model.dtype")
    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
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
        if engine.threads > 0:
            torch.set_num_threads(engine.threads)
        self.engine_cfg, self.model_cfg = engine, model_cfg
        if model is None:
            model, tokenizer = load_causal_lm(model_cfg.path, model_cfg.dtype, engine.num_gpus)
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = _pad_id(model, tokenizer)
        # transformers renamed the KV-cache argument (past_key_values -> cache)

        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._version = 0
        self._queue: asyncio.Queue[_Request] | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        self._running: asyncio.Event | None = None
        self._rng = random.Random(seed)
        self._failure: BaseException | None = None
        self._stats = {"batches": 0, "requests": 0, "tokens": 0, "busy_s": 0.0, "updates": 0}
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
        assert self._queue is not None
        fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(list(prompt_ids), sampling, fut))
        return await fut

    async def update_weights(self, version: int, state: Any) -> bool:
        self._ensure_started()
        assert self._lock is not None
        if hasattr(state, "__await__") and not isinstance(state, dict):
            state = await state  # a Ray ObjectRef
        async with self._lock:  # between batches, never inside one
            if version <= self._version:
                log.warning(
                    "ignoring weight update to version %d: this replica already serves %d",
                    version,
                    self._version,
                )
                return False
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self._executor, self._load_state, state)
            self._version = version
            self._stats["updates"] += 1
            log.info("weights -> version %d in %.3fs", version, time.perf_counter() - t0)
            return True

    async def pause(self) -> None:
        self._ensure_started()
        assert self._running is not None
        self._running.clear()

    async def resume(self) -> None:
        self._ensure_started()
        assert self._running is not None
        self._running.set()

    def health(self) -> dict[str, Any]:
        return {
            "ok": self._failure is None,
            "error": repr(self._failure) if self._failure else None,
            "version": self._version,
            "paused": self._running is not None and not self._running.is_set(),
            "queued": self._queue.qsize() if self._queue is not None else 0,
            "uptime_s": time.monotonic() - self._started,
            "torch_threads": torch.get_num_threads(),
            **self._stats,
        }

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ batching

    def _ensure_started(self) -> None:
        if self._task is not None and not self._task.done():
            return
        if self._failure is not None:
            raise RuntimeError(f"engine batch loop failed earlier: {self._failure!r}")
        self._queue = self._queue or asyncio.Queue()
        self._lock = self._lock or asyncio.Lock()
        if self._running is None:
            self._running = asyncio.Event()
            self._running.set()
        self._task = asyncio.get_running_loop().create_task(
            self._batch_loop(), name="rl360-torch-engine-batcher"
        )
        self._task.add_done_callback(self._on_loop_done)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._failure = exc
            log.error("engine batch loop died: %r", exc)

    async def _batch_loop(self) -> None:
        assert self._queue is not None and self._lock is not None and self._running is not None
        wait_s = self.engine_cfg.batch_wait_ms / 1000.0
        while True:
            first = await self._queue.get()
            batch = [first]
            deadline = time.monotonic() + wait_s
            while len(batch) < self.engine_cfg.max_batch_size:
                timeout = deadline - time.monotonic()
                if timeout <= 0 and self._queue.empty():
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(timeout, 0)))
                except TimeoutError:
                    break
            await self._running.wait()
            async with self._lock:
                version = self._version
                t0 = time.perf_counter()
                try:
                    # similar prompt lengths together: one long prompt must not left-pad a
                    # hundred short ones to its length (memory and time grow with the pad)
                    for chunk in split_by_length(batch):
                        await asyncio.get_running_loop().run_in_executor(
                            self._executor, self._generate_batch, chunk
                        )
                except Exception as exc:  # a bad batch fails its requests, not the loop
                    log.exception("generation failed for a batch of %d", len(batch))
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                self._stats["busy_s"] += time.perf_counter() - t0
            self._stats["batches"] += 1
            for r in batch:
                self._stats["requests"] += 1
                self._stats["tokens"] += len(r.out_ids)
                if r.future.done():  # the caller went away
                    continue
                r.future.set_result(
                    Generation(
                        token_ids=r.out_ids,
                        logprobs=r.out_logprobs,
                        finish_reason=r.finish_reason,  # type: ignore[arg-type]
                        policy_version=version,
                        token_versions=[version] * len(r.out_ids),
                        stop_kind=r.stop_kind,
                        stop_string=r.stop_string,
                    )
                )

    # ------------------------------------------------------------------ model work (thread)

    def _load_state(self, state: dict[str, Any]) -> None:
        own = self.model.state_dict()
        unknown = [k for k in state if k not in own]
        if unknown:
            raise ValueError(f"weight update has tensors the model lacks: {unknown[:5]}")
        for k, v in state.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"weight update {k}: shape {tuple(v.shape)} != {tuple(own[k].shape)}")
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(torch.as_tensor(v).to(own[k].dtype))

    @torch.no_grad()
    def _generate_batch(self, batch: list[_Request]) -> None:
        from transformers import DynamicCache

        for r in batch:
            seed = r.sampling.seed if r.sampling.seed is not None else self._rng.getrandbits(62)
            r.generator = torch.Generator().manual_seed(seed)
        lens = [len(r.prompt_ids) for r in batch]
        width = max(lens)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - lens[i] :] = torch.tensor(r.prompt_ids)
            attn[i, width - lens[i] :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
            **{self._cache_kw: cache},
        )
        logits = out.logits[:, -1, :].float()
        active = list(range(len(batch)))  # row i of the live tensors -> batch index
        next_pos = pos[:, -1] + 1
        while True:
            next_tokens = []
            keep = []
            for row, bi in enumerate(active):
                r = batch[bi]
                tok, lp = _sample(logits[row], r.sampling, r.generator)
                r.out_ids.append(tok)
                r.out_logprobs.append(lp)
                if not self._finished(r, lens[bi]):
                    keep.append(row)
                    next_tokens.append(tok)
            if not keep:
                return
            if len(keep) < len(active):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                attn = attn[idx]
                next_pos = next_pos[idx]
                active = [active[k] for k in keep]
            attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype)], dim=1)
            out = self.model(
                input_ids=torch.tensor(next_tokens).unsqueeze(1),
                attention_mask=attn,
                position_ids=next_pos.unsqueeze(1),
                use_cache=True,
                **{self._cache_kw: cache},
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :].float()

    def _finished(self, r: _Request, prompt_len: int) -> bool:
        s = r.sampling
        tok = r.out_ids[-1]
        if tok in s.stop_token_ids:
            r.finish_reason, r.stop_kind = "stop", "stop_token"
            return True
        if tok in s.eos_token_ids:
            r.finish_reason, r.stop_kind = "stop", "eos"
            return True
        if s.stop and self.tokenizer is not None:
            hit = _find_stop_string(self.tokenizer, r.out_ids, s.stop)
            if hit is not None:
                r.finish_reason, r.stop_kind, r.stop_string = "stop", "stop_string", hit
                return True
        if len(r.out_ids) >= s.max_tokens or prompt_len + len(r.out_ids) >= self.model_cfg.max_model_len:
            r.finish_reason = "length"
            return True
        return False


def split_by_length(batch: list[_Request], slack: float = 1.5, extra: int = 32) -> list[list[_Request]]:
    """Sort by prompt length and cut where the longest prompt of a chunk would exceed
    `slack` x its shortest + `extra` tokens."""
    chunks: list[list[_Request]] = []
    for r in sorted(batch, key=lambda r: len(r.prompt_ids)):
        if chunks and len(r.prompt_ids) <= slack * len(chunks[-1][0].prompt_ids) + extra:
            chunks[-1].append(r)
        else:
            chunks.append([r])
    return chunks


def _sample(
    logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None
) -> tuple[int, float]:
    if sp.temperature <= 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    logp = processed_logprobs(logits, sp)
    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
    return tok, float(logp[tok])


def processed_logprobs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Logprobs of the distribution a token is sampled from (temperature > 0): temperature,
    then top-k, then top-p (the token that crosses p is kept)."""
    scaled = logits / sp.temperature
    if sp.top_k and 0 < sp.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sp.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= sp.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    return torch.log_softmax(scaled, dim=-1)


def _find_stop_string(tokenizer: Any, out_ids: list[int], stops: list[str]) -> str | None:
    longest = max(len(s) for s in stops)
    # decode enough trailing tokens to hold the longest stop string plus the newest token
    # (checked after every token, so an earlier occurrence would already have stopped us)
    tail = tokenizer.decode(out_ids[-(longest + 8) :], skip_special_tokens=False)
    return next((s for s in stops if s in tail), None)


def _pad_id(model: Any, tokenizer: Any) -> int:
    for cand in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model.config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(cand, int):
            return cand
    return 0
