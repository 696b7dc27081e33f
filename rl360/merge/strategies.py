"""Merge methods as streaming strategies: the factory `build_method(cfg, weights)` and the
registry `METHODS` (recipe method name -> class).

A strategy sees one tensor at a time (`Group`: the base in fp32 and each expert's task vector)
and applies the pure kernels of `methods` / `iso` to flat chunks of it. Methods that need
whole-model statistics declare `passes`: the runner streams the model `passes` times first,
calling `collect` per tensor, adding the partial results (`add_partials`, order-independent
integer counts) and handing the total to `finish`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from rl360.merge import kth, ulp
from rl360.merge import methods as K
from rl360.merge import recipe as R
from rl360.merge.errors import MergeError
from rl360.merge.iso import iso_c, iso_cts

if TYPE_CHECKING:
    import torch

Kernel = Callable[[list["torch.Tensor"], "list[torch.Tensor] | None", int], K.Merged]
Parts = Iterator[tuple[slice, K.Merged]]  # (slice of the flattened tensor, its merged delta)


@dataclass
class Group:
    """One parameter: the base in fp32, the experts' task vectors (fp32), optional gates."""

    name: str
    shape: tuple[int, ...]
    base32: torch.Tensor
    taus: list[torch.Tensor]
    gates: list[torch.Tensor] | None = None
    zeros: int = 0  # entries left out because every task vector is 0 there (sparse loading)

    @property
    def numel(self) -> int:
        return self.taus[0].numel() + self.zeros


def add_partials(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, (list, tuple)):
        return type(a)(add_partials(x, y) for x, y in zip(a, b, strict=True))
    return a + b


class Method:
    name: ClassVar[str]
    fp32_default: ClassVar[bool] = False  # a bf16 save would erase this method's updates
    uses_gates: ClassVar[bool] = False
    # elementwise given per-tensor constants, and all-zero task vectors merge to a zero delta:
    # the runner may hand it only the entries some expert changed (rl360/merge/sparse.py)
    sparse: ClassVar[bool] = True

    def __init__(self, cfg: Any, weights: Sequence[float], chunk: int = 1 << 18) -> None:
        self.cfg = cfg
        self.weights = [float(w) for w in weights]
        self.n = len(self.weights)
        self.chunk = chunk
        self.passes = 0
        self.snap = False

    # --- streaming hooks ---------------------------------------------------------------
    def out_dtype(self, base_code: str) -> str:
        return "F32" if self.fp32_default else base_code

    def gate(
        self, name: str, base_raw: torch.Tensor, expert_raw: torch.Tensor
    ) -> torch.Tensor | None:
        return None

    def collect(self, p: int, g: Group) -> Any:
        raise NotImplementedError

    def finish(self, p: int, total: Any) -> None:
        raise NotImplementedError

    def merge(self, g: Group) -> Parts:
        raise NotImplementedError

    def rerun(self, counts: list[int]) -> bool:
        """Given the merge pass's Stats.method_counts: run the merge pass again?"""
        return False

    # --- helpers -----------------------------------------------------------------------
    def slices(self, numel: int) -> list[slice]:
        return [slice(s, min(s + self.chunk, numel)) for s in range(0, max(numel, 1), self.chunk)]

    def chunked(self, g: Group, fn: Kernel) -> Parts:
        """Apply a kernel chunk by chunk over the flattened tensor, yielding each chunk's
        merged delta (the runner writes it out before the next one is computed)."""
        flat = [t.reshape(-1) for t in g.taus]
        gates = [m.reshape(-1) for m in g.gates] if g.gates is not None else None
        for ci, sl in enumerate(self.slices(flat[0].numel())):
            yield sl, fn([t[sl] for t in flat], [m[sl] for m in gates] if gates else None, ci)

    def over_chunks(self, g: Group, fn: Callable[[list[torch.Tensor], int], Any]) -> Any:
        flat = [t.reshape(-1) for t in g.taus]
        total = None
        for ci, sl in enumerate(self.slices(flat[0].numel())):
            total = add_partials(total, fn([t[sl] for t in flat], ci))
        return total

    def gram(self, g: Group) -> np.ndarray:
        return self.over_chunks(g, lambda taus, _ci: K.gram_matrix(taus))


class Soup(Method):
    name = "soup"

    def merge(self, g: Group) -> Parts:
        return self.chunked(g, lambda t, _m, _c: K.soup(t, self.weights))


