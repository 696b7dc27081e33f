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
- Weights, always through SGLang's own paths and only between generations (VersionGate):
  a name -> tensor dict (object-store transport) via `update_weights_from_tensor`; a CUDA-IPC
  payload from a trainer on the same GPU (IpcUpdate) via the same call, pre-serialized; a
  collective update (CollectiveUpdate: NCCL group from trainer rank 0) via
  `init_weights_update_group` once and `update_weights_from_distributed` per bucket.

HTTP mode: the replica still needs sglang importable for object-store updates (its serializer
packs the CUDA-IPC handles), and the server must run on the GPU this replica sees; with a
server elsewhere use the collective transport (the server joins the NCCL group itself).

engine.options: our keys are in _OWN_OPTIONS; every other key is an SGLang ServerArgs
keyword (e.g. mem_fraction_static, tp_size, chunked_prefill_size), passed as is.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import time
from typing import Any, Literal

import msgspec

from rl360.policies.loading import resolve_model_path
from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines import sglang_client as sc
from rl360.serve.engines.base import BackendUnavailable
from rl360.serve.engines.gate import VersionGate
from rl360.serve.engines.sglang_client import check_result
from rl360.serve.weights.plan import plan_buckets, tensor_checksum
from rl360.types import Generation, SamplingParams

log = logging.getLogger("rl360.engine.sglang")

_OWN_OPTIONS = {"mode", "url", "pause_mode", "seed_param", "launch_timeout_s", "checksum_prefix",
                "bucket_mb"}


class SGLangOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    mode: Literal["engine", "http"] = "engine"  # in-process Engine, or a server over HTTP
    url: str = ""  # http mode: an SGLang server already running; "" launches one
    # what SGLang's own scheduler does on pause(): "" only closes our gate to new requests
    pause_mode: Literal["", "abort", "retract", "in_place"] = ""
    seed_param: str = "sampling_seed"
    launch_timeout_s: float = 600.0
    checksum_prefix: int = 64  # elements per tensor compared by weight_checksums()
    bucket_mb: float = 1024.0  # object-store updates go to the GPU in buckets this large


class CollectiveUpdate(msgspec.Struct):
    """A version arriving over the collective group: the engine receives `buckets` in order
    (each one update_weights_from_distributed call, one broadcast per tensor)."""

    group_name: str
    buckets: list[list[tuple[str, list[int], str]]]
    join: tuple[str, int, int, int, str] | None = None  # (host, port, rank_offset, world, backend)


class IpcUpdate(msgspec.Struct):
    """Weights on the engine's own GPU, shared by CUDA IPC: one ForkingPickler payload of
    [(name, cuda tensor)] per tensor-parallel rank (the sender keeps the tensors alive)."""

    serialized_per_rank: list[bytes]


def sglang_installed() -> bool:

    return importlib.util.find_spec("sglang") is not None


def split_options(options: dict[str, Any]) -> tuple[SGLangOptions, dict[str, Any]]:
    own = {k: v for k, v in options.items() if k in _OWN_OPTIONS}
    return msgspec.convert(own, SGLangOptions), {
        k: v for k, v in options.items() if k not in _OWN_OPTIONS}


def engine_kwargs(engine: EngineSection, model: ModelSection, seed: int,
                  model_path: str) -> dict[str, Any]:
    """sglang.Engine / ServerArgs keywords for the recipe's sections (engine.options override
    any of them)."""
    _, extra = split_options(engine.options)
    kwargs: dict[str, Any] = {
        "model_path": model_path,
        "dtype": model.dtype,
        "context_length": model.max_model_len,
        "max_running_requests": engine.max_batch_size,
        "random_seed": seed,
        "tp_size": engine.tensor_parallel,
        "log_level": "error",
    }
    kwargs.update(extra)
    return kwargs


