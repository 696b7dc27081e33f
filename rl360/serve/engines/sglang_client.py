"""Two ways to reach SGLang behind one small interface (SGLangClient):

- EngineClient: an in-process `sglang.Engine` (its scheduler and detokenizer are child
  processes). The Engine's own weight/pause methods run `loop.run_until_complete`, which cannot
  be called from inside a running event loop (a Serve replica), so this client awaits the
  Engine's TokenizerManager coroutines directly, with SGLang's own request structs.
- HttpClient: an SGLang server (`python -m sglang.launch_server`) reached over HTTP, either one
  already running (`url`) or one this client launches as a child process. Same native
  endpoints: /generate, /abort_request, /update_weights_from_tensor,
  /init_weights_update_group, /update_weights_from_distributed, /pause_generation,
  /continue_generation, /get_weights_by_name, /health_generate, /load_lora_adapter,
  /unload_lora_adapter. tests/serve/engines/
  fake_sglang.py implements these (CPU), so this client is tested in `make test`.

sglang is imported only inside these classes. Names follow sglang >= 0.5 (io_struct); where
0.5.x versions differ (pause/continue without a request struct) both forms are tried.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from typing import Any, Protocol

from rl360.ray_session import free_port

log = logging.getLogger("rl360.engine.sglang")


class SGLangClient(Protocol):
    async def generate(self, input_ids: list[int], sampling: dict[str, Any],
                       rid: str, lora: str | None = None) -> dict[str, Any]:
        """`lora`: the name of a loaded adapter to generate with (None: the base)."""
        ...

    async def load_lora(self, name: str, path: str) -> Any:
        """Load the peft adapter directory `path` under `name` (load_lora_adapter)."""
        ...

    async def unload_lora(self, name: str) -> Any: ...

    async def abort(self, rid: str) -> Any: ...

    async def probe(self) -> None:
        """One generation end to end (SGLang's /health_generate); raises when it fails."""
        ...

    async def update_from_tensor(self, serialized_per_rank: list[Any], flush_cache: bool) -> Any: ...

    async def init_group(self, host: str, port: int, rank_offset: int, world: int,
                         group_name: str, backend: str) -> Any: ...

    async def update_from_distributed(self, names: list[str], dtypes: list[str],
                                      shapes: list[list[int]], group_name: str,
                                      flush_cache: bool) -> Any: ...

    async def pause(self, mode: str) -> Any: ...

    async def resume(self) -> Any: ...

    async def get_weights(self, name: str, truncate_size: int) -> Any: ...

    async def close(self) -> None: ...

    @property
    def serialize_as_text(self) -> bool: ...


def check_result(result: Any, what: str) -> None:
    """SGLang answers control calls with (success, message), an object with .success, or a
    JSON dict; raise with its message when it failed."""
    ok, msg = True, ""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        ok, msg = result[0], str(result[1]) if len(result) > 1 else ""
    elif isinstance(result, dict) and "success" in result:
        ok, msg = bool(result["success"]), str(result.get("message", ""))
    elif hasattr(result, "success"):
        ok, msg = bool(result.success), str(getattr(result, "message", ""))
    if not ok:
        raise RuntimeError(f"sglang {what} failed: {msg if msg else repr(result)}")


class EngineClient:
    serialize_as_text = False

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        import sglang

        self.engine = sglang.Engine(**engine_kwargs)
        self.tm = self.engine.tokenizer_manager

    async def generate(self, input_ids: list[int], sampling: dict[str, Any],
                       rid: str, lora: str | None = None) -> dict[str, Any]:
        extra = {"lora_path": lora} if lora else {}
        return await self.engine.async_generate(input_ids=input_ids, sampling_params=sampling,
                                                return_logprob=True, rid=rid, **extra)

    async def load_lora(self, name: str, path: str) -> Any:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        return await self.tm.load_lora_adapter(
            LoadLoRAAdapterReqInput(lora_name=name, lora_path=path), None)

    async def unload_lora(self, name: str) -> Any:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        return await self.tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)

    async def abort(self, rid: str) -> Any:
        out = self.tm.abort_request(rid=rid)
        return await out if asyncio.iscoroutine(out) else out

    async def probe(self) -> None:
        await self.engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1},
                                         rid=f"rl360-probe-{time.monotonic_ns()}")

    async def update_from_tensor(self, serialized_per_rank: list[Any], flush_cache: bool) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=serialized_per_rank,
                                              load_format=None, flush_cache=flush_cache)
        return await self.tm.update_weights_from_tensor(obj, None)

    async def init_group(self, host: str, port: int, rank_offset: int, world: int,
                         group_name: str, backend: str) -> Any:
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        obj = InitWeightsUpdateGroupReqInput(master_address=host, master_port=port,
                                             rank_offset=rank_offset, world_size=world,
                                             group_name=group_name, backend=backend)
        return await self.tm.init_weights_update_group(obj, None)

    async def update_from_distributed(self, names: list[str], dtypes: list[str],
                                      shapes: list[list[int]], group_name: str,
                                      flush_cache: bool) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        obj = UpdateWeightsFromDistributedReqInput(names=names, dtypes=dtypes, shapes=shapes,
                                                   group_name=group_name,
                                                   flush_cache=flush_cache)
        return await self.tm.update_weights_from_distributed(obj, None)

    async def pause(self, mode: str) -> Any:
        try:
            from sglang.srt.managers.io_struct import PauseGenerationReqInput
        except ImportError:  # sglang 0.5.x before the request struct: no modes
            return await self.tm.pause_generation()
        return await self.tm.pause_generation(PauseGenerationReqInput(mode=mode))

    async def resume(self) -> Any:
        try:
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput
        except ImportError:
            return await self.tm.continue_generation()
        return await self.tm.continue_generation(ContinueGenerationReqInput())

    async def get_weights(self, name: str, truncate_size: int) -> Any:
        from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

        obj = GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        return await self.tm.get_weights_by_name(obj, None)

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


