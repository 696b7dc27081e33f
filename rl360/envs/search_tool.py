"""The `search` tool: agents query the stack's search deployment (POST /search) and read the
hits as text. Envs get the stack's services from the env actor (`Env.services`, e.g.
{"search": {"url": ..., "timeout_s": ...}}); `make_toolbox` adds the search tool to the
built-in ones when the service is there (or when a task set asks for it by name).

A failed call (service down, timeout, HTTP error) comes back as an error ToolResult the model
can read, never as an exception out of the episode.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from rl360.envs.api import ToolResult
from rl360.envs.sandbox import Sandbox
from rl360.envs.tools import BUILTIN_TOOLS, Tool, ToolBox
from rl360.types import FunctionSpec, ToolSpec

SEARCH = "search"
MAX_K = 20
SERVICE_TOOLS = (SEARCH,)


def format_hits(hits: list[dict[str, Any]]) -> str:
    if not hits:
        return "no results"
    lines = []
    for i, h in enumerate(hits, 1):
        lines.append(f"[{i}] {h.get('title', '')} ({h.get('id', '')})\n{h.get('snippet', '')}")
    return "\n\n".join(lines)


def search_tool(url: str, timeout_s: float = 30.0, default_k: int = 5) -> Tool:
    spec = ToolSpec(function=FunctionSpec(
        name=SEARCH,
        description="Search the document collection; returns the best passages with titles.",
        parameters={"type": "object",
                    "properties": {"query": {"type": "string"},
                                   "k": {"type": "integer",
                                         "description": f"how many results (1-{MAX_K})"}},
                    "required": ["query"]}))

    async def run(sb: Sandbox, args: dict[str, Any], box: ToolBox) -> ToolResult:
        query = args["query"].strip()
        if not query:
            return ToolResult("error: query is empty", ok=False)
        k = max(1, min(MAX_K, int(args.get("k") or default_k)))
        try:
            async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as http, \
                    http.post(url, json={"query": query[:4000], "k": k}) as resp:
                body = await resp.text()
                if resp.status != 200:
                    return ToolResult(f"error: search failed (HTTP {resp.status}): {body[:300]}",
                                      ok=False)
                hits = json.loads(body).get("hits") or []
        except TimeoutError:
            return ToolResult(f"error: search timed out after {timeout_s:g}s", ok=False)
        except (aiohttp.ClientError, ValueError) as e:
            return ToolResult(f"error: search unavailable: {type(e).__name__}: {e}", ok=False)
        return ToolResult(format_hits(hits))

    return Tool(spec, run)


def service_tools(services: Mapping[str, Any]) -> dict[str, Tool]:
    """The tools the stack's services offer (today: `search` when the search app runs)."""
    out: dict[str, Tool] = {}
    s = services.get(SEARCH)
    if s:
        out[SEARCH] = search_tool(s["url"], float(s.get("timeout_s", 30.0)),
                                  int(s.get("default_k", 5)))
    return out


def check_tool_names(names: Sequence[str] | None) -> tuple[str, ...] | None:
    """`names` as a tuple, or ValueError naming the unknown ones (for env constructors, so a
    recipe's `tools` list fails at start, not in an episode)."""
    if names is None:
        return None
    if isinstance(names, str):
        raise ValueError(f"tools must be a list of tool names, got the string {names!r}")
    known = {*BUILTIN_TOOLS, *SERVICE_TOOLS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; known: {sorted(known)}")
    return tuple(names)


def make_toolbox(sandbox: Sandbox, names: Sequence[str] | None, services: Mapping[str, Any],
                 **kwargs: Any) -> ToolBox:
    """A ToolBox with `names` (None: every built-in tool plus every service tool available).
    Asking for a service tool whose service is not running is a ValueError naming it."""
    offered = service_tools(services)
    if names is None:
        return ToolBox(sandbox, tuple(BUILTIN_TOOLS), extra=list(offered.values()), **kwargs)
    missing = [n for n in names if n in SERVICE_TOOLS and n not in offered]
    if missing:
        raise ValueError(f"tool(s) {missing} need their service: set [search] index in the recipe")
    builtin = [n for n in names if n not in SERVICE_TOOLS]
    return ToolBox(sandbox, builtin, extra=[offered[n] for n in names if n in offered], **kwargs)
