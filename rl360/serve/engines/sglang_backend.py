"""The SGLang engine backend: `sglang.Engine` (or an SGLang server over HTTP) behind the
engine contract (rl360.serve.engines.base.EngineBackend).

- Prompts go in as token ids (`input_ids`) with `return_logprob=True`; the generated ids and
  their logprobs come from `meta_info["output_token_logprobs"]` ((logprob, id, text) per
  token), which holds every generated token including the one that stopped generation. With
  `no_stop_trim` nothing is cut from the output.
- Logprobs: greedy requests get the raw log-softmax (as the torch backend). Sampled requests get
  SGLang's default: the log-probability after temperature (do not set
  SGLANG_RETURN_ORIGINAL_LOGPROB, which returns pre-temperature values). With top-k/top-p the
  value SGLang reports is, depending on the version, before the truncation's renormalisation;
  parity with the torch backend is exact only for greedy and pure-temperature sampling.
- Stops: `stop` strings and `stop_token_ids` are SGLang's own; the request's `eos_token_ids`
  join the stop token ids. SGLang also stops on the model's own EOS (ignore_eos would disable
  stop_token_ids too), so a request with no eos_token_ids still ends at the model's EOS.
- Seeds: `seed` goes to SGLang's `sampling_seed` (options: seed_param; "" drops seeds).
- Weights, always through SGLang's own paths: a name -> tensor dict (object-store transport)
  via `update_weights_from_tensor`; a CUDA-IPC payload from a trainer on the same GPU
  (IpcUpdate) via the same call, pre-serialized; a collective update (CollectiveUpdate: NCCL
  group from trainer rank 0) via `init_weights_update_group` once and
  `update_weights_from_distributed` per bucket.
- Adapter versions (`trainer.lora`, an AdapterUpdate): SGLang starts with LoRA on
  (rl360.serve.engines.support.adapter_options: enable_lora, max_lora_rank,
  lora_target_modules, max_loras_per_batch) and keeps its base weights; each version is written
  as a peft directory and loaded under a name of its own (`load_lora_adapter`), new requests
  carry that name (`lora_path`) from then on, and the previous adapter is unloaded
  (`unload_lora_adapter`) once the last request that started with it has finished. No pause:
  a running request keeps the adapter it started with, so its tokens have one version.
- Around an update (options.pause_mode): "retract" (default) closes our gate to new requests,
  has SGLang's scheduler pause and put the running requests back in its queue
  (`pause_generation` mode=retract), applies the weights, flushes the prefix cache and
  continues (`continue_generation`): in-flight requests are kept and their KV is recomputed
  under the new weights. "in_place" keeps them paused with their KV cache (computed by the
  old weights; the cache is not flushed, SGLang refuses to while requests run). "abort" ends
  them (finish_reason "abort"). "drain" is SGLang-agnostic: wait until running requests
  finish (VersionGate), so a sequence never spans two versions. With retract / in_place a
  sequence may span versions: it is returned with `mixed_versions`, `policy_version` = the
  version at its end and `token_versions` = the version it started under for every token
  (SGLang's answer does not say which tokens came after the swap; the oldest version is
  what staleness filtering needs).
- Cancelled requests (an episode cancelled by the controller, a client gone) are aborted in
  SGLang by request id (`abort_request`), so they stop holding batch slots and KV cache.
- Health: `probe()` (called by the replica's Serve health check) runs SGLang's own generation
  probe (`/health_generate`; a 1-token generation in engine mode) when no generation finished
  in the last probe_idle_s seconds and no update or pause is under way.
- Expert parallel: `ep_size` = engine.expert_parallel (inside the tensor-parallel group).

HTTP mode: the replica still needs sglang importable for object-store updates (its serializer
packs the CUDA-IPC handles), and the server must run on the GPU this replica sees; with a
server elsewhere use the collective transport (the server joins the NCCL group itself).

engine.options: our keys are in _OWN_OPTIONS; every other key is an SGLang ServerArgs
keyword (e.g. mem_fraction_static, tp_size, chunked_prefill_size), passed as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rl360.policies.loading import resolve_model_path
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines import sglang_client as sc
from rl360.serve.engines.base import BackendUnavailable
from rl360.serve.engines.gate import VersionGate
from rl360.serve.engines.sglang_client import check_result
from rl360.serve.engines.sglang_mapping import (
    SGLangOptions,
    engine_kwargs,
    serialize_named_tensors,
    sglang_installed,
    split_options,
    to_generation,
    to_sglang_sampling,
)
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import (
    AdapterUpdate,
    CollectiveUpdate,
    IpcUpdate,
    TensorUpdate,
    WeightUpdate,
    refuse,
)
from rl360.weights.plan import plan_buckets, tensor_checksum
from rl360.weights.receiver import Intake, WeightChecksums

__all__ = ["SGLangBackend", "SGLangOptions", "engine_kwargs", "sglang_installed",
           "split_options", "to_generation", "to_sglang_sampling"]

log = logging.getLogger("rl360.engine.sglang")

class SGLangBackend:
    def __init__(self, engine: EngineSection, model: ModelSection, seed: int = 0) -> None:

        self.engine_cfg, self.model_cfg = engine, model
        self.options, extra = split_options(engine.options)
        if not (self.options.mode == "http" and self.options.url) and not sglang_installed():
            raise BackendUnavailable(
                "engine backend 'sglang' needs the sglang package (pip install 'rl360[sglang]' "
                "on a GPU machine), or options mode='http' with the url of a running server")
        self.tp = int(extra.get("tp_size", engine.tensor_parallel))
        self.model_path = str(resolve_model_path(model.path))
        self._kwargs = engine_kwargs(engine, model, seed, self.model_path)
        self._client: Any = None
        self._starting: asyncio.Lock | None = None
        self._gate = VersionGate(0)
        self._groups: set[str] = set()
        self._failure: BaseException | None = None
        self._stats = {"requests": 0, "tokens": 0, "busy_s": 0.0, "updates": 0, "aborts": 0,
                       "mixed": 0, "probes": 0}
        self._started = time.monotonic()
        self._last_done = 0.0  # monotonic time the last generation finished
        self._aborts: set[asyncio.Task[None]] = set()
        self._adapter: str | None = None  # the adapter new requests carry (its loaded name)
        self._adapter_users: dict[str, int] = {}  # adapter name -> requests running with it
        self._adapter_dir: str | None = None
        self._adapters_on = False  # versions are adapters (the base weights never change)

    # ------------------------------------------------------------------ contract

    @property
    def version(self) -> int:
        return self._gate.version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) >= self.model_cfg.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit max_model_len "
                             f"{self.model_cfg.max_model_len}")
        payload = to_sglang_sampling(sampling, self.options.seed_param,
                                     room=self.model_cfg.max_model_len - len(prompt_ids))
        client = await self._ensure_client()
        rid = uuid.uuid4().hex
        async with self._gate.reading() as version:
            adapter = self._adapter
            if adapter is not None:
                self._adapter_users[adapter] = self._adapter_users.get(adapter, 0) + 1
            t0 = time.perf_counter()
            try:
                ret = await client.generate(list(prompt_ids), payload, rid, adapter)
            except asyncio.CancelledError:
                self._abort_soon(client, rid)
                raise
            finally:
                self._stats["busy_s"] += time.perf_counter() - t0
                if adapter is not None:
                    self._release_adapter(client, adapter)
            # with adapter versions the weights never change under a request (each keeps the
            # adapter, or the base, it started with); full ones may (retract / in_place)
            end_version = version if self._adapters_on else self._gate.version
        self._last_done = time.monotonic()
        gen = to_generation(ret, sampling, version)
        if end_version != version:  # swapped under it (retract / in_place)
            gen.mixed_versions = True
            gen.policy_version = end_version
            self._stats["mixed"] += 1
        self._stats["requests"] += 1
        self._stats["tokens"] += len(gen.token_ids)
        return gen

    def _abort_soon(self, client: Any, rid: str) -> None:
        """Abort request `rid` in SGLang, in a task of its own: the caller is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._abort(client, rid),
                                                      name=f"rl360-sglang-abort-{rid[:8]}")
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, client: Any, rid: str) -> None:
        try:
            await client.abort(rid)
            self._stats["aborts"] += 1
        except Exception as exc:  # the request may have finished meanwhile
            log.warning("sglang abort_request %s failed: %r", rid, exc)

    async def probe(self) -> None:
        """A generation probe for the replica's health check (see the module docstring)."""
        if self._client is None or self._gate.paused or self._gate.updating:
            return
        if time.monotonic() - self._last_done < self.options.probe_idle_s:
            return
        try:
            await asyncio.wait_for(self._client.probe(), self.options.probe_timeout_s)
        except TimeoutError:
            raise RuntimeError(f"sglang generation probe: no answer in "
                               f"{self.options.probe_timeout_s:g}s") from None
        except Exception as exc:
            raise RuntimeError(f"sglang generation probe failed: {exc!r}") from exc
        self._last_done = time.monotonic()
        self._stats["probes"] += 1

    @contextlib.asynccontextmanager
    async def _updating(self, client: Any) -> AsyncIterator[None]:
        """Around a weight update: drain (wait for running requests) or SGLang's own pause."""
        mode = self.options.pause_mode
        if mode == "drain":
            async with self._gate.writing():
                yield
            return
        async with self._gate.swapping():
            check_result(await client.pause(mode), f"pause_generation (mode={mode})")
            try:
                yield
            finally:
                check_result(await client.resume(), "continue_generation")

    def weight_intake(self) -> Intake:
        # its tensor-parallel workers join the sender's group themselves
        return Intake(own_group=True, group_width=self.tp)

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        if isinstance(update, AdapterUpdate):
            return await self._update_adapter(version, update)
        if not isinstance(update, CollectiveUpdate | IpcUpdate | TensorUpdate):
            raise refuse("sglang", update, "collective, ipc, tensor or adapter")
        client = await self._ensure_client()
        flush = self.options.pause_mode != "in_place"  # SGLang cannot flush paused requests
        async with self._updating(client):
            newer = version > self._gate.version
            if not newer and not isinstance(update, CollectiveUpdate):
                log.warning("ignoring weight update to version %d: this replica serves %d",
                            version, self._gate.version)
                return False
            t0 = time.perf_counter()
            if isinstance(update, CollectiveUpdate):
                # the sender is broadcasting now: receive even a stale version, or it hangs
                await self._receive_collective(client, update, flush)
            elif isinstance(update, IpcUpdate):
                check_result(await client.update_from_tensor(update.serialized_per_rank, flush),
                             "update_weights_from_tensor (CUDA IPC)")
            else:
                await self._apply_dict(client, update.tensors, flush)
            if not newer:
                log.warning("received collective version %d but serve %d: kept the version",
                            version, self._gate.version)
                return False
            self._gate.version = version
            self._stats["updates"] += 1
            log.info("weights -> version %d in %.3fs", version, time.perf_counter() - t0)
            return True

    async def _update_adapter(self, version: int, update: AdapterUpdate) -> bool:
        """Load an adapter version under its own name; new requests use it from now on."""
        if not self._kwargs.get("enable_lora") and self.options.mode != "http":
            raise ValueError("SGLang was started without LoRA support: adapter versions need "
                             "engine.options enable_lora, max_lora_rank and lora_target_modules "
                             "(rl360 train sets them from trainer.lora)")
        if version <= self._gate.version:
            log.warning("ignoring adapter version %d: this replica serves %d", version,
                        self._gate.version)
            return False
        client = await self._ensure_client()
        t0 = time.perf_counter()
        path = await asyncio.to_thread(self._write_adapter, version, update)
        name = f"rl360-v{version}"
        check_result(await client.load_lora(name, path), f"load_lora_adapter ({name})")
        old, self._adapter = self._adapter, name
        self._adapters_on = True
        self._gate.version = version  # requests admitted from here on carry `name`
        if old is not None and not self._adapter_users.get(old):
            await self._unload_adapter(client, old)
        self._stats["updates"] += 1
        log.info("adapter -> version %d in %.3fs", version, time.perf_counter() - t0)
        return True

    def _write_adapter(self, version: int, update: AdapterUpdate) -> str:
        import tempfile
        from pathlib import Path

        from rl360.policies.lora import LoraSpec, save_adapter

        if self._adapter_dir is None:
            self._adapter_dir = tempfile.mkdtemp(prefix="rl360-sglang-lora-")
        spec = LoraSpec(rank=update.rank, alpha=update.alpha, targets=tuple(update.targets))
        out = Path(self._adapter_dir) / f"rl360-v{version}"
        save_adapter(out, update.tensors, spec, self.model_path)
        return str(out)

    def _release_adapter(self, client: Any, name: str) -> None:
        """One request that ran with adapter `name` finished: unload it once it is stale and
        unused (in a task of its own: the caller may be being cancelled)."""
        left = self._adapter_users.get(name, 1) - 1
        if left > 0:
            self._adapter_users[name] = left
            return
        self._adapter_users.pop(name, None)
        if name != self._adapter:
            task = asyncio.get_running_loop().create_task(
                self._unload_adapter(client, name), name=f"rl360-sglang-unload-{name}")
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def _unload_adapter(self, client: Any, name: str) -> None:
        import shutil
        from pathlib import Path

        try:
            check_result(await client.unload_lora(name), f"unload_lora_adapter ({name})")
        except Exception as exc:  # it holds adapter memory, not correctness: log it
            log.warning("sglang: %r", exc)
        if self._adapter_dir is not None:
            await asyncio.to_thread(shutil.rmtree, Path(self._adapter_dir) / name, True)

    async def join_weight_group(self, host: str, port: int, rank_offset: int, world: int,
                                group_name: str, backend: str = "nccl") -> None:
        """Have every tensor-parallel worker of this engine join the sender's group (ranks
        rank_offset .. rank_offset + tp - 1). Blocks until the whole group has formed."""

        if group_name in self._groups:
            return
        client = await self._ensure_client()
        check_result(await client.init_group(host, port, rank_offset, world, group_name, backend),
                     "init_weights_update_group")
        self._groups.add(group_name)

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        """name -> (elements compared, checksum) of what the engine serves, from SGLang's
        get_weights_by_name (a prefix of each weight: checksum_prefix elements or fewer)."""
        import torch

        client = await self._ensure_client()
        dtype = getattr(torch, self.model_cfg.dtype)
        out: dict[str, tuple[int | None, int]] = {}
        for name in names:
            values = await client.get_weights(name, self.options.checksum_prefix)
            if isinstance(values, dict):  # HTTP wraps it
                values = values.get("weights", values.get("data"))
            if values is None:  # the engine has no tensor of that name: reported as missing
                continue
            flat = torch.tensor(values, dtype=torch.float64).reshape(-1)
            flat = flat[: self.options.checksum_prefix].to(dtype)
            out[name] = (int(flat.numel()), tensor_checksum(flat))
        return WeightChecksums(f"torch.{self.model_cfg.dtype}", out)

    async def pause(self) -> None:
        await self._gate.set_paused(True)
        if self.options.pause_mode != "drain" and self._client is not None:
            await self._client.pause(self.options.pause_mode)

    async def resume(self) -> None:
        if self.options.pause_mode != "drain" and self._client is not None:
            await self._client.resume()
        await self._gate.set_paused(False)

    def health(self) -> dict[str, Any]:
        return {
            "ok": self._failure is None,
            "error": repr(self._failure) if self._failure else None,
            "version": self._gate.version,
            "paused": self._gate.paused,
            "in_flight": self._gate.in_flight,
            "mode": self.options.mode,
            "started": self._client is not None,
            "uptime_s": time.monotonic() - self._started,
            **self._stats,
        }

    async def close(self) -> None:
        for task in list(self._aborts):
            task.cancel()
        if self._adapter_dir is not None:
            import shutil

            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    # ------------------------------------------------------------------ internals

    async def _ensure_client(self) -> Any:
        if self._client is not None:
            return self._client
        if self._failure is not None:
            raise RuntimeError(f"sglang engine failed to start earlier: {self._failure!r}")
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._client is None:

                try:
                    if self.options.mode == "http":
                        self._client = sc.HttpClient(self.options.url, self._kwargs,
                                                     self.options.launch_timeout_s)
                    else:  # off the serving loop: start-up takes a while and must not
                        # stall it (Serve's health checks run on it); the Engine's own
                        # request loop is made lazily, on this loop, at the first request
                        self._client = await asyncio.to_thread(sc.EngineClient, self._kwargs)
                except BaseException as exc:
                    self._failure = exc
                    raise
                log.info("sglang %s client up for %s (tp=%d)", self.options.mode,
                         self.model_path, self.tp)
        return self._client

    async def _apply_dict(self, client: Any, state: dict[str, Any], flush: bool) -> None:
        """A name -> tensor dict, in buckets of options.bucket_mb: each bucket goes to this
        engine's GPU, then to SGLang's workers by CUDA IPC (CPU tensors would travel as
        shared-memory file descriptors, which the HTTP path cannot carry); the prefix cache is
        flushed once, after the last bucket. At most one bucket of extra GPU memory."""

        spec = [(k, list(v.shape), str(v.dtype)) for k, v in state.items()]
        buckets = plan_buckets(spec, self.options.bucket_mb)
        for i, bucket in enumerate(buckets):
            named = await asyncio.to_thread(self._to_device, state, [n for n, _, _ in bucket])
            payload = serialize_named_tensors(named, self.tp, client.serialize_as_text)
            check_result(await client.update_from_tensor(payload, flush and i == len(buckets) - 1),
                         f"update_weights_from_tensor (bucket {i + 1}/{len(buckets)})")
            del named, payload

    def _to_device(self, state: dict[str, Any], names: list[str]) -> list[tuple[str, Any]]:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return [(k, torch.as_tensor(state[k]).to(device)) for k in names]

    async def _receive_collective(self, client: Any, update: CollectiveUpdate, flush: bool) -> None:

        if update.join is not None:
            host, port, offset, world, backend = update.join
            await self.join_weight_group(host, port, offset, world, update.group_name, backend)
        for i, bucket in enumerate(update.buckets):
            names = [n for n, _, _ in bucket]
            dtypes = [d.removeprefix("torch.") for _, _, d in bucket]
            shapes = [list(s) for _, s, _ in bucket]
            last = flush and i == len(update.buckets) - 1
            check_result(await client.update_from_distributed(names, dtypes, shapes,
                                                              update.group_name, last),
                         f"update_weights_from_distributed (bucket {i + 1}/"
                         f"{len(update.buckets)})")
