"""LoRA adapters as merge experts: one adapter merged into its base is the trainer's merged
model bit for bit; several adapters merged with task arithmetic and TIES give what the same
merge of their dense equivalents (base + s * B @ A saved as full checkpoints) gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from merge_helpers import write_checkpoint

from rl360.merge import MergeError
from rl360.merge import recipe as R
from rl360.merge.cli import main as merge_main
from rl360.merge.io import Checkpoint
from rl360.merge.runner import merge_checkpoints
from rl360.policies.lora import LoraSpec, merged_state, save_adapter

RUN = R.Run(progress=False)
Q, DOWN = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {Q: torch.randn(8, 6, generator=g), DOWN: torch.randn(6, 10, generator=g),
            "model.norm.weight": torch.ones(6), "model.embed_tokens.weight": torch.randn(
                12, 6, generator=g)}


def make_adapter(path: Path, base: Path, seed: int, rank: int = 2,
                 alpha: float = 4.0) -> dict[str, torch.Tensor]:
    """An adapter on q_proj and down_proj; returns its tensors (model names)."""
    g = torch.Generator().manual_seed(seed)
    t = {}
    for name, (o, i) in ((Q, (8, 6)), (DOWN, (6, 10))):
        mod = name[: -len(".weight")]
        t[f"{mod}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.3
        t[f"{mod}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.3
    save_adapter(path, t, LoraSpec(rank, alpha, 0.0, ("q_proj", "down_proj")), str(base))
    return t


def read(out: Path) -> dict[str, torch.Tensor]:
    ck = Checkpoint(out)
    return {n: ck.read(n).clone() for n in ck.infos}


@pytest.fixture
def base(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    t = base_tensors()
    return write_checkpoint(tmp_path / "base", t, config={"model_type": "toy"}), t


def test_one_adapter_into_its_base_is_the_trainers_merged_model(base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, theta0 = base
    tensors = make_adapter(tmp_path / "ad", path, seed=1)
    rc = merge_main(["--adapter", str(tmp_path / "ad"), "--out", str(tmp_path / "out"),
                     "--no-progress"])
    assert rc == 0
    got = read(tmp_path / "out")
    want = merged_state({**theta0, **tensors}, 4.0 / 2)
    assert set(got) == set(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), name  # bit for bit
    assert not torch.equal(got[Q], theta0[Q]) and torch.equal(got["model.norm.weight"],
                                                              theta0["model.norm.weight"])
    assert (tmp_path / "out" / "config.json").is_file()


def dense_equivalent(tmp_path: Path, name: str, base: Path, theta0: dict[str, torch.Tensor],
                     tensors: dict[str, torch.Tensor], scaling: float) -> Path:
    return write_checkpoint(tmp_path / name, merged_state({**theta0, **tensors}, scaling),
                            config={"model_type": "toy"})


@pytest.mark.parametrize("method", [
    R.TaskArithmetic(lam=0.7), R.Ties(density=0.3, scope="tensor"), R.Ties(density=0.5),
    R.Soup()], ids=lambda m: f"{type(m).__name__}-{getattr(m, 'scope', '')}")
def test_several_adapters_merge_like_their_dense_equivalents(base, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                             method: R.MethodConfig) -> None:
    path, theta0 = base
    adapters = [tmp_path / f"ad{i}" for i in range(3)]
    dense = []
    for i, ad in enumerate(adapters):
        t = make_adapter(ad, path, seed=10 + i, rank=1 + i, alpha=2.0 + i)
        dense.append(dense_equivalent(tmp_path, f"dense{i}", path, theta0, t, (2.0 + i) / (1 + i)))
    weights = [1.0, 0.5, 2.0]

    def run(paths: list[Path], out: str) -> dict[str, torch.Tensor]:
        experts = [R.Expert(path=str(p), weight=w) for p, w in zip(paths, weights, strict=True)]
        merge_checkpoints(path, experts, method, R.Output(dir=str(tmp_path / out),
                                                           dtype="float32"), RUN)
        return read(tmp_path / out)

    low_rank, full = run(adapters, "from-adapters"), run(dense, "from-dense")
    assert set(low_rank) == set(full)
    for name in full:
        assert torch.allclose(low_rank[name], full[name], atol=1e-5, rtol=0), name
    moved = [n for n in full if not torch.equal(low_rank[n], theta0[n])]
    assert sorted(moved) == sorted([Q, DOWN])  # only the adapted weights move
    if isinstance(method, R.TaskArithmetic):  # theta0 + lambda * sum w_i s_i B_i A_i
        want = theta0[Q].clone()
        for i, (w, ad) in enumerate(zip(weights, adapters, strict=True)):
            from rl360.policies.lora import read_adapter

            t = read_adapter(ad).tensors
            mod = Q[: -len(".weight")]
            want += 0.7 * w * (t[f"{mod}.lora_B.weight"] @ t[f"{mod}.lora_A.weight"]) * (
                (2.0 + i) / (1 + i))
        assert torch.allclose(low_rank[Q], want, atol=1e-5)


def test_an_adapter_of_another_base_or_shape_is_refused(base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, theta0 = base
    other = write_checkpoint(tmp_path / "other", theta0, config={"model_type": "toy"})
    make_adapter(tmp_path / "ad", other, seed=1)
    out = R.Output(dir=str(tmp_path / "out"))
    with pytest.raises(MergeError, match="trained on base"):
        merge_checkpoints(path, [R.Expert(path=str(tmp_path / "ad"))], R.TaskArithmetic(), out,
                          RUN)
    small = dict(theta0)
    small[Q] = torch.zeros(8, 5)
    bad = write_checkpoint(tmp_path / "bad", small, config={"model_type": "toy"})
    make_adapter(tmp_path / "ad2", bad, seed=1)
    with pytest.raises(MergeError, match="does not make the base's"):
        merge_checkpoints(bad, [R.Expert(path=str(tmp_path / "ad2"))], R.TaskArithmetic(), out,
                          RUN)
    assert merge_main(["--adapter", str(tmp_path / "base"), "--out", str(tmp_path / "x")]) == 2