def to_sglang_sampling(sp: SamplingParams, seed_param: str = "sampling_seed",
                       room: int | None = None) -> dict[str, Any]:
    """SGLang sampling params. `room` (max_model_len - prompt length) caps max_new_tokens, so a
    long prompt ends with finish_reason "length" as in the torch backend instead of an error.
    Penalties are sent as neutral values: SGLang may otherwise take defaults from the model's
    generation_config.json (e.g. a repetition penalty), which the torch backend never applies."""
    if sp.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sp.max_tokens}")
    out: dict[str, Any] = {
        "max_new_tokens": min(sp.max_tokens, room) if room is not None else sp.max_tokens,
        "temperature": max(sp.temperature, 0.0),
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k and sp.top_k > 0 else -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": sorted(set(sp.stop_token_ids) | set(sp.eos_token_ids)),
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.seed is not None and seed_param:
        out[seed_param] = int(sp.seed)
    return out


def to_generation(ret: dict[str, Any], sp: SamplingParams, version: int) -> Generation:
    """One SGLang /generate answer -> Generation (ids and logprobs from output_token_logprobs)."""
    meta = ret.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise RuntimeError("sglang answer has no meta_info.output_token_logprobs "
                           "(was return_logprob dropped?)")
    ids = [int(e[1]) for e in entries]
    logprobs = [e[0] for e in entries]
    if any(lp is None for lp in logprobs):
        raise RuntimeError(f"sglang returned no logprob for some generated tokens: {logprobs}")
    out_ids = ret.get("output_ids")
    if out_ids is not None and list(out_ids) != ids[: len(out_ids)]:
        raise RuntimeError(f"sglang output_ids {list(out_ids)[:8]}... disagree with the ids of "
                           f"output_token_logprobs {ids[:8]}...")
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    matched = finish.get("matched") if isinstance(finish, dict) else None
    reason, stop_kind, stop_string = "length", "", None
    if kind == "stop":
        reason = "stop"
        if isinstance(matched, str):
            stop_kind, stop_string = "stop_string", matched
        elif isinstance(matched, int) and matched in sp.stop_token_ids:
            stop_kind = "stop_token"
        else:
            stop_kind = "eos"
    elif kind == "abort":
        reason = "abort"
    elif kind not in ("length", None):
        raise RuntimeError(f"unknown sglang finish_reason {finish!r}")
    return Generation(token_ids=ids, logprobs=[float(x) for x in logprobs],
                      finish_reason=reason,  # type: ignore[arg-type]
                      policy_version=version, token_versions=[version] * len(ids),
                      stop_kind=stop_kind, stop_string=stop_string)


def serialize_named_tensors(named: list[tuple[str, Any]], ranks: int, as_text: bool) -> list[Any]:
    """What update_weights_from_tensor expects: one payload per tensor-parallel rank."""
    from sglang.srt.utils import MultiprocessingSerializer

    if as_text:
        return [MultiprocessingSerializer.serialize(named, output_str=True) for _ in range(ranks)]
    return [MultiprocessingSerializer.serialize(named) for _ in range(ranks)]


class SGLangBackend:
    def __init__(self, engine: EngineSection, model: ModelSection, seed: int = 0) -> None:

        self.engine_cfg, self.model_cfg = engine, model
        self.options, extra = split_options(engine.options)
        if not (self.options.mode == "http" and self.options.url) and not sglang_installed():
            raise BackendUnavailable(
                "engine backend 'sglang' needs the sglang package (pip install 'rl360[sglang]' "
                "on a GPU machine), or options mode='http' with the url of a running server")
        self.tp = int(extra.get("tp_size", engine.tensor_parallel))
        self.weight_group_width = self.tp  # ranks this replica takes in a collective group
        self.model_path = str(resolve_model_path(model.path))
        self._kwargs = engine_kwargs(engine, model, seed, self.model_path)
        self._client: Any = None
        self._starting: asyncio.Lock | None = None
        self._gate = VersionGate(0)
        self._groups: set[str] = set()
        self._failure: BaseException | None = None
        self._stats = {"requests": 0, "tokens": 0, "busy_s": 0.0, "updates": 0}
        self._started = time.monotonic()

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
        async with self._gate.reading() as version:
            t0 = time.perf_counter()
            ret = await client.generate(list(prompt_ids), payload)
            self._stats["busy_s"] += time.perf_counter() - t0
        gen = to_generation(ret, sampling, version)
        self._stats["requests"] += 1
        self._stats["tokens"] += len(gen.token_ids)
        return gen

    async def update_weights(self, version: int, state: Any) -> bool:

        if hasattr(state, "__await__") and not isinstance(state, dict):
            state = await state  # a Ray ObjectRef
        client = await self._ensure_client()
        async with self._gate.writing():
            newer = version > self._gate.version
            if not newer and not isinstance(state, CollectiveUpdate):
                log.warning("ignoring weight update to version %d: this replica serves %d",
                            version, self._gate.version)
                return False
            t0 = time.perf_counter()
            if isinstance(state, CollectiveUpdate):
                # the sender is broadcasting now: receive even a stale version, or it hangs
                await self._receive_collective(client, state)
            elif isinstance(state, IpcUpdate):
                check_result(await client.update_from_tensor(state.serialized_per_rank, True),
                             "update_weights_from_tensor (CUDA IPC)")
            elif isinstance(state, dict):
                await self._apply_dict(client, state)
            else:
                raise TypeError(f"sglang backend cannot apply weights of type {type(state)}")
            if not newer:
                log.warning("received collective version %d but serve %d: kept the version",
                            version, self._gate.version)
                return False
            self._gate.version = version
            self._stats["updates"] += 1
            log.info("weights -> version %d in %.3fs", version, time.perf_counter() - t0)
            return True

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

    async def weight_checksums(self, names: list[str]) -> dict[str, tuple[int, int]]:
        """name -> (elements compared, checksum) of what the engine serves, from SGLang's
        get_weights_by_name (a prefix of each weight: checksum_prefix elements or fewer)."""
        import torch


        client = await self._ensure_client()
        dtype = getattr(torch, self.model_cfg.dtype)
        out: dict[str, tuple[int, int]] = {}
        for name in names:
            values = await client.get_weights(name, self.options.checksum_prefix)
            if isinstance(values, dict):  # HTTP wraps it
                values = values.get("weights", values.get("data"))
            if values is None:  # the engine has no tensor of that name: reported as missing
                continue
            flat = torch.tensor(values, dtype=torch.float64).reshape(-1)
            flat = flat[: self.options.checksum_prefix].to(dtype)
            out[name] = (int(flat.numel()), tensor_checksum(flat))
        return out

    async def pause(self) -> None:
        await self._gate.set_paused(True)
        if self.options.pause_mode and self._client is not None:
            await self._client.pause(self.options.pause_mode)

    async def resume(self) -> None:
        if self.options.pause_mode and self._client is not None:
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

    async def _apply_dict(self, client: Any, state: dict[str, Any]) -> None:
        """A name -> tensor dict, in buckets of options.bucket_mb: each bucket goes to this
        engine's GPU, then to SGLang's workers by CUDA IPC (CPU tensors would travel as
        shared-memory file descriptors, which the HTTP path cannot carry); the prefix cache is
        flushed once, after the last bucket. At most one bucket of extra GPU memory."""

        spec = [(k, list(v.shape), str(v.dtype)) for k, v in state.items()]
        buckets = plan_buckets(spec, self.options.bucket_mb)
        for i, bucket in enumerate(buckets):
            named = await asyncio.to_thread(self._to_device, state, [n for n, _, _ in bucket])
            payload = serialize_named_tensors(named, self.tp, client.serialize_as_text)
            check_result(await client.update_from_tensor(payload, i == len(buckets) - 1),
                         f"update_weights_from_tensor (bucket {i + 1}/{len(buckets)})")
            del named, payload

    def _to_device(self, state: dict[str, Any], names: list[str]) -> list[tuple[str, Any]]:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return [(k, torch.as_tensor(state[k]).to(device)) for k in names]

    async def _receive_collective(self, client: Any, update: CollectiveUpdate) -> None:

        if update.join is not None:
            host, port, offset, world, backend = update.join
            await self.join_weight_group(host, port, offset, world, update.group_name, backend)
        for i, bucket in enumerate(update.buckets):
            names = [n for n, _, _ in bucket]
            dtypes = [d.removeprefix("torch.") for _, _, d in bucket]
            shapes = [list(s) for _, s, _ in bucket]
            last = i == len(update.buckets) - 1
            check_result(await client.update_from_distributed(names, dtypes, shapes,
                                                              update.group_name, last),
                         f"update_weights_from_distributed (bucket {i + 1}/"
                         f"{len(update.buckets)})")
