"""Low-rank adapters (LoRA) on a causal LM's linear projections: the trainer's and the engine's.

A target projection `y = x W^T` becomes `y = x W^T + s * (x A^T) B^T` with W frozen, A [r, in]
and B [out, r] trainable and s = alpha / r (Hu et al., 2021; peft's `LoraConfig` defaults: A
Kaiming-uniform, B zero, so a fresh adapter changes nothing). `LoraLinear` is an `nn.Linear`
(the base weight keeps its name and its module's place) holding `lora_A` and `lora_B`, so the
model's state dict gains `<proj>.lora_A.weight` / `<proj>.lora_B.weight` beside the untouched
base names, and the engine's runner and the trainer's forward call it like the Linear it
replaces. `adapters_off` runs the base alone: the reference policy of a KL term is the same
model with its adapters off, not a second copy.

Our own module rather than peft's: peft's import brings transformers' modeling machinery
(`import peft` 5.3 CPU s against 1.8 for torch alone here), the start-up our own Llama modules
(native_llama.py) exist to avoid in the trainer and the engine replica, and its LoRA layer is
the same two matmuls (bench/trainer_step.py --lora --vs-peft prints both step times). The files
are peft's: `adapter_config.json` and `adapter_model.safetensors` with peft's tensor names
(`base_model.model.<module>.lora_A.weight`), so peft and transformers load our checkpoints
(`tests/policies/test_lora.py` checks it against peft itself).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's name of a module inside the model it wraps
LORA_KEYS = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoraSpec:
    """What shapes an adapter: rank r, alpha (the update is scaled by alpha / r), the dropout
    on its input while training, and the projection names it wraps (last name component)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, section: Any) -> LoraSpec:
        """From a recipe's `trainer.lora` section (or anything with those fields)."""
        return cls(rank=int(section.rank), alpha=float(section.alpha),
                   dropout=float(section.dropout), targets=tuple(section.targets))

    def require_like(self, other: LoraSpec, where: str) -> None:
        """ValueError unless `other` (an adapter read from `where`) has this rank, alpha and
        targets (dropout only acts while training: it may differ)."""
        if (self.rank, self.alpha, set(self.targets)) != (
                other.rank, other.alpha, set(other.targets)):
            raise ValueError(f"{where}: adapter rank {other.rank}, alpha {other.alpha:g}, "
                             f"targets {sorted(other.targets)} differ from trainer.lora's "
                             f"{self.rank}, {self.alpha:g}, {sorted(self.targets)}")

    def peft_config(self, base: str) -> dict[str, Any]:
        """adapter_config.json as peft writes it for these settings."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
            "target_modules": sorted(self.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        }


class LoraLinear(nn.Linear):
    """A Linear whose frozen weight (and bias) is the base's, plus `lora_A` [r, in] and
    `lora_B` [out, r]: forward is base(x) + s * B(A(dropout(x))), in peft's order. Dropout acts
    only where gradients are being recorded (the trainer's loss forward): every no-grad pass
    (proximal and reference scoring, the engine) sees the deterministic adapter."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        w = base.weight
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=w.device,
                                dtype=w.dtype)
        if w.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
        self.rank, self.scaling, self.dropout = rank, alpha / rank, dropout
        self.adapter_on = True

    def forward(self, x: Tensor) -> Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        if not self.adapter_on:
            return y
        if self.dropout > 0 and torch.is_grad_enabled():
            x = nn.functional.dropout(x, self.dropout, training=True)
        return y + self.lora_B(self.lora_A(x)) * self.scaling

    def delta(self) -> Tensor:
        """s * B @ A: what merging the adapter adds to the base weight."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def layer_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear modules inside the decoder layers, by qualified name (the projections an
    adapter may wrap: embeddings and the output head are not among them)."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in f".{n}" and not _is_lora_part(n)}


def _is_lora_part(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def target_names(model: nn.Module) -> list[str]:
    """The distinct last name components of `layer_linears` (q_proj, gate_proj, ...)."""
    return sorted({n.rsplit(".", 1)[-1] for n in layer_linears(model)})


def check_targets(targets: Iterable[str], available: Iterable[str],
                  key: str = "trainer.lora.targets") -> None:
    """ValueError naming the first target that is no projection of the model."""
    have = sorted(set(available))
    for t in targets:
        if t not in have:
            raise ValueError(f"{key}: {t!r} is not a linear projection of the model's decoder "
                             f"layers (they have: {', '.join(have)})")


def add_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Freeze every parameter of `model` and wrap each decoder-layer Linear whose last name
    component is in `spec.targets` in a `LoraLinear` (trainable A and B, drawn from torch's
    RNG). Returns the wrapped modules' qualified names."""
    linears = layer_linears(model)
    check_targets(spec.targets, {n.rsplit(".", 1)[-1] for n in linears})
    model.requires_grad_(False)
    wrapped = []
    for name, base in linears.items():
        if name.rsplit(".", 1)[-1] not in spec.targets or isinstance(base, LoraLinear):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoraLinear(base, spec.rank, spec.alpha, spec.dropout))
        wrapped.append(name)
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model alone for the duration (the KL reference)."""
    mods = list(lora_modules(model).values())
    before = [m.adapter_on for m in mods]
    for m in mods:
        m.adapter_on = False
    try:
        yield
    finally:
        for m, on in zip(mods, before, strict=True):
            m.adapter_on = on


def is_lora_key(name: str) -> bool:
    return name.endswith(LORA_KEYS)


def adapter_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of a model state dict (`<proj>.lora_A.weight`, `<proj>.lora_B.weight`)."""
    return {k: v for k, v in state.items() if is_lora_key(k)}


