"""Recipe sections of the trainer: [trainer] with [trainer.loss], [trainer.lora] and
[trainer.megatron].
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rl360.recipe.base import Niceness, NonNegFloat, NonNegInt, PosInt, Section


class LossSection(Section):
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


class LoraSection(Section):
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


class MegatronSection(Section):
    """[trainer.megatron]: the model-parallel layout of the megatron backend (GPU clusters):
    tensor x pipeline x context parallel ranks per data-parallel replica, the experts of a MoE
    split over expert_parallel. The torch and fsdp backends are data parallel only (`rl360
    plan` says what each backend supports)."""

    tensor_parallel: PosInt = 1
    pipeline_parallel: PosInt = 1
    context_parallel: PosInt = 1
    expert_parallel: PosInt = 1


class TrainerSection(Section):
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
    megatron: MegatronSection = msgspec.field(default_factory=MegatronSection)
    # low-rank adapters instead of full fine-tuning (torch, fsdp): [trainer.lora] rank, alpha,
    # dropout, targets; absent = every weight trains
    lora: LoraSection | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and not self.lora.enabled:
            self.lora = None  # off: the trainer and everything after it see no adapters
        if self.lora is not None and self.backend == "megatron":
            raise ValueError("lora: the megatron backend trains every weight; use backend "
                             "'torch' or 'fsdp' for adapters")
