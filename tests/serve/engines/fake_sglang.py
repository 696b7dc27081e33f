"""A small fake SGLang HTTP server (aiohttp, CPU) with the native endpoints RL360 calls, so
rl360.serve.engines.sglang_client.HttpClient and the SGLang backend's HTTP mode run in
`make test`. Request and answer shapes follow SGLang's own (/generate with input_ids and
sampling_params; meta_info.output_token_logprobs as (logprob, id, text); pause_generation with
mode abort / retract / in_place; abort_request by rid), checked against sglang's
http_server.py and io_struct.py; the behaviour is a model of it, not a copy:

- generation is one token per `token_delay_s`: token i of a request is (last prompt id + 1 + i)
  mod vocab, with logprob -(weights + 1) / 100, so an answer shows which weights made each token;
- pause retract / in_place hold running requests (they continue after continue_generation),
  abort ends them with finish_reason abort; an aborted rid ends the same way;
- weight updates bump `weights`; a flush (flush_cache) while in_place requests are paused
  fails as SGLang's does; `updates_while_running` counts updates that ran with requests
  generating and the scheduler not paused (what pausing or draining must prevent);
- LoRA adapters: load_lora_adapter reads a peft directory (adapter_config.json and
  adapter_model.safetensors, as SGLang does) under a new name (a name already loaded fails),
  unload_lora_adapter drops it and fails while a request still generates with it; a request
  whose `lora_path` names no loaded adapter is a 400; a token generated with an adapter has
  logprob -(weights + 1 + 10 * its load number) / 100.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class _Req:
    rid: str
    aborted: bool = False
    adapter: str = ""


@dataclass
class FakeSGLang:
    vocab: int = 1000
    token_delay_s: float = 0.0
    weights: int = 0  # bumped by every weight update
    paused: str = ""  # "" or a pause mode
    healthy: bool = True
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    running: dict[str, _Req] = field(default_factory=dict)
    updates_while_running: int = 0
    groups: set[str] = field(default_factory=set)
    adapters: dict[str, int] = field(default_factory=dict)  # loaded name -> its load number
    adapter_loads: int = 0
    unloads_in_use: int = 0  # unload calls that found the adapter generating (must stay 0)
    tensors: dict[str, list[float]] = field(default_factory=dict)
    url: str = ""
    _resume: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    def __post_init__(self) -> None:
        self._resume.set()

    def generating(self) -> bool:
        """One of the client's /generate requests is running (not its start-up health probe)."""
        return any(not rid.startswith("health-") for rid in self.running)

    def called(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body in self.calls if p == path]

    # ------------------------------------------------------------------ server

    async def start(self) -> FakeSGLang:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health_generate", self._health_generate)
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/update_weights_from_tensor", self._update_from_tensor)
        app.router.add_post("/init_weights_update_group", self._init_group)
        app.router.add_post("/update_weights_from_distributed", self._update_from_distributed)
        app.router.add_post("/get_weights_by_name", self._get_weights)
        app.router.add_post("/load_lora_adapter", self._load_lora)
        app.router.add_post("/unload_lora_adapter", self._unload_lora)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _body(self, request: web.Request) -> dict[str, Any]:
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path, body))
        return body

    # ------------------------------------------------------------------ generation

    async def _run(self, input_ids: list[int], sp: dict[str, Any], rid: str,
                   adapter: str = "") -> dict[str, Any]:
        req = self.running.setdefault(rid, _Req(rid, adapter=adapter))
        bump = 10 * self.adapters[adapter] if adapter else 0
        stops = set(sp.get("stop_token_ids") or [])
        out: list[tuple[float, int, None]] = []
        finish: dict[str, Any] = {"type": "length", "length": int(sp["max_new_tokens"])}
        try:
            for i in range(int(sp["max_new_tokens"])):
                await asyncio.sleep(self.token_delay_s)
                await self._resume.wait()  # retract / in_place: held here until continue
                if req.aborted:
                    finish = {"type": "abort", "message": "aborted"}
                    break
                tok = (input_ids[-1] + 1 + i) % self.vocab
                out.append((-(self.weights + 1 + bump) / 100, tok, None))
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            self.running.pop(rid, None)
        return {"text": "", "output_ids": [t for _, t, _ in out],
                "meta_info": {"id": rid, "finish_reason": finish, "output_token_logprobs": out,
                              "prompt_tokens": len(input_ids), "completion_tokens": len(out)}}

    async def _generate(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids, sp, rid = body.get("input_ids"), body.get("sampling_params") or {}, body.get("rid")
        if not ids or "max_new_tokens" not in sp or not isinstance(rid, str):
            return web.json_response({"error": "input_ids, sampling_params.max_new_tokens and "
                                               "rid are required"}, status=400)
        if rid in self.running:
            return web.json_response({"error": f"duplicate rid {rid}"}, status=400)
        adapter = body.get("lora_path") or ""
        if adapter and adapter not in self.adapters:
            return web.json_response({"error": f"LoRA adapter {adapter!r} is not loaded"},
                                     status=400)
        ans = await self._run(list(ids), sp, rid, adapter)
        if not body.get("return_logprob"):
            ans["meta_info"].pop("output_token_logprobs")
        return web.json_response(ans)

    async def _health_generate(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, {}))
        if not self.healthy:
            return web.Response(status=503, text="scheduler not responding")
        await self._run([0], {"max_new_tokens": 1}, f"health-{len(self.calls)}")
        return web.Response(status=200)

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        for req in self.running.values():
            if body.get("abort_all") or req.rid == body.get("rid"):
                req.aborted = True
        return web.Response(status=200)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return web.json_response({"error": f"Invalid mode: {mode!r}"}, status=400)
        self.paused = mode
        self._resume.clear()
        if mode == "abort":
            for req in self.running.values():
                req.aborted = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        await self._body(request)
        self.paused = ""
        self._resume.set()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    # ------------------------------------------------------------------ weights

    def _apply(self, flush: bool) -> dict[str, Any]:
        if flush and self.paused == "in_place" and self.running:
            return {"success": False, "message": "flush_cache failed: requests are running"}
        if self.running and not self.paused:
            self.updates_while_running += 1
        self.weights += 1
        return {"success": True, "message": "Succeeded to update parameter online."}

    async def _update_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not isinstance(body.get("serialized_named_tensors"), list):
            return web.json_response({"success": False, "message": "no tensors"})
        return web.json_response(self._apply(bool(body.get("flush_cache", True))))

    async def _init_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        need = ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                "backend")
        if any(k not in body for k in need):
            return web.json_response({"success": False, "message": f"need {need}"})
        self.groups.add(body["group_name"])
        return web.json_response({"success": True, "message": "group initialized"})

    async def _update_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("group_name") not in self.groups:
            return web.json_response({"success": False,
                                      "message": f"no group {body.get('group_name')!r}"})
        if not (len(body["names"]) == len(body["dtypes"]) == len(body["shapes"])):
            return web.json_response({"success": False, "message": "names/dtypes/shapes"})
        return web.json_response(self._apply(bool(body.get("flush_cache", True))))

    async def _load_lora(self, request: web.Request) -> web.Response:
        from pathlib import Path

        body = await self._body(request)
        name, path = body.get("lora_name"), Path(str(body.get("lora_path")))
        if name in self.adapters:
            return web.json_response({"success": False,
                                      "message": f"adapter {name!r} is already loaded"})
        if not ((path / "adapter_config.json").is_file()
                and (path / "adapter_model.safetensors").is_file()):
            return web.json_response({"success": False, "message": f"no peft adapter at {path}"})
        self.adapter_loads += 1
        self.adapters[str(name)] = self.adapter_loads
        return web.json_response({"success": True, "message": "loaded"})

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name = body.get("lora_name")
        if any(r.adapter == name for r in self.running.values()):
            self.unloads_in_use += 1
            return web.json_response({"success": False, "message": f"{name!r} is in use"})
        if self.adapters.pop(str(name), None) is None:
            return web.json_response({"success": False, "message": f"{name!r} is not loaded"})
        return web.json_response({"success": True, "message": "unloaded"})

    async def _get_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        values = self.tensors.get(body["name"])
        if values is None:
            return web.json_response(None)
        return web.json_response(values[: int(body.get("truncate_size", 100))])