def merged_state(state: Mapping[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """A state dict of a model with adapters as the plain model's: every adapted weight
    replaced by W + s * B @ A (fp32 arithmetic, cast back), the adapter tensors left out.
    Tensors that are not adapted are passed through as they are (not copied)."""
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        if is_lora_key(k):
            continue
        mod = k[: -len(".weight")] if k.endswith(".weight") else None
        a = state.get(f"{mod}.lora_A.weight") if mod is not None else None
        if a is None:
            out[k] = v
            continue
        out[k] = merged_weight(v, a, state[f"{mod}.lora_B.weight"], scaling)
    return out


def merged_weight(w: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """W + s * B @ A in fp32, cast back to W's dtype: the one definition of a merged weight
    (the trainer's merged sync, the torch engine's adapter versions and `rl360 merge`'s give
    the same bits for the same inputs)."""
    return (w.float() + (b.float() @ a.float()) * scaling).to(w.dtype)


def adapter_numel(spec: LoraSpec, shapes: Mapping[str, tuple[int, int]]) -> int:
    """Parameters of an adapter over the Linear modules `shapes` (name -> (out, in)) it wraps."""
    return sum(spec.rank * (o + i) for n, (o, i) in shapes.items()
               if n.rsplit(".", 1)[-1] in spec.targets)


# ----------------------------------------------------------------------------- files


def is_adapter_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and (p / ADAPTER_WEIGHTS).is_file()


def save_adapter(out: str | Path, tensors: Mapping[str, Tensor], spec: LoraSpec,
                 base: str) -> Path:
    """`tensors` (model names, `...lora_A.weight`) as a peft adapter directory."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {PEFT_PREFIX + k: v.detach().to("cpu").contiguous().clone()
             for k, v in tensors.items()}
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(spec.peft_config(base), indent=2) + "\n")
    return out


@dataclass(frozen=True)
class Adapter:
    """An adapter directory read back: its spec, its base model and its tensors (model names)."""

    spec: LoraSpec
    base: str
    tensors: dict[str, Tensor]


def read_adapter_config(path: str | Path) -> tuple[LoraSpec, str]:
    p = Path(path) / ADAPTER_CONFIG
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p}: not a readable adapter config ({exc})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{p}: not a LoRA adapter config (peft_type "
                         f"{cfg.get('peft_type') if isinstance(cfg, dict) else None!r})")
    for unsupported in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(unsupported):
            raise ValueError(f"{p}: {unsupported} = true is not supported (plain LoRA only)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{p}: per-module rank_pattern / alpha_pattern are not supported")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{p}: target_modules as a regular expression is not supported")
    spec = LoraSpec(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)),
                    dropout=float(cfg.get("lora_dropout", 0.0) or 0.0), targets=tuple(targets))
    return spec, str(cfg.get("base_model_name_or_path") or "")


def read_adapter(path: str | Path) -> Adapter:
    from safetensors.torch import load_file

    spec, base = read_adapter_config(path)
    raw = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    tensors = {}
    for k, v in raw.items():
        name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        if not is_lora_key(name):
            raise ValueError(f"{path}: {k!r} is not a LoRA A/B tensor (bias or modules_to_save "
                             "adapters are not supported)")
        tensors[name] = v
    return Adapter(spec, base, tensors)


def load_adapter_tensors(model: nn.Module, tensors: Mapping[str, Tensor],
                         where: str = "adapter") -> None:
    """Copy adapter tensors into the model's LoraLinear modules (same set of names and shapes,
    or a ValueError naming the first difference)."""
    own = {f"{n}.{p}.weight": getattr(m, p).weight
           for n, m in lora_modules(model).items() for p in ("lora_A", "lora_B")}
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"{where}: tensors do not match the model's adapters (missing "
                         f"{missing[:2]}, unexpected {extra[:2]})")
    with torch.no_grad():
        for k, p in own.items():
            t = tensors[k]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{where}: {k} has shape {tuple(t.shape)}, the model's adapter "
                                 f"{tuple(p.shape)}")
            p.copy_(t)