class TaskArithmetic(Method):
    name = "task_arithmetic"

    def merge(self, g: Group) -> Parts:
        c = self.cfg
        return self.chunked(
            g, lambda t, _m, _c: K.task_arithmetic(t, self.weights, c.lam, c.normalize)
        )


class Ties(Method):
    """TIES. scope "model": the paper's trim over the whole flattened model (exact k-th value
    by a radix select: a coarse pass, and a fine one only when the coarse bin holding the cut
    holds several values) and majority-sign fallback: the merge pass assumes +, counts the
    signs and the entries where the fallback applies, and is run again in the rare case that
    some exist and the majority is not +. scope "tensor": mergekit's per-tensor top-k (ties at
    the cut-off are all kept) with zero sum counted +."""

    name = "ties"

    def __init__(self, cfg: Any, weights: Sequence[float], chunk: int = 1 << 18) -> None:
        super().__init__(cfg, weights, chunk)
        self.model_scope = cfg.scope == "model"
        self.passes = 1 if self.model_scope else 0
        self.bins: list[tuple[int, int] | None] = []
        self.thresholds: list[float] = []
        self.zero_sign = 1.0

    def collect(self, p: int, g: Group) -> Any:
        if p == 0:
            inexact = self.over_chunks(g, lambda taus, _c: [kth.inexact_hist(t) for t in taus])
            return self._coarse(g), inexact
        return self._fine(g, [b[0] if b else None for b in self.bins])

    def _coarse(self, g: Group) -> list[np.ndarray]:
        hists = self.over_chunks(g, lambda taus, _c: [kth.coarse_hist(t) for t in taus])
        for h in hists:
            h[0] += g.zeros  # |0| has the all-zero bit pattern
        return hists

    def _fine(self, g: Group, his: list[int | None]) -> list[np.ndarray]:
        hists = self.over_chunks(g, lambda taus, _c: [
            kth.fine_hist(t, hi) if hi is not None else np.zeros(kth.BINS, np.int64)
            for t, hi in zip(taus, his, strict=True)])  # fmt: skip
        for h, hi in zip(hists, his, strict=True):
            if hi == 0:
                h[0] += g.zeros
        return hists

    def finish(self, p: int, total: Any) -> None:
        if p == 0:
            coarse, inexact = total
            d = int(coarse[0].sum())
            rank = kth.paper_rank(d, self.cfg.density)
            bins = [kth.locate(h, rank) if rank >= 1 else None for h in coarse]
            # a bin without inexact entries holds the one value (hi << 16): exact already
            self.thresholds = [kth.value(b[0], 0) if b else 0.0 for b in bins]
            self.bins = [b if b and x[b[0]] else None for b, x in zip(bins, inexact, strict=True)]
            self.passes = 2 if any(self.bins) else 1
        elif p == 1:
            for i, (h, b) in enumerate(zip(total, self.bins, strict=True)):
                if b:
                    self.thresholds[i] = kth.value(b[0], kth.locate(h, b[1])[0])

    def rerun(self, counts: list[int]) -> bool:
        """After a model-scope merge pass run with the + fallback: if entries needed the
        fallback and the model's majority sign is not +, set it and ask for the pass again."""
        if not self.model_scope or not counts:
            return False
        sign_sum, fallback = counts
        sign = float(np.sign(sign_sum))
        if fallback and sign != self.zero_sign:
            self.zero_sign = sign
            return True
        return False

    def tensor_thresholds(self, g: Group) -> list[float]:
        numel = g.numel
        rank = kth.topk_rank(numel, self.cfg.density)
        if rank < 1:
            return [0.0] * self.n
        if rank > numel:
            return [float("inf")] * self.n
        bins = [kth.locate(h, rank) for h in self._coarse(g)]
        fine = self._fine(g, [b[0] for b in bins])
        return [kth.value(b[0], kth.locate(h, b[1])[0]) for h, b in zip(fine, bins, strict=True)]

    def merge(self, g: Group) -> Parts:
        thr = self.thresholds if self.model_scope else self.tensor_thresholds(g)

        def kernel(taus: list[torch.Tensor], _m: Any, _c: int) -> K.Merged:
            import torch

            trimmed = [K.trim(t, x) for t, x in zip(taus, thr, strict=True)]
            merged = K.ties_consensus(trimmed, self.weights, self.cfg.lam, True, self.zero_sign)
            if not self.model_scope:
                return merged
            total = torch.zeros_like(trimmed[0])
            anyone = torch.zeros(total.shape, dtype=torch.bool)
            for t, w in zip(trimmed, self.weights, strict=True):
                total.add_(t, alpha=w)
                anyone |= t != 0
            fallback = int((anyone & (total == 0)).sum())
            return merged._replace(counts=(int(torch.sign(total).sum()), fallback))

        return self.chunked(g, kernel)


