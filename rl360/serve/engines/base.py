"""The engine backend contract (DESIGN.md, "Engine backend") and the backend factory.

Backends are plain Python objects; the Serve deployment in rl360.serve.engines.replica wraps one per
replica. Heavy imports (torch, vllm, sglang) happen inside the backend modules, which the
factory imports only when that backend is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from rl360.recipe import EngineSection, ModelSection
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import WeightUpdate
from rl360.weights.receiver import WeightReceiver


@runtime_checkable
class EngineBackend(WeightReceiver, Protocol):
    """Generation with per-token logprobs and versioned weights: a weight receiver
    (rl360.weights.receiver: `weight_intake`, `update_weights`, `weight_checksums`) that
    generates."""

    @property
    def version(self) -> int: ...

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation: ...

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        """Apply `update` (one of rl360.weights.payloads' kinds, those `weight_intake`
        says) as `version`, between batches. Returns False (and logs why) when `version` is
        not newer than the current one."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    def health(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...

    # optional: `async def probe(self) -> None`, a generation probe the replica's Serve health
    # check awaits (raises when the engine cannot generate); see SGLangBackend.probe


# name -> "module:Class"; imported lazily so only the chosen backend's deps are needed
BACKENDS: dict[str, str] = {
    "torch": "rl360.serve.engines.torch_backend:TorchBackend",
    "scripted": "rl360.serve.engines.scripted:ScriptedBackend",
    "vllm": "rl360.serve.engines.vllm_backend:VLLMBackend",
    "sglang": "rl360.serve.engines.sglang_backend:SGLangBackend",
}


# the torch backend in a child process of its replica (engine.core_process)
CORE_PROCESS = "rl360.serve.engines.core_process:CoreProcessBackend"


def check_prompt(prompt_ids: list[int], max_model_len: int) -> None:
    """The request checks every backend makes before queueing a prompt."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens does not fit max_model_len {max_model_len}"
        )


class BackendUnavailable(RuntimeError):
    pass


def build_engine_backend(engine: EngineSection, model: ModelSection, seed: int = 0) -> EngineBackend:
    """The backend `engine.backend` names, for the recipe's [engine] and [model] sections (the
    model is `model.path`: an HF directory, "tiny[:preset]" or "smollm2") and the run's seed."""
    name = engine.backend
    if name not in BACKENDS:
        raise ValueError(f"unknown engine backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    # engine.core_process: the torch engine in a child process (EngineSection checks the backend)
    module_name, _, cls_name = (CORE_PROCESS if engine.core_process else BACKENDS[name]).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(
            f"engine backend {name!r} is not installed here ({exc.name} missing); "
            f"install the rl360[{name}] extra on a machine that can run it"
        ) from exc
    return getattr(module, cls_name)(engine, model, seed)
