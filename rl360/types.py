"""Wire types shared by every part of RL360 (msgspec Structs).

These cross process and actor boundaries (Ray object refs, HTTP bodies, JSONL files), so they
are plain data: no methods with side effects, no torch tensors. Keep them backwards compatible:
add fields with defaults, never rename.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# ----------------------------------------------------------------------------- chat messages


class FunctionCall(msgspec.Struct, omit_defaults=True):
    name: str
    arguments: str  # JSON text, as in the OpenAI API


class ToolCall(msgspec.Struct, omit_defaults=True):
    id: str
    function: FunctionCall
    type: str = "function"


class Message(msgspec.Struct, omit_defaults=True):
    """One chat message in OpenAI form. `content` is None only for an assistant message that
    carries tool calls and no text."""

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class FunctionSpec(msgspec.Struct, omit_defaults=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolSpec(msgspec.Struct, omit_defaults=True):
    function: FunctionSpec
    type: str = "function"


# ----------------------------------------------------------------------------- generation


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling settings understood by every engine backend."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k truncation
    max_tokens: int = 256
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int | None = None
    # ids that end generation in addition to stop_token_ids (the model's EOS ids); the
    # session server fills this from the tokenizer so backends need not know the tokenizer
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    # scheduling: a request with a lower value gets a free row first (arrival order within one
    # value), as vLLM's priority scheduling. The rollout controller sets each group's start
    # order, so the turns of the oldest batch's groups go first; the torch engine honours it,
    # the vLLM and SGLang backends ignore it
    priority: int = 0


FinishReason = Literal["stop", "length", "abort"]


class Generation(msgspec.Struct):
    """What an engine returns for one prompt: the sampled ids, the logprob of each sampled id
    under the distribution it was sampled from, and the policy version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int  # version at the end of generation
    token_versions: list[int] = msgspec.field(default_factory=list)
    # which stop ended generation: "eos", "stop_token", "stop_string", or "" for length/abort
    stop_kind: str = ""
    stop_string: str | None = None
    # a weight update landed between tokens of this sequence (only when the engine is told
    # it may swap mid-sequence; token_versions then shows where)
    mixed_versions: bool = False
    engine_replica: str = ""  # filled by the Serve engine deployment


# ----------------------------------------------------------------------------- tasks and rewards


class Task(msgspec.Struct, omit_defaults=True):
    """One problem to pose to the policy. `kind` selects the env; `data` is the env's own."""

    id: str
    prompt: str
    kind: str = "code"
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class Reward(msgspec.Struct, omit_defaults=True):
    """A scalar reward with its named components (all reach the trajectory and the metrics)."""

    value: float
    components: dict[str, float] = msgspec.field(default_factory=dict)
    info: dict[str, Any] = msgspec.field(default_factory=dict)


EpisodeStatus = Literal["ok", "truncated", "timeout", "error", "infra_error"]

Provenance = Literal["prompt", "delta", "junction", "generated", "client_assistant"]


class Sample(msgspec.Struct, omit_defaults=True):
    """One picked leaf of a session's token forest: the whole path from its root (the same
    per-token fields as Trajectory). `node` is the leaf's id in the session's forest."""

    node: int
    tokens: list[int]
    mask: list[int]
    logprobs: list[float | None]
    versions: list[int | None]
    provenance: list[str]
    messages: list[Message] = msgspec.field(default_factory=list)
    turns: int = 0
    truncated: bool = False
    rerender: dict[str, Any] = msgspec.field(default_factory=dict)


class Trajectory(msgspec.Struct, omit_defaults=True):
    """The token ledger of one session, plus (once an episode is scored) its reward.

    tokens, mask, logprobs, versions and provenance have equal length. mask is 1 exactly on
    tokens the engine generated in this session; logprobs/versions are None elsewhere.
    A session's ledger is a forest; the top-level fields are its primary picked sample (the
    latest picked leaf; for a linear conversation, the conversation) and `branches` the other
    picked leaves, each trained as its own sample with the episode's reward and advantage.
    """

    session_id: str
    tokens: list[int]
    mask: list[int]
    logprobs: list[float | None]
    versions: list[int | None]
    provenance: list[str]
    messages: list[Message] = msgspec.field(default_factory=list)
    turns: int = 0
    truncated: bool = False
    counters: dict[str, int] = msgspec.field(default_factory=dict)
    rerender: dict[str, Any] = msgspec.field(default_factory=dict)
    branches: list[Sample] = msgspec.field(default_factory=list)
    # filled by the env actor once the episode is verified
    task_id: str | None = None
    group_id: str | None = None
    domain: str = ""  # the task's domain (rl360.actors.reward_stats.task_domain)
    reward: Reward | None = None
    status: EpisodeStatus = "ok"
    error: str | None = None
    timings: dict[str, float] = msgspec.field(default_factory=dict)

    def record(self) -> EpisodeRecord:
        """What the controller and the buffer need of this episode: no token data."""
        picked = [self, *self.branches]  # every picked leaf is trained
        gen = [v for s in picked for v, m in zip(s.versions, s.mask, strict=True)
               if m and v is not None]
        return EpisodeRecord(
            task_id=self.task_id or "", group_id=self.group_id or "", status=self.status,
            reward=self.reward, error=self.error, tokens=sum(len(s.tokens) for s in picked),
            loss_tokens=int(sum(sum(s.mask) for s in picked)), min_version=min(gen) if gen else 0,
            max_version=max(gen) if gen else 0, timings=dict(self.timings),
            samples=len(picked), domain=self.domain,
            rerender=rerender_counts(s.rerender for s in picked))


