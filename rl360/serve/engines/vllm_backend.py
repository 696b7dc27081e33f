"""The vLLM engine backend: vLLM's async engine (AsyncLLM, V1) behind the engine contract.

- Prompts go in as token ids; each request asks for the logprob of its sampled token only
  (`logprobs=0`), and the engine runs with `logprobs_mode="processed_logprobs"`, so that
  logprob is taken under the distribution the token was sampled from (after temperature,
  top-k and top-p), as the torch backend returns it. Greedy requests get the raw logprobs.
- EOS handling is ours, not the tokenizer's: `ignore_eos` is set and the request's
  `eos_token_ids` join its stop token ids, so both backends stop on exactly the same ids.
- Weight updates never restart the engine. The engine core (where the model lives) is
  another process; RL360's worker extension (rl360.serve.engines.vllm_worker) is mixed into
  vLLM's worker, and `collective_rpc("rl360_load_weights", state)` hands it the name ->
  tensor dict, which the model's own `load_weights` maps onto vLLM's fused parameters. As in
  the torch backend a sequence never mixes versions: an update closes the gate for new
  requests, waits for the running ones, pauses the engine's scheduler (clearing the prefix
  cache, which holds KV computed with the old weights), loads, bumps the version and
  resumes.
- Adapter versions (`trainer.lora`, an AdapterUpdate): the engine starts with vLLM's LoRA
  support on (rl360.serve.engines.support.adapter_options: enable_lora, max_lora_rank,
  max_loras = 1), keeps its base weights, and loads each version through vLLM's LoRA API: the
  adapter is written as a peft directory (rl360.policies.lora.save_adapter) and reloaded in
  place under one adapter id (`add_lora` with `load_inplace`), inside the same drain, pause and
  prefix-cache reset as a full version; every request from then on carries that adapter.

vLLM is imported only here (and only when this backend is built). Code that builds this
backend in a plain script must do so under `if __name__ == "__main__":`: the engine core is
started with multiprocessing spawn.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rl360.policies.loading import resolve_model_path
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.base import check_prompt
from rl360.serve.engines.vllm_worker import pack_state
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import AdapterUpdate, TensorUpdate, WeightUpdate, refuse
from rl360.weights.plan import update_checksums
from rl360.weights.receiver import Intake, WeightChecksums

log = logging.getLogger("rl360.engine.vllm")

WORKER_EXTENSION = "rl360.serve.engines.vllm_worker.RL360WeightLoader"

# engine.options keys that are ours; every other key goes to vLLM's AsyncEngineArgs
_OWN_OPTIONS = {"kv_cache_gb", "omp_threads_bind"}


def engine_args(engine: EngineSection, model: ModelSection, seed: int,
                model_path: str) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments for the recipe's sections (engine.options may
    override any of them)."""
    args: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "max_num_seqs": engine.max_batch_size,
        "seed": seed,
        "tensor_parallel_size": engine.tensor_parallel,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "enforce_eager": True,  # no compile step: start-up in seconds on a CPU
        "disable_log_stats": True,
        "enable_prefix_caching": True,
    }
    args.update({k: v for k, v in engine.options.items() if k not in _OWN_OPTIONS})
    return args


def to_vllm_sampling(sp: SamplingParams, max_model_len: int, prompt_len: int) -> Any:
    """vLLM SamplingParams for ours: sampled-token logprobs, our stop ids, no tokenizer EOS."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    if sp.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sp.max_tokens}")
    greedy = sp.temperature <= 0.0
    return VSamplingParams(
        temperature=0.0 if greedy else sp.temperature,
        top_p=1.0 if greedy else sp.top_p,
        top_k=0 if greedy or sp.top_k <= 0 else sp.top_k,
        max_tokens=max(1, min(sp.max_tokens, max_model_len - prompt_len)),
        stop=list(sp.stop) or None,
        stop_token_ids=sorted(set(sp.stop_token_ids) | set(sp.eos_token_ids)) or None,
        include_stop_str_in_output=True,
        ignore_eos=True,
        seed=sp.seed,
        logprobs=0,  # the sampled token's own logprob only
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def to_generation(out: Any, sp: SamplingParams, version: int) -> Generation:
    """Our Generation from vLLM's final CompletionOutput."""
    token_ids = list(out.token_ids)
    if out.logprobs is None or len(out.logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token logprobs (was logprobs=0 dropped?)")
    logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, token_ids, strict=True)]
    finish = out.finish_reason or "length"
    stop_kind, stop_string = "", None
    if finish == "stop":
        if isinstance(out.stop_reason, str):
            stop_kind, stop_string = "stop_string", out.stop_reason
        elif token_ids and token_ids[-1] in sp.stop_token_ids:
            stop_kind = "stop_token"
        elif token_ids and token_ids[-1] in sp.eos_token_ids:
            stop_kind = "eos"
        else:
            stop_kind = "stop_token"
    elif finish not in ("length", "abort"):
        raise RuntimeError(f"vLLM finished a request with {finish!r} (stop reason {out.stop_reason!r})")
    return Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish,  # type: ignore[arg-type]
        policy_version=version,
        token_versions=[version] * len(token_ids),
        stop_kind=stop_kind,
        stop_string=stop_string,
    )


