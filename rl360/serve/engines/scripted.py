"""A scripted engine: the cheap backend that doubles as the test double.

It answers from rules (regex on the decoded prompt tail -> reply text) and returns the reply's
token ids plus the end-of-turn token, with deterministic fake logprobs. Same contract as the
real backends (versions, pause/resume, health), no model."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from rl360.policies.loading import load_tokenizer
from rl360.recipe import EngineSection, ModelSection
from rl360.types import Generation, SamplingParams
from rl360.weights.payloads import WeightUpdate
from rl360.weights.plan import update_checksums
from rl360.weights.receiver import Intake, WeightChecksums


class ScriptedBackend:
    def __init__(self, engine: EngineSection, model: ModelSection, seed: int = 0,
                 tokenizer: Any = None) -> None:
        if tokenizer is None:
            tokenizer = load_tokenizer(model.path)
        self.tokenizer = tokenizer
        opts = engine.options
        self.rules: list[tuple[re.Pattern[str], str]] = [
            (re.compile(p, re.DOTALL), reply) for p, reply in opts.get("rules", [])
        ]
        self.default: str = opts.get("default", "ok")
        self.delay_s: float = float(opts.get("delay_s", 0.0))
        self.end_token: str | None = opts.get("end_token")
        self._version = 0
        self._running = asyncio.Event()
        self._running.set()
        self.calls: list[list[int]] = []

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        await self._running.wait()
        self.calls.append(list(prompt_ids))
        tail = self.tokenizer.decode(prompt_ids[-400:], skip_special_tokens=False)
        reply = next((r for p, r in self.rules if p.search(tail)), self.default)
        ids = list(self.tokenizer.encode(reply, add_special_tokens=False))
        end = (
            self.tokenizer.convert_tokens_to_ids(self.end_token)
            if self.end_token
            else (sampling.eos_token_ids[0] if sampling.eos_token_ids else None)
        )
        finish, kind = "stop", "eos"
        if end is not None:
            ids.append(end)
        else:
            kind = ""
        if len(ids) > sampling.max_tokens:
            ids, finish, kind = ids[: sampling.max_tokens], "length", ""
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        lps = [-0.1 - 0.01 * (i % 7) for i in range(len(ids))]
        v = self._version
        return Generation(ids, lps, finish, v, [v] * len(ids), stop_kind=kind)  # type: ignore[arg-type]

    def weight_intake(self) -> Intake:
        return Intake()

    async def update_weights(self, version: int, update: WeightUpdate) -> bool:
        """Takes any kind of version, and only its number: no weights to load."""
        if version <= self._version:
            return False
        self._version = version
        return True

    async def weight_checksums(self, names: list[str], update: WeightUpdate) -> WeightChecksums:
        return await asyncio.to_thread(update_checksums, names, update)

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()

    def health(self) -> dict[str, Any]:
        return {"ok": True, "version": self._version, "paused": not self._running.is_set()}

    async def close(self) -> None:
        return None