def _seed(seed: int, name: str, expert: int, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}\0{expert}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DareLinear(Method):
    """DARE: Bernoulli(density) keep masks seeded by (seed, tensor, expert, chunk), rescaled by
    1/density (paper), mergekit's L1 ratio, or not at all; then task arithmetic."""

    name = "dare_linear"
    sparse = False  # the keep masks are drawn per chunk of the whole tensor

    def keep(self, name: str, expert: int, chunk: int, n: int) -> torch.Tensor:
        import torch

        gen = torch.Generator().manual_seed(_seed(self.cfg.seed, name, expert, chunk))
        return torch.rand(n, generator=gen) < self.cfg.density

    def factors(self, g: Group) -> list[float]:
        if self.cfg.rescale == "paper":
            return [K.dare_paper_factor(self.cfg.density)] * self.n
        if self.cfg.rescale == "none":
            return [1.0] * self.n

        def norms(taus: list[torch.Tensor], ci: int) -> list[np.ndarray]:
            return [np.array([K._l1(t), K._l1(t * self.keep(g.name, i, ci, t.numel()))])
                    for i, t in enumerate(taus)]  # fmt: skip

        total = self.over_chunks(g, norms)
        return [float(a / b) if a >= 1e-7 and b >= 1e-7 else 1.0 for a, b in total]

    def combine(self, dropped: list[torch.Tensor]) -> K.Merged:
        return K.linear(dropped, [self.cfg.lam * w for w in self.weights])

    def merge(self, g: Group) -> Parts:
        f = self.factors(g)

        def kernel(taus: list[torch.Tensor], _m: Any, ci: int) -> K.Merged:
            dropped = [
                K.dare_drop(t, self.keep(g.name, i, ci, t.numel()), f[i])
                for i, t in enumerate(taus)
            ]
            return self.combine(dropped)

        return self.chunked(g, kernel)


class DareTies(DareLinear):
    name = "dare_ties"

    def combine(self, dropped: list[torch.Tensor]) -> K.Merged:
        return K.ties_consensus(dropped, self.weights, self.cfg.lam, self.cfg.normalize, 1.0)


