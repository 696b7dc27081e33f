"""The built-in reward functions: tests passed, all pass, exact answer, format penalty, and a
weighted composition of any of them."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rl360.rewards.base import Guarded, RewardContext, RewardFn, guarded
from rl360.types import Reward

_BOXED = "\\boxed{"
_TRAILING_PUNCT = ".,;:!?\u3002"


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalize_answer(text: str) -> str:
    """strip, unwrap \\boxed{} and $...$, casefold, collapse whitespace, drop trailing
    punctuation."""
    s = text.strip()
    boxed = _last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.strip().strip("$").casefold()
    s = re.sub(r"\s+", " ", s).strip()
    return s.rstrip(_TRAILING_PUNCT).strip()


class TestsPassed:
    """Fraction of tests passed (0 when there are none)."""

    name = "tests_passed"

    def __call__(self, ctx: RewardContext) -> Reward:
        total = max(0, ctx.tests_total)
        frac = min(1.0, ctx.tests_passed / total) if total else 0.0
        all_pass = 1.0 if total and ctx.tests_passed >= total else 0.0
        return Reward(value=frac, components={"tests_passed": frac, "all_pass": all_pass})


class AllPass:
    """1 when every test passed (and there was at least one), else 0."""

    name = "all_pass"

    def __call__(self, ctx: RewardContext) -> Reward:
        ok = 1.0 if ctx.tests_total > 0 and ctx.tests_passed >= ctx.tests_total else 0.0
        return Reward(value=ok, components={"all_pass": ok})


class ExactAnswer:
    """1 when the normalised answer equals a normalised reference (ctx.reference or the
    `reference` parameter), else 0."""

    name = "exact_answer"

    def __init__(self, reference: str | Sequence[str] | None = None) -> None:
        self.reference = reference

    def __call__(self, ctx: RewardContext) -> Reward:
        refs = ctx.reference if ctx.reference is not None else self.reference
        if refs is None:
            raise ValueError("exact_answer needs a reference answer (task data or parameter)")
        accepted = {normalize_answer(r) for r in ([refs] if isinstance(refs, str) else refs)}
        hit = 1.0 if ctx.answer is not None and normalize_answer(ctx.answer) in accepted else 0.0
        return Reward(value=hit, components={"exact": hit})


class FormatPenalty:
    """-penalty when the episode had malformed tool calls, no final answer, or an answer in the
    wrong format; 0 otherwise. With per_malformed > 0 the penalty grows with the number of
    malformed calls, capped at `penalty`."""

    name = "format_penalty"

    def __init__(self, penalty: float = 0.3, per_malformed: float = 0.0) -> None:
        if penalty < 0 or per_malformed < 0:
            raise ValueError("format_penalty penalty and per_malformed must be >= 0")
        self.penalty = penalty
        self.per_malformed = per_malformed

    def __call__(self, ctx: RewardContext) -> Reward:
        bad_answer = not ctx.has_final_answer or not ctx.format_ok
        if self.per_malformed > 0:
            cost = self.per_malformed * ctx.malformed_tool_calls + (
                self.penalty if bad_answer else 0
            )
            value = -min(self.penalty, cost)
        else:
            value = -self.penalty if (bad_answer or ctx.malformed_tool_calls > 0) else 0.0
        return Reward(
            value=value,
            components={
                "format_penalty": value,
                "malformed_tool_calls": float(ctx.malformed_tool_calls),
                "no_final_answer": 0.0 if ctx.has_final_answer else 1.0,
            },
        )


Term = tuple[RewardFn | Guarded, float]


class Weighted:
    """sum(weight * term.value). Terms come as `terms=[{"name": ..., "weight": ..., **params}]`,
    as `terms={"name": weight}`, or as (reward_fn, weight) pairs. Each term is guarded on its
    own, so one failing term yields reward_error=1 while the others still count. Components: each
    term's value under its name, plus the terms' own components."""

    name = "weighted"

    def __init__(self, terms: Sequence[Mapping[str, Any] | Term] | Mapping[str, float]) -> None:
        self.terms: list[tuple[str, Guarded, float]] = []
        items: Sequence[Any] = (
            [{"name": k, "weight": w} for k, w in terms.items()]
            if isinstance(terms, Mapping)
            else terms
        )
        for item in items:
            if isinstance(item, Mapping):
                spec = dict(item)
                name = spec.pop("name")
                weight = float(spec.pop("weight", 1.0))
                fn = build_reward(name, **spec)
            else:
                raw, weight = item
                fn = raw if isinstance(raw, Guarded) else Guarded(raw)
                name = fn.name
            self.terms.append((name, fn, float(weight)))
        if not self.terms:
            raise ValueError("weighted reward needs at least one term")

    def __call__(self, ctx: RewardContext) -> Reward:
        total = 0.0
        components: dict[str, float] = {}
        info: dict[str, Any] = {}
        errors = 0.0
        for name, fn, weight in self.terms:
            r = fn(ctx)
            total += weight * r.value
            for k, v in r.components.items():
                if k == "reward_error":
                    errors += v
                else:
                    components.setdefault(k, v)
            components[name] = r.value
            info.update(r.info)
        if errors:
            components["reward_error"] = errors
        return Reward(value=total, components=components, info=info)


# name -> factory of the built-in rewards; a recipe may also name "package.module:Factory"
REWARDS: dict[str, Callable[..., RewardFn]] = {
    "tests_passed": TestsPassed,
    "all_pass": AllPass,
    "exact_answer": ExactAnswer,
    "format_penalty": FormatPenalty,
    "weighted": Weighted,
}


def build_reward(name: str, **params: Any) -> Guarded:
    """The reward `name` (a built-in of REWARDS or "package.module:Factory") with `params`,
    guarded against raising."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r} cannot be imported: {e}") from None
    elif name in REWARDS:
        factory = REWARDS[name]
    else:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)} or 'package.module:Factory'")
    try:
        fn = factory(**params)
    except TypeError as e:
        raise ValueError(f"bad parameters for reward {name!r} {params}: {e}") from None
    return guarded(fn)


def env_reward(reward: str, reward_params: Mapping[str, Any] | None = None,
               format_penalty: float = 0.0) -> Guarded:
    """An env's reward function: `reward` built with `reward_params`, plus the format penalty
    term (-format_penalty for malformed tool calls, no final answer or a badly formatted one)
    when format_penalty > 0."""
    if format_penalty < 0:
        raise ValueError(f"format_penalty must be >= 0, got {format_penalty}")
    if not format_penalty:
        return build_reward(reward, **dict(reward_params or {}))
    return build_reward("weighted", terms=[
        {"name": reward, "weight": 1.0, **dict(reward_params or {})},
        {"name": "format_penalty", "weight": 1.0, "penalty": format_penalty},
    ])