class VLLMBackend:
    def __init__(self, engine: EngineSection, model: ModelSection, seed: int = 0) -> None:

        self.engine_cfg, self.model_cfg, self.seed = engine, model, seed
        self.model_path = str(resolve_model_path(model.path))
        opts = engine.options
        # read by vLLM's CPU platform in the engine-core process, which inherits our env
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(opts.get("kv_cache_gb", 1))))
        if "omp_threads_bind" in opts:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(opts["omp_threads_bind"])
        self._engine: Any = None
        self._start_lock: asyncio.Lock | None = None
        self._version = 0
        self._open: asyncio.Event | None = None  # cleared while paused or updating
        self._paused = False
        self._in_flight = 0
        self._drained: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._failure: BaseException | None = None
        self._hf_shapes: dict[str, tuple[int, ...]] | None = None
        self._lora: Any = None  # the LoRARequest every request carries once an adapter is in
        self._lora_dir: str | None = None  # where adapter versions are written for vLLM
        self._stats = {"requests": 0, "tokens": 0, "busy_s": 0.0, "updates": 0}
        self._started = time.monotonic()

    # ------------------------------------------------------------------ contract

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        check_prompt(prompt_ids, self.model_cfg.max_model_len)
        engine = await self._ensure_started()
        assert self._open is not None and self._drained is not None
        from vllm.inputs import TokensPrompt

        params = to_vllm_sampling(sampling, self.model_cfg.max_model_len, len(prompt_ids))
        while not self._open.is_set():  # paused, or a weight update is loading
            await self._open.wait()
        self._in_flight += 1
        self._drained.clear()
        version = self._version
        t0 = time.perf_counter()
        try:
            final = None
            # FINAL_ONLY: one RequestOutput, when the request finishes
            async for out in engine.generate(
                TokensPrompt(prompt_token_ids=list(prompt_ids)), params, uuid.uuid4().hex,
                lora_request=self._lora,
            ):
                final = out
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()
        if final is None or not final.outputs:
            raise RuntimeError("vLLM finished a request without output")
        gen = to_generation(final.outputs[0], sampling, version)
        self._stats["requests"] += 1
        self._stats["tokens"] += len(gen.token_ids)
        self._stats["busy_s"] += time.perf_counter() - t0
        return gen

    def weight_intake(self) -> Intake:
        return Intake()  # versions as tensors, loaded by the workers (vllm_worker)

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        if isinstance(update, AdapterUpdate):
            return await self._update_adapter(version, update)
        if not isinstance(update, TensorUpdate):
            raise refuse("vllm", update, "tensor (name -> tensor) or adapter")
        state = update.tensors
        engine = await self._ensure_started()
        assert self._update_lock is not None and self._open is not None
        assert self._drained is not None
        async with self._update_lock:
            if version <= self._version:
                log.warning(
                    "ignoring weight update to version %d: this replica already serves %d",
                    version,
                    self._version,
                )
                return False
            self._check_state(state)
            t0 = time.perf_counter()
            self._open.clear()  # new requests wait; running ones finish on the old weights
            try:
                await self._drained.wait()
                await engine.pause_generation(mode="wait", clear_cache=True)
                try:
                    payload = await asyncio.to_thread(pack_state, state)
                    await engine.collective_rpc("rl360_load_weights", args=(payload,))
                    self._version = version
                finally:
                    await engine.resume_generation()
            finally:
                if not self._paused:
                    self._open.set()
            self._stats["updates"] += 1
            log.info("weights -> version %d in %.3fs", version, time.perf_counter() - t0)
            return True

    async def _update_adapter(self, version: int, update: AdapterUpdate) -> bool:
        """Load an adapter version through vLLM's LoRA API (see the module docstring)."""
        if not self.engine_cfg.options.get("enable_lora"):
            raise ValueError("the vLLM engine was started without LoRA support: adapter "
                             "versions need engine.options enable_lora and max_lora_rank "
                             "(rl360 train sets them from trainer.lora)")
        from vllm.lora.request import LoRARequest

        engine = await self._ensure_started()
        assert self._update_lock is not None and self._open is not None
        assert self._drained is not None
        async with self._update_lock:
            if version <= self._version:
                log.warning("ignoring adapter version %d: this replica already serves %d",
                            version, self._version)
                return False
            t0 = time.perf_counter()
            path = await asyncio.to_thread(self._write_adapter, version, update)
            request = LoRARequest("rl360", 1, path, load_inplace=True)
            self._open.clear()  # new requests wait; running ones finish on the old adapter
            try:
                await self._drained.wait()
                await engine.pause_generation(mode="wait", clear_cache=True)
                try:
                    if not await engine.add_lora(request):
                        raise RuntimeError(f"vLLM did not load adapter version {version}")
                    old, self._lora = self._lora, request
                    self._version = version
                finally:
                    await engine.resume_generation()
            finally:
                if not self._paused:
                    self._open.set()
            if old is not None and old.lora_path != path:
                await asyncio.to_thread(shutil.rmtree, old.lora_path, True)
            self._stats["updates"] += 1
            log.info("adapter -> version %d in %.3fs", version, time.perf_counter() - t0)
            return True

    def _write_adapter(self, version: int, update: AdapterUpdate) -> str:
        from rl360.policies.lora import LoraSpec, save_adapter

        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="rl360-vllm-lora-")
        spec = LoraSpec(rank=update.rank, alpha=update.alpha, targets=tuple(update.targets))
        out = Path(self._lora_dir) / f"v{version}"
        save_adapter(out, update.tensors, spec, self.model_path)
        return str(out)

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        return await asyncio.to_thread(update_checksums, names, update)

    async def pause(self) -> None:
        await self._ensure_started()
        assert self._open is not None
        self._paused = True
        self._open.clear()

    async def resume(self) -> None:
        await self._ensure_started()
        assert self._open is not None and self._update_lock is not None
        self._paused = False
        if not self._update_lock.locked():
            self._open.set()

    def health(self) -> dict[str, Any]:
        engine = self._engine
        error = self._failure
        if error is None and engine is not None and engine.errored:
            error = engine.dead_error
        return {
            "ok": error is None,
            "error": repr(error) if error else None,
            "version": self._version,
            "paused": self._paused,
            "running": self._in_flight,
            "uptime_s": time.monotonic() - self._started,
            **self._stats,
        }

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
        if engine is not None:
            # (something inside vLLM keeps the AsyncLLM alive until interpreter exit, where its
            # __del__ repeats shutdown and prints an ignored TypeError: harmless noise)
            engine.shutdown()

    # ------------------------------------------------------------------ helpers

    async def _ensure_started(self) -> Any:
        if self._engine is not None:
            return self._engine
        if self._failure is not None:
            raise RuntimeError(f"vLLM engine failed to start earlier: {self._failure!r}")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._engine is None:
                try:
                    # start-up takes a while (three processes import vLLM): off the event
                    # loop, so a Serve replica keeps answering its health checks meanwhile
                    self._engine = await asyncio.to_thread(self._start_engine)
                except Exception as exc:
                    self._failure = exc
                    raise
                self._open = asyncio.Event()
                self._open.set()
                self._drained = asyncio.Event()
                self._drained.set()
                self._update_lock = asyncio.Lock()
        return self._engine

    def _start_engine(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args(self.engine_cfg, self.model_cfg, self.seed, self.model_path))
        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(args)
        log.info("vLLM engine for %s up in %.1fs", self.model_path, time.perf_counter() - t0)
        return engine

    def _check_state(self, state: dict[str, Any]) -> None:
        """Names and shapes against the model's HF checkpoint, as the torch backend checks
        them against its module: vLLM's load_weights would skip a stray name silently."""
        if self._hf_shapes is None:
            self._hf_shapes = checkpoint_shapes(self.model_path)
        unknown = [k for k in state if k not in self._hf_shapes]
        if unknown:
            raise ValueError(f"weight update has tensors the model lacks: {unknown[:5]}")
        # vLLM reloads layer by layer into fused parameters: a layer given only some of its
        # tensors (q_proj without k_proj/v_proj) would keep garbage in the rest
        missing = [k for k in self._hf_shapes if k not in state and k != "lm_head.weight"]
        if missing:
            raise ValueError(
                f"the vLLM backend takes whole state dicts; this update lacks {len(missing)} "
                f"tensors, e.g. {missing[:3]}"
            )
        for k, v in state.items():
            if tuple(v.shape) != self._hf_shapes[k]:
                raise ValueError(
                    f"weight update {k}: shape {tuple(v.shape)} != {self._hf_shapes[k]}"
                )


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in an HF directory's safetensors files."""

    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files to check updates against")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    # tied embeddings: the trainer's state dict carries lm_head.weight, the file may not
    if "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes
