"""What a request may ask of the model a session service serves: bad input stops here, before
any rendering or engine call, with a 4xx naming the problem (context size, vocabulary,
sampling bounds, fields the ledger decides), never a 500.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rl360.serve.sessions.ledger import LedgerError
from rl360.types import Generation, Message, SamplingParams


class RequestBounds:
    """The model's limits a request is checked against. `max_token_chars`: the longest text
    one token can stand for (a prompt with more characters than max_model_len * this cannot
    fit); `eos_ids`: the tokens that end a chat reply."""

    def __init__(self, max_model_len: int, vocab_size: int, default_max_tokens: int,
                 eos_ids: list[int], max_token_chars: int) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens
        self.eos_ids = list(eos_ids)
        self.max_token_chars = max_token_chars

    def sampling(
        self, prompt_len: int, temperature: float | None, top_p: float | None,
        top_k: int | None, max_tokens: int | None, stop: str | list[str] | None,
        stop_token_ids: list[int] | None, seed: int | None, eos: bool = True,
        priority: int | None = None,
    ) -> SamplingParams:
        """The engine's sampling for a prompt of `prompt_len` tokens, the request's fields
        checked; max_tokens capped to the room left in the context."""
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise LedgerError(400, "context_length", f"the prompt has {prompt_len} "
                              f"tokens; this model's context is {self.max_model_len}")
        want = max_tokens if max_tokens is not None else self.default_max_tokens
        if want < 1:
            raise LedgerError(422, "bad_max_tokens", "max_tokens must be >= 1")
        t = 1.0 if temperature is None else temperature
        p = 1.0 if top_p is None else top_p
        if not (0 <= t <= 100 and 0 < p <= 1):  # also refuses NaN and inf
            raise LedgerError(422, "bad_sampling", "temperature must be in [0, 100] and top_p "
                              "in (0, 1]")
        if top_k is not None and not -1 <= top_k <= self.vocab_size:
            raise LedgerError(422, "bad_sampling", "top_k must be -1, 0 or a count of tokens")
        if seed is not None and not 0 <= seed < 2**63:
            raise LedgerError(422, "bad_sampling", "seed must be in [0, 2**63)")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16 or any(len(x) > 1024 for x in stops):
            raise LedgerError(400, "bad_stop", "at most 16 stop strings of up to 1024 characters")
        self.check_ids(list(stop_token_ids or []), "stop_token_ids")
        if priority is not None and not -2**31 <= priority < 2**31:
            raise LedgerError(422, "bad_priority", "priority must be a 32-bit integer")
        return SamplingParams(
            temperature=t, top_p=p, top_k=top_k or 0, max_tokens=min(want, room),
            stop=[s for s in stops if s], stop_token_ids=list(stop_token_ids or []), seed=seed,
            eos_token_ids=self.eos_ids if eos else [],
            priority=priority or 0,
        )

    def check_ids(self, ids: list[int], what: str) -> None:
        if len(ids) > self.max_model_len:
            raise LedgerError(400, "context_length", f"{what} has {len(ids)} tokens; this "
                              f"model's context is {self.max_model_len}")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise LedgerError(400, "bad_token_id", f"{what} holds token id {bad}, outside this "
                              f"model's vocabulary [0, {self.vocab_size})")

    def check_text(self, prompt: str) -> None:
        """Refuse, before tokenizing, a prompt whose text cannot fit the context."""
        if len(prompt) > self.max_model_len * self.max_token_chars:
            raise LedgerError(400, "context_length", "the prompt cannot fit this model's "
                              f"context of {self.max_model_len} tokens")

    def check_size(self, messages: list[Message], tools: Any) -> None:
        """Refuse, before rendering, a conversation whose text cannot fit the context."""
        chars = len(msgspec.json.encode(tools)) if tools else 0
        for m in messages:
            chars += len(m.content or "") + len(m.role) + len(m.name or "")
            chars += sum(len(tc.function.arguments) + len(tc.function.name)
                         for tc in m.tool_calls or [])
        if chars > self.max_model_len * self.max_token_chars:
            raise LedgerError(400, "context_length", f"the conversation has {chars} characters"
                              f"; it cannot fit this model's context of "
                              f"{self.max_model_len} tokens")


def seeded(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of a request's n choices: seed, seed + 1, ... when it has one."""
    if n == 1:
        return [sampling]
    return [msgspec.structs.replace(sampling, seed=None if sampling.seed is None
                                    else sampling.seed + i) for i in range(n)]


def refuse_control_fields(input_ids: Any, prompt_token_ids: Any, n: int, max_n: int) -> None:
    if input_ids is not None or prompt_token_ids is not None:
        raise LedgerError(400, "client_token_ids", "input_ids / prompt_token_ids are not "
                          "accepted: the session's ledger decides the prompt tokens")
    if not 1 <= n <= max_n:
        raise LedgerError(400, "unsupported", f"n must be between 1 and {max_n} here")


def strip_stop_token(gen: Generation) -> list[int]:
    """The reply text excludes the EOS / stop token that ended it (the ledger keeps it)."""
    ids = gen.token_ids
    return ids[:-1] if ids and gen.stop_kind in ("eos", "stop_token") else ids