def server_command(python: str, model_path: str, port: int, kwargs: dict[str, Any]) -> list[str]:
    """`python -m sglang.launch_server` with each ServerArgs keyword as a --flag."""
    cmd = [python, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in {"model_path": model_path, **kwargs}.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            cmd += [flag, *map(str, value)]
        else:
            cmd += [flag, str(value)]
    return cmd


class HttpClient:
    serialize_as_text = True  # JSON carries the serialized tensors as base64 text

    def __init__(self, url: str, engine_kwargs: dict[str, Any] | None = None,
                 launch_timeout_s: float = 600.0) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if not url:

            kwargs = dict(engine_kwargs or {})
            port = free_port()
            cmd = server_command(sys.executable, str(kwargs.pop("model_path")), port, kwargs)
            log.info("launching sglang server: %s", " ".join(cmd))
            self.proc = subprocess.Popen(cmd, env=dict(os.environ))
            url = f"http://127.0.0.1:{port}"
        self.url = url.rstrip("/")
        self._session: Any = None
        self._launch_deadline = time.monotonic() + launch_timeout_s

    async def _http(self) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            await self._wait_ready()
        return self._session

    async def _wait_ready(self) -> None:
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sglang server exited with {self.proc.returncode} at start")
            try:
                async with self._session.get(f"{self.url}/health_generate") as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > self._launch_deadline:
                raise TimeoutError(f"sglang server at {self.url} not healthy in time")
            await asyncio.sleep(1.0)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        s = await self._http()
        async with s.post(f"{self.url}{path}", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"sglang {path} -> HTTP {r.status}: {(await r.text())[:500]}")
            if r.content_type == "application/json":
                return await r.json()
            return {"success": True, "message": await r.text()}

    async def generate(self, input_ids: list[int], sampling: dict[str, Any],
                       rid: str, lora: str | None = None) -> dict[str, Any]:
        body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True,
                "rid": rid}
        if lora:
            body["lora_path"] = lora  # SGLang takes a loaded adapter's name here
        return await self._post("/generate", body)

    async def load_lora(self, name: str, path: str) -> Any:
        return await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora(self, name: str) -> Any:
        return await self._post("/unload_lora_adapter", {"lora_name": name})

    async def abort(self, rid: str) -> Any:
        return await self._post("/abort_request", {"rid": rid})

    async def probe(self) -> None:
        s = await self._http()
        async with s.get(f"{self.url}/health_generate") as r:
            if r.status != 200:
                raise RuntimeError(f"sglang /health_generate -> HTTP {r.status}: "
                                   f"{(await r.text())[:200]}")

    async def update_from_tensor(self, serialized_per_rank: list[Any], flush_cache: bool) -> Any:
        return await self._post("/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_per_rank, "load_format": None,
            "flush_cache": flush_cache})

    async def init_group(self, host: str, port: int, rank_offset: int, world: int,
                         group_name: str, backend: str) -> Any:
        return await self._post("/init_weights_update_group", {
            "master_address": host, "master_port": port, "rank_offset": rank_offset,
            "world_size": world, "group_name": group_name, "backend": backend})

    async def update_from_distributed(self, names: list[str], dtypes: list[str],
                                      shapes: list[list[int]], group_name: str,
                                      flush_cache: bool) -> Any:
        return await self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache})

    async def pause(self, mode: str) -> Any:
        return await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> Any:
        return await self._post("/continue_generation", {})

    async def get_weights(self, name: str, truncate_size: int) -> Any:
        return await self._post("/get_weights_by_name",
                                {"name": name, "truncate_size": truncate_size})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # our own child, by its handle
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
