"""The SGLang backend's plain parts (no sglang import at module level): its options and the
mapping of requests and answers between RL360 and SGLang's
native API. rl360.serve.engines.sglang_backend uses them; tests/serve/engines/test_sglang_mapping.py checks
them on CPU.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import msgspec

from rl360.recipe import EngineSection, ModelSection
from rl360.types import Generation, SamplingParams

_OWN_OPTIONS = {"mode", "url", "pause_mode", "seed_param", "launch_timeout_s", "checksum_prefix",
                "bucket_mb", "probe_idle_s", "probe_timeout_s"}


class SGLangOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    mode: Literal["engine", "http"] = "engine"  # in-process Engine, or a server over HTTP
    url: str = ""  # http mode: an SGLang server already running; "" launches one
    # around a weight update (and on pause()): SGLang's pause_generation mode, or "drain" (wait
    # for running requests, SGLang not paused). retract and in_place keep in-flight requests
    pause_mode: Literal["retract", "in_place", "abort", "drain"] = "retract"
    probe_idle_s: float = 10.0  # health: probe generation when idle this long
    probe_timeout_s: float = 30.0  # health: a probe without a token in this time fails
    seed_param: str = "sampling_seed"
    launch_timeout_s: float = 600.0
    checksum_prefix: int = 64  # elements per tensor compared by weight_checksums()
    bucket_mb: float = 1024.0  # object-store updates go to the GPU in buckets this large


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
        "ep_size": engine.expert_parallel,
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