class Ram(Method):
    """RAM and RAM+ (and, with gates, ULP-gate): mean over active experts where they overlap,
    the full (RAM+: rescaled) value where one expert alone changed the entry."""

    name = "ram"
    fp32_default = True

    def __init__(self, cfg: Any, weights: Sequence[float], chunk: int = 1 << 18) -> None:
        super().__init__(cfg, weights, chunk)
        self.rescale = getattr(cfg, "rescale_factor", 1.0) != 1.0
        self.model_scope = getattr(cfg, "scope", "tensor") == "model"
        self.passes = 1 if self.rescale and self.model_scope else 0
        self.lambdas = [1.0] * self.n

    def masks(
        self, taus: list[torch.Tensor], gates: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        return gates if gates is not None else K.active_masks(taus, self.cfg.epsilon)

    def counts(self, g: Group) -> tuple[np.ndarray, np.ndarray]:
        flat = [m.reshape(-1) for m in g.gates] if g.gates is not None else None
        s_tot, u_tot = np.zeros(self.n, np.int64), np.zeros(self.n, np.int64)
        for sl in self.slices(g.taus[0].numel()):
            taus = [t.reshape(-1)[sl] for t in g.taus]
            s, u = K.ram_counts(self.masks(taus, [m[sl] for m in flat] if flat else None))
            s_tot += s
            u_tot += u
        return s_tot, u_tot

    def collect(self, p: int, g: Group) -> Any:
        return self.counts(g)

    def finish(self, p: int, total: Any) -> None:
        self.lambdas = K.ram_plus_lambdas(*total, self.cfg.rescale_factor, self.cfg.alpha)

    def merge(self, g: Group) -> Parts:
        lambdas = self.lambdas
        if self.rescale and not self.model_scope:
            lambdas = K.ram_plus_lambdas(*self.counts(g), self.cfg.rescale_factor, self.cfg.alpha)
        return self.chunked(
            g, lambda t, m, _c: K.ram(t, self.weights, 0.0, lambdas, self.masks(t, m))
        )


class RamPlus(Ram):
    name = "ram_plus"


class UlpGate(Ram):
    """ULP-gate: an expert is active where it moved >= `gate` representable steps of the
    storage dtype; merged with RAM's rule (RAM+ when rescale_factor > 1)."""

    name = "ulp_gate"
    uses_gates = True

    def __init__(self, cfg: Any, weights: Sequence[float], chunk: int = 1 << 18) -> None:
        super().__init__(cfg, weights, chunk)
        self.snap = cfg.policy == "snap"

    def out_dtype(self, base_code: str) -> str:
        return "F32" if self.cfg.policy == "fp32" else base_code

    def gate(
        self, name: str, base_raw: torch.Tensor, expert_raw: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:

        flat = out.reshape(-1)
        b, e = base_raw.reshape(-1), expert_raw.reshape(-1)
        try:
            for sl in self.slices(flat.numel()):
                flat[sl] = ulp.steps(b[sl], e[sl]) >= self.cfg.gate
        except ValueError as err:
            raise MergeError(f"tensor {name}: ulp_gate: {err}") from None
        return out


class GramSoup(Method):
    name = "gram_soup"

    def merge(self, g: Group) -> Parts:
        m = K.gram_multiplicity(self.gram(g))
        coefs = [self.cfg.lam * w / float(mi) for w, mi in zip(self.weights, m, strict=True)]
        return self.chunked(g, lambda t, _m, _c: K.linear(t, coefs))


class ModelStock(Method):
    name = "model_stock"

    def merge(self, g: Group) -> Parts:
        t = K.model_stock_t(self.gram(g))
        total = sum(self.weights)
        return self.chunked(g, lambda x, _m, _c: K.linear(x, [t * w / total for w in self.weights]))


class IsoC(Method):
    """Iso-C / Iso-CTS on 2-D weights; other tensors and names matching `average`
    (embeddings, lm_head) get alpha * mean(w_i tau_i)."""

    name = "iso_c"
    sparse = False  # an SVD of the whole matrix

    def merge(self, g: Group) -> Parts:
        if len(g.shape) == 2 and not any(p in g.name for p in self.cfg.average):
            m = self.iso(g)  # the SVD needs the whole matrix: one part
            return iter([(slice(0, m.delta.numel()), K.Merged(m.delta.reshape(-1), m.mass))])
        coefs = [self.cfg.alpha * w / self.n for w in self.weights]
        return self.chunked(g, lambda t, _m, _c: K.linear(t, coefs))

    def iso(self, g: Group) -> K.Merged:
        return iso_c(g.taus, self.weights, self.cfg.alpha)


class IsoCts(IsoC):
    name = "iso_cts"

    def iso(self, g: Group) -> K.Merged:
        return iso_cts(g.taus, self.weights, self.cfg.alpha, self.cfg.common_space_fraction)


METHODS: dict[str, type[Method]] = {
    "soup": Soup,
    "greedy_soup": Soup,  # the per-tensor rule of each candidate soup; see greedy.py
    "task_arithmetic": TaskArithmetic,
    "ties": Ties,
    "dare_linear": DareLinear,
    "dare_ties": DareTies,
    "ram": Ram,
    "ram_plus": RamPlus,
    "ulp_gate": UlpGate,
    "gram_soup": GramSoup,
    "model_stock": ModelStock,
    "iso_c": IsoC,
    "iso_cts": IsoCts,
}


def build_method(cfg: R.MethodConfig, weights: Sequence[float], chunk: int = 1 << 18) -> Method:
    """The strategy for a recipe's [method] table."""
    name = type(cfg).__struct_config__.tag
    if name == "model_stock" and len(weights) < 2:
        raise MergeError("method: model_stock needs at least 2 experts")
    if name in ("soup", "greedy_soup", "model_stock") and abs(sum(weights)) < 1e-8:
        raise MergeError(f"experts: the weights sum to 0, which {name} divides by")
    return METHODS[name](cfg, weights, chunk)