RERENDER_KINDS = ("special_token_count", "special_token_type", "non_assistant_text",
                  "assistant_text", "eos_alias")  # the first three must stay 0 (TITO inv. 7)


def rerender_counts(checks: Any) -> dict[str, int]:
    """The ledger's re-render checks of an episode's samples (each {"match": bool, kind: n,
    "error": str}), counted: samples `checked`, `mismatch`ed, `error`s (the template could not
    re-render) and each kind's differences summed."""
    out: dict[str, int] = {}
    for c in checks:
        if not c:
            continue
        out["checked"] = out.get("checked", 0) + 1
        if c.get("match", True):
            continue
        out["mismatch"] = out.get("mismatch", 0) + 1
        if c.get("error"):
            out["error"] = out.get("error", 0) + 1
        for k in RERENDER_KINDS:
            if c.get(k):
                out[k] = out.get(k, 0) + int(c[k])
    return out


class EpisodeRecord(msgspec.Struct, omit_defaults=True):
    """The small half of a finished episode (DESIGN.md's data path): reward, status, length,
    versions. Its tokens stay in the object store behind a ref until a trainer rank fetches
    them; the controller, the buffer and the driver only ever hold these."""

    task_id: str
    group_id: str
    status: EpisodeStatus
    reward: Reward | None
    error: str | None = None
    tokens: int = 0
    loss_tokens: int = 0
    min_version: int = 0  # oldest / newest policy version among the generated tokens
    max_version: int = 0
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    samples: int = 1  # trained sequences: the primary sample plus the picked branches
    domain: str = ""  # the task's domain / family, for per-domain metrics
    # the re-render check of its samples (TITO invariant 7), counted: `rerender_counts`
    rerender: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def valid(self) -> bool:
        """Scored (not an infrastructure failure) and with tokens to train on."""
        return self.status != "infra_error" and self.reward is not None


# ----------------------------------------------------------------------------- training


class TrainSample(msgspec.Struct, omit_defaults=True):
    """One sequence for the trainer: a trajectory's tokens with its loss mask, the engine's
    sampling logprobs (0.0 where mask is 0) and a scalar advantage broadcast over its tokens."""

    tokens: list[int]
    mask: list[int]
    sampling_logprobs: list[float]
    advantage: float
    versions: list[int] = msgspec.field(default_factory=list)  # per token, -1 on prompt tokens
    reward: float = 0.0
    group_id: str = ""
    task_id: str = ""


class Batch(msgspec.Struct, omit_defaults=True):
    """A global batch for one optimizer step. `policy_version` is the trainer's version when
    the batch was cut; staleness of a token = policy_version - its version."""

    samples: list[TrainSample]
    step: int = 0
    policy_version: int = 0


# ----------------------------------------------------------------------------- backend support


class BackendSupport(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine or trainer backend can run, as plain data: `rl360 plan` and
    `rl360 preflight` check a recipe against it before anything starts, and the backend refuses
    the same things at start-up. Parallel sizes are maxima (1: not supported); an empty
    `families` means any HF causal-LM `model_type` that transformers (or the engine) loads."""

    backend: str
    devices: tuple[str, ...]  # "cpu", "cuda"
    dtypes: tuple[str, ...]
    families: tuple[str, ...] = ()  # HF model_type values; () = any
    moe: bool = True  # mixture-of-experts families (MOE_FAMILIES) allowed
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1
    remote_option: str = ""  # an engine.options key that points at a server elsewhere
    notes: str = ""


# HF model_type values of mixture-of-experts models (for BackendSupport.moe)
MOE_FAMILIES = frozenset({
    "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "olmoe", "granitemoe",
    "gpt_oss", "llama4", "jamba", "phimoe", "dbrx", "glm4_moe",
})
