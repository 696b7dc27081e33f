"""The torch trainer backend: one HF causal LM, AdamW steps over a global batch.

`train_step(batch)` cuts the batch into micro-batches (right-padded, sorted by length), runs
forward + backward on each with the configured policy loss and reducer, accumulating
gradients; the reducer divides by the GLOBAL batch's token / sequence counts, so the step
does not depend on the micro-batch size or on how the batch is split over data-parallel ranks.
When torch.distributed is initialized with world size > 1 (the trainer group does that),
gradients are summed across ranks (not averaged: the global denominators already make the
sum exact) before clipping and the optimizer step, so every rank takes the identical step.

Decoupled PPO. Three policies meet in the loss: the behaviour policy (the engines' sampling
logprobs, per token, whatever version produced it), the proximal policy ("old": these weights
when the batch starts) and the current one. The PPO/GSPO ratio is current/proximal and is
clipped; the importance weight proximal/behaviour is truncated at `tis_cap` (TIS). With one
optimizer step per batch (trainer.minibatches = epochs = 1) proximal == current, so old is the
current logprobs, detached, from the same forward (no second pass) and the ratio is 1; with
more steps the proximal logprobs are scored once, before the first step, and the clip acts.
Each minibatch's reducer divides by that minibatch's global counts.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl360.policies.affinity import pin_to_cpus, set_niceness
from rl360.policies.batching import MicroBatch, StepMetrics, split_even, validate_samples
from rl360.policies.devices import Placement, select_device
from rl360.policies.lora import (
    ADAPTER_CONFIG,
    LoraSpec,
    adapters_off,
    add_lora,
    is_adapter_dir,
    load_adapter_tensors,
    read_adapter,
    read_adapter_config,
)
from rl360.policies.losses import PolicyLoss, build_policy_loss, entropy_from_logits
from rl360.policies.native_llama import load_native_llama, native_config
from rl360.policies.reducers import Reducer, build_reducer, global_denominators
from rl360.policies.shared_prefix import PrefixLayout
from rl360.policies.token_logprobs import linear_logprobs, plain_head
from rl360.policies.trainer_state import STATE_FILE, TrainerState
from rl360.recipe import TrainerSection
from rl360.types import Batch, TrainSample

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_NOT_COPIED = {"config.json", "generation_config.json", STATE_FILE, ADAPTER_CONFIG}
_BUCKET_NUMEL = 8 * 1024 * 1024  # gradient all-reduce bucket (elements)


class TorchTrainer(TrainerState):
    native_model_ok = True  # may hold our own Llama modules (backends that shard: False)
    fused_head_ok = True  # may run loss positions through the head alone (`_token_logprobs`)

    def __init__(self, config: TrainerSection, model_path: str | Path, *,
                 temperature: float = 1.0, seed: int = 0) -> None:
        """`temperature`: the engines' sampling temperature (logits are divided by it, as the
        engines sampled); `seed`: the run's seed."""
        self._init_common(config, model_path, temperature, seed)
        gpus = 0.0 if config.device == "cpu" else config.num_gpus
        self.placement: Placement = select_device(gpus, config.dtype,
                                                  gpus_key="trainer.num_gpus",
                                                  dtype_key="trainer.dtype")
        self.device = self.placement.device
        model = self._load_pretrained()
        # tokenizer / template files, read now: the directory we loaded from may be an older
        # checkpoint that checkpoint rotation deletes before our next save
        self._side_files = {
            f.name: f.read_bytes() for f in self.model_path.iterdir()
            if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_SUFFIXES)
        }
        model.train(False)  # no dropout: old == current must hold exactly
        if config.gradient_checkpointing:  # non-reentrant: the kind FSDP2 composes with
            enable = (getattr(model, "activation_checkpointing_enable", None)  # transformers 5
                      or model.gradient_checkpointing_enable)
            enable({"use_reentrant": False})
        cfg = model.config
        self._add_adapters(model)
        self.model = self._place(model)
        self.shared_prefix = self.shared_prefix and hasattr(
            getattr(self.model, "get_decoder", lambda: None)(), "forward_shared")
        self._setup_optimization(config)
        if self.loss_fn.needs_reference and self.lora is not None:
            self.reference = self.model  # the base: the same model with its adapters off
        elif self.loss_fn.needs_reference:
            ref = self._load_pretrained()
            self.reference = self._place(ref.train(False).requires_grad_(False))
        self.vocab = int(cfg.vocab_size)
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        self.step = 0

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: the ranks whose gradients, losses and metrics are summed."""
        return dist.get_world_size(self.dp_group) if dist.is_initialized() else 1

    @property
    def dp_group(self) -> Any:
        """The data-parallel process group (None: the default group, every rank is one).
        Backends with model parallelism override this."""
        return None

    def _init_common(self, config: TrainerSection, model_path: str | Path, temperature: float,
                     seed: int) -> None:
        """Config, threads and seeds: the start of every backend built on this class."""
        if temperature <= 0:
            raise ValueError(f"trainer temperature must be > 0 (the sampling temperature), "
                             f"got {temperature}")
        self.config = config
        self.temperature = temperature
        self.seed = seed
        # loss positions only through a plain output head (backends whose head weight is
        # sharded outside its own forward set fused_head_ok = False)
        self.fused_logprobs = config.fused_logprobs and self.fused_head_ok
        # shared prompts run once: on our own Llama modules, checked once the model is built
        self.shared_prefix = (config.shared_prefix and self.fused_logprobs
                              and not config.attention_mask)
        self.model_path = Path(model_path)
        self._lora_paths(config)
        pin_to_cpus(config.cpu_affinity, "trainer.cpu_affinity")
        set_niceness(config.nice, "trainer.nice")
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        torch.manual_seed(seed)
        random.seed(seed)

    def _lora_paths(self, config: TrainerSection) -> None:
        """`trainer.lora`: the adapter spec, and when the model path is an adapter directory
        (a LoRA checkpoint: a resumed run's policy) its base becomes the model path and its
        tensors the adapters' starting values."""
        self.lora = LoraSpec.of(config.lora) if config.lora is not None else None
        self.adapter_init: Path | None = None
        if not is_adapter_dir(self.model_path):
            return
        spec, base = read_adapter_config(self.model_path)
        if self.lora is None:
            raise ValueError(f"{self.model_path} is a LoRA adapter (base {base!r}): train it "
                             "with [trainer.lora], or merge it into its base (rl360 merge)")
        self.lora.require_like(spec, str(self.model_path))
        if not base or not (Path(base) / "config.json").is_file():
            raise ValueError(f"{self.model_path}: the adapter's base model {base!r} is not a "
                             "model directory here")
        self.adapter_init, self.model_path = self.model_path, Path(base)

    def _add_adapters(self, model: Any) -> None:
        """Wrap the target projections in adapters (every other weight frozen); from the
        adapter checkpoint the trainer was built from, if any. A model on the meta device (a
        sharded backend's rank > 0) gets its values from rank 0 when placed."""
        if self.lora is None:
            return
        add_lora(model, self.lora)
        if self.adapter_init is not None and next(model.parameters()).device.type != "meta":
            load_adapter_tensors(model, read_adapter(self.adapter_init).tensors,
                                 str(self.adapter_init))

    def _reference_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Where the reference policy runs: the base alone when it is the adapted model."""
        return adapters_off(self.model) if self.lora is not None else contextlib.nullcontext()

    def _setup_optimization(self, config: TrainerSection) -> None:
        """AdamW over the trainable parameters with linear warm-up, the policy loss and the
        reducer (shared by every trainer backend built on this class)."""
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=config.betas, eps=config.adam_eps,
            weight_decay=config.weight_decay, foreach=True,
        )
        warm = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        self.loss_fn: PolicyLoss = build_policy_loss(config.loss)
        self.reducer: Reducer = build_reducer(config.loss.reducer, config.loss.norm_length)
        self.reference: Any = None

    def _load_pretrained(self, path: Path | None = None) -> Any:
        """The model at `path` (default model_path) in fp32 on the CPU: our own Llama modules
        (policies/native_llama.py: no transformers modeling import, ~1.5 CPU s of start-up)
        for a plain Llama checkpoint when `trainer.native_llama` and the backend allow it and neither
        gradient checkpointing nor an explicit padding mask is asked for; else transformers'.
        Backends that shard may skip the weights."""
        path = path or self.model_path
        c = self.config
        cfg = (native_config(path) if self.native_model_ok and c.native_llama
               and not c.gradient_checkpointing and not c.attention_mask else None)
        if cfg is not None:
            return load_native_llama(path, cfg, torch.float32, torch.device("cpu"))
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def _place(self, model: Any) -> Any:
        """Put a freshly loaded fp32 model where it computes (backends that shard override)."""
        return model.to(self.device)

    # ------------------------------------------------------------------ training

    def train_step(
        self, batch: Batch, global_tokens: int | None = None, global_seqs: int | None = None
    ) -> dict[str, float]:
        """`trainer.epochs` passes over the batch cut into `trainer.minibatches` parts, one
        optimizer step per part. With more than one step the proximal policy (these weights
        when the batch starts) is scored once first, so the PPO/GSPO ratio of later steps is
        current/proximal and the clip acts; the truncated IS weight stays proximal/behaviour
        (decoupled PPO). `global_tokens/seqs`: the whole batch's loss-token and sequence counts
        over every data-parallel rank (computed here when not given)."""
        t0 = time.perf_counter()
        samples = batch.samples
        validate_samples(samples, self.vocab)
        local_tokens, local_seqs = global_denominators(s.mask for s in samples)
        parts = split_even(list(range(len(samples))), self.config.minibatches)
        counts = torch.tensor([list(global_denominators(samples[i].mask for i in part))
                               for part in parts], dtype=torch.long)
        if len(parts) == 1 and global_tokens is not None and global_seqs is not None:
            counts[0] = torch.tensor([global_tokens, global_seqs])
        elif self.world_size > 1:
            dist.all_reduce(counts, group=self.dp_group)
        proximal = (self._proximal_logprobs(samples)
                    if len(parts) * self.config.epochs > 1 else None)
        acc = StepMetrics()
        losses: list[float] = []
        norms: list[float] = []
        skipped = 0
        lr = self.optimizer.param_groups[0]["lr"]
        for _epoch in range(self.config.epochs):
            for part, (gt, gs) in zip(parts, counts.tolist(), strict=True):
                loss, norm, ok = self._optimizer_step(samples, part, proximal, acc, gt, gs)
                losses.append(loss)
                norms.append(norm)
                skipped += not ok
        self._add_batch_metrics(batch, acc)
        if self.world_size > 1:
            acc.all_reduce(self.dp_group)
        metrics = acc.result()
        g_tokens, g_seqs = (int(x) for x in counts.sum(dim=0).tolist())
        metrics.update(
            zero_adv_skipped=float(len(samples) - len(self._samples_with_gradient(samples))),
            loss=sum(losses) / len(losses), grad_norm=max(norms), lr=float(lr),
            skipped=float(skipped), step=float(self.step), tokens=float(g_tokens),
            seqs=float(g_seqs), local_tokens=float(local_tokens), local_seqs=float(local_seqs),
            optimizer_steps=float(len(losses) - skipped), step_time_s=time.perf_counter() - t0,
        )
        return metrics

    def _optimizer_step(self, samples: list[TrainSample], part: list[int],
                        proximal: dict[int, Tensor] | None, acc: StepMetrics,
                        global_tokens: int, global_seqs: int) -> tuple[float, float, bool]:
        """Forward/backward over the samples `part` (micro-batched; denominators of the whole
        part over every rank), gradients summed over ranks, clipped, one AdamW step.
        Returns (loss, grad norm, stepped)."""
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)
        work = self._samples_with_gradient([samples[i] for i in part])
        index = {id(s): i for i, s in zip(part, (samples[i] for i in part), strict=True)}
        if global_tokens > 0:
            for mb in self._micro_batches(work, proximal, index):
                loss_total += self._forward_backward(mb, acc, global_tokens, global_seqs)
        if self.world_size > 1:
            self._all_reduce_grads()
            dist.all_reduce(loss_total, group=self.dp_group)
        grad_norm = self._clip()
        finite = bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss_total))
        ok = global_tokens > 0 and finite
        if ok:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss_total), float(grad_norm), ok

    @torch.no_grad()
    def _proximal_logprobs(self, samples: list[TrainSample]) -> dict[int, Tensor]:
        """The current policy's logprob of every target token, per sample index: the proximal
        policy of this batch's optimizer steps."""
        out: dict[int, Tensor] = {}
        index = {id(s): i for i, s in enumerate(samples)}
        for mb in self._micro_batches(samples, None, index):
            logprobs, _ = self._token_logprobs(self.model, mb)
            for r, i in enumerate(mb.rows):
                out[i] = logprobs[r, : len(samples[i].tokens) - 1].to("cpu", copy=True)
        return out

    def _samples_with_gradient(self, samples: list[TrainSample]) -> list[TrainSample]:
        """The samples whose forward/backward can change the step. Every policy loss here is
        advantage-weighted, so a sample with advantage 0 (a group where every attempt scored
        the same, e.g. an agent task nobody solves) has exactly zero gradient unless a KL term
        pulls it to the reference (or an entropy bonus acts): it is skipped, but stays in the global denominators, so the
        step is the one the whole batch gives. Its tokens are then missing from the entropy /
        mismatch metrics (counted in `zero_adv_skipped`). An entropy bonus, like KL, has a
        gradient on every sample."""
        if self.config.loss.kl_coef > 0 or self.config.loss.entropy_coef > 0:
            return samples
        return [s for s in samples if s.advantage != 0.0]

    def _chunks(self, samples: list[TrainSample]) -> Iterator[list[TrainSample]]:
        """Longest first; a micro-batch holds at most micro_batch_size sequences and, when
        micro_batch_tokens > 0, at most that many tokens with padding (so a few long
        multi-turn trajectories do not pad a whole micro-batch to their length)."""
        if self.shared_prefix:  # a prompt's samples side by side (then longest first)
            order = sorted(samples, key=lambda s: (_prompt(s), -len(s.tokens)))
        else:
            order = sorted(samples, key=lambda s: -len(s.tokens))
        size, budget = self.config.micro_batch_size, self.config.micro_batch_tokens
        chunk: list[TrainSample] = []
        for s in order:
            width = len(chunk[0].tokens) if chunk else len(s.tokens)
            if chunk and (len(chunk) >= size or (budget and (len(chunk) + 1) * width > budget)):
                yield chunk
                chunk = []
            chunk.append(s)
        if chunk:
            yield chunk

    def _micro_batches(self, samples: list[TrainSample], proximal: dict[int, Tensor] | None = None,
                       index: dict[int, int] | None = None) -> Iterator[MicroBatch]:
        """Right-padded micro-batches; `proximal` (sample index -> target logprobs, looked up
        through `index`: id(sample) -> index) fills `old` when the batch takes several steps."""
        for chunk in self._chunks(samples):
            width = max(len(s.tokens) for s in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.float32)
            samp = torch.zeros((len(chunk), width), dtype=torch.float32)
            old, rows = self._proximal_rows(chunk, width, proximal, index)
            for r, s in enumerate(chunk):
                n = len(s.tokens)
                ids[r, :n] = torch.tensor(s.tokens, dtype=torch.long)
                attn[r, :n] = 1
                mask[r, :n] = torch.tensor(s.mask, dtype=torch.float32)
                samp[r, :n] = torch.tensor(s.sampling_logprobs, dtype=torch.float32)
            adv = torch.tensor([s.advantage for s in chunk], dtype=torch.float32)
            prefix = (PrefixLayout.of([s.tokens for s in chunk], [s.mask for s in chunk], width,
                                      self.pad_id) if self.shared_prefix else None)
            yield MicroBatch(ids, attn, mask[:, 1:], samp[:, 1:], adv, old, rows,
                             prefix=prefix).to(self.device)

    @staticmethod
    def _proximal_rows(chunk: list[TrainSample], width: int, proximal: dict[int, Tensor] | None,
                       index: dict[int, int] | None) -> tuple[Tensor | None, list[int]]:
        """The chunk's sample indices in the batch and, when the batch takes several steps,
        their proximal logprobs in the padded [B, width-1] layout (else None)."""
        rows = [index[id(s)] if index is not None else r for r, s in enumerate(chunk)]
        if not proximal:
            return None, rows
        old = torch.zeros((len(chunk), width - 1), dtype=torch.float32)
        for r, s in enumerate(chunk):
            old[r, : len(s.tokens) - 1] = proximal[rows[r]]
        return old, rows

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _logits(self, model: Any, mb: MicroBatch) -> Tensor:
        """Logits of every position but the last, as the model saw them ([R, W-1, V])."""
        with self._autocast():
            if mb.positions is not None:  # packed: no mask, positions restart per sequence
                out = model(input_ids=mb.ids, position_ids=mb.positions, use_cache=False)
            else:
                attn = mb.attn if self.config.attention_mask else None
                out = model(input_ids=mb.ids, attention_mask=attn, use_cache=False)
        return out.logits[:, :-1].float() / self.temperature

    def _token_logprobs(self, model: Any, mb: MicroBatch,
                        entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        """The logprob of every target and the entropy of its distribution, in the padded
        [B, L-1] layout. With `trainer.fused_logprobs`, a plain output head
        (`token_logprobs.plain_head`) and right-padded rows, only the loss positions go
        through the head, chunked (`linear_logprobs`; 0 elsewhere, which every loss masks);
        otherwise (packed rows, megatron) from the full logits. `entropy_grad`: the entropy is
        differentiated (an entropy bonus)."""
        head = plain_head(model) if self.fused_logprobs and mb.positions is None else None
        if head is None:
            logits = self._logits(model, mb)
            logprobs = mb.padded(self._target_logprobs(logits, mb.ids))
            with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                entropy = mb.padded(entropy_from_logits(logits))
            return logprobs, entropy
        with self._autocast():
            if mb.prefix is not None:
                hidden = model.get_decoder().forward_shared(mb.prefix)
            else:
                attn = mb.attn if self.config.attention_mask else None
                hidden = model.get_decoder()(input_ids=mb.ids, attention_mask=attn,
                                             use_cache=False).last_hidden_state
        sel = mb.mask > 0
        h, targets = hidden[:, :-1][sel], mb.ids[:, 1:][sel]
        logp, ent = linear_logprobs(h, head.weight, targets, 1.0 / self.temperature)
        if not entropy_grad:
            ent = ent.detach()
        zeros = torch.zeros(sel.shape, dtype=torch.float32, device=logp.device)
        return zeros.masked_scatter(sel, logp), zeros.masked_scatter(sel, ent)

    @staticmethod
    def _target_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
        targets = ids[:, 1:].unsqueeze(-1)
        return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)

    def _forward_backward(
        self, mb: MicroBatch, acc: StepMetrics, global_tokens: int, global_seqs: int
    ) -> Tensor:
        n_tok = float(mb.mask.sum())
        if n_tok == 0:
            return torch.zeros((), dtype=torch.float64)
        ref_logprobs = None
        if self.reference is not None:
            with torch.no_grad(), self._reference_scope():
                ref_logprobs, _ = self._token_logprobs(self.reference, mb)
        bonus_coef = self.config.loss.entropy_coef
        logprobs, entropy = self._token_logprobs(self.model, mb, entropy_grad=bonus_coef > 0)
        old = mb.old if mb.old is not None else logprobs.detach()
        per_token, metrics = self.loss_fn(logprobs, old, mb.sampling, mb.adv, mb.mask, ref_logprobs)
        if bonus_coef > 0:
            per_token = per_token - bonus_coef * entropy * mb.mask
        loss = self.reducer(per_token, mb.mask, global_tokens=global_tokens, global_seqs=global_seqs)
        loss.backward()
        with torch.no_grad():
            m = mb.mask
            metrics["entropy"] = (entropy.detach() * m).sum() / n_tok
            metrics["logprob_mean"] = (logprobs.detach() * m).sum() / n_tok
        acc.add(metrics, n_tok)
        return loss.detach().to(torch.float64)

    def _add_batch_metrics(self, batch: Batch, acc: StepMetrics) -> None:
        """advantage/reward/staleness means over loss tokens; staleness max."""
        for s in batch.samples:
            n = float(sum(s.mask))
            if n == 0:
                continue
            acc.add({"advantage_mean": s.advantage, "reward_mean": s.reward}, n)
            if s.versions:
                stale = [batch.policy_version - v
                         for v, m in zip(s.versions, s.mask, strict=False) if m and v >= 0]
                if stale:
                    acc.add({"staleness_mean": sum(stale) / len(stale),
                             "staleness_max": max(stale)}, float(len(stale)))

    def _all_reduce_grads(self) -> None:
        """Sum gradients over ranks, bucketed (a rank without samples contributes zeros)."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket: list[Tensor] = []
        numel = 0
        for g in [*grads, None]:
            if g is not None:
                bucket.append(g)
                numel += g.numel()
            if bucket and (g is None or numel >= _BUCKET_NUMEL):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.all_reduce(flat, group=self.dp_group)
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
                bucket, numel = [], 0

    def _clip(self) -> Tensor:
        grads = [p for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)


def _prompt(s: TrainSample) -> tuple[int, ...]:
    """The tokens before a sample's first generated token (its group's shared prompt)."""
    first = s.mask.index(1) if 1 in s.mask else len(s.tokens)
    return tuple(s.tokens[:first])
