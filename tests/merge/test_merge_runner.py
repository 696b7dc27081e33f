"""End-to-end streaming merges of small checkpoints: spec vectors through the pipeline,
input checks, output format, absorption reporting, greedy soup."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from merge_helpers import TAUS
from safetensors import safe_open

from rl360.merge import MergeError
from rl360.merge import recipe as R
from rl360.merge.evaluators import read_metric, recipe_evaluator
from rl360.merge.greedy import greedy_soup
from rl360.merge.io import Checkpoint
from rl360.merge.runner import merge_checkpoints

RUN = R.Run(progress=False)


def experts_of(paths: list[Path], weights: list[float] | None = None) -> list[R.Expert]:
    weights = weights or [1.0] * len(paths)
    return [R.Expert(path=str(p), weight=w) for p, w in zip(paths, weights, strict=True)]


def merge(base: Path, paths: list[Path], cfg: R.MethodConfig, out: Path, dtype: str = "auto", **kw):
    output = R.Output(dir=str(out), dtype=dtype, max_shard_size=kw.pop("shard", "4GB"))
    return merge_checkpoints(
        base, experts_of(paths, kw.pop("weights", None)), cfg, output, kw.pop("run", RUN), **kw
    )


def load(out: Path) -> dict[str, torch.Tensor]:
    ck = Checkpoint(out)
    return {name: ck.read(name) for name in ck.infos}


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (R.Soup(), [0.2, 0.1, 0.033335, -0.1, 0.016667, -0.033333]),
        (R.TaskArithmetic(lam=0.4), [0.24, 0.12, 0.040002, -0.12, 0.02, -0.04]),
        (R.Ties(density=0.2), [0.4, 0.3, 0.1, -0.6, 0, 0]),
        (R.Ties(density=0.4, scope="tensor"), [0.4, 0.3, 0.1, -0.6, 0, 0]),
        (R.Ram(), [0.3, 0.3, 0.1, -0.1, 0.05, -0.1]),
        (R.RamPlus(), [0.3, 0.36, 0.11, -0.1, 0.055, -0.12]),
        (
            R.RamPlus(rescale_factor=1.1, alpha=0.2, scope="tensor"),
            [0.3, 0.306, 0.102, -0.1, 0.051, -0.102],
        ),
        (R.GramSoup(), [0.509848, 0.3, 0.077467, -0.367614, 0.038731, -0.077462]),
        (R.ModelStock(), [-0.11102, -0.05551, -0.018504, 0.05551, -0.009252, 0.018503]),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, R._Method) else "",
)
def test_spec_vectors_through_the_pipeline(spec_model, tmp_path, cfg, expected):
    base, experts, b = spec_model
    summary = merge(base, experts, cfg, tmp_path / "out", dtype="float32")
    got = load(tmp_path / "out")["w"] - b
    np.testing.assert_allclose(got.double().numpy(), expected, atol=1e-6)
    assert summary.stats.elements == 6


def test_iso_c_through_the_pipeline(ckpt, tmp_path):
    b = torch.linspace(-1, 1, 6).reshape(2, 3)
    experts = [
        ckpt(f"e{i}", {"w": b + torch.tensor(t).reshape(2, 3), "norm": torch.ones(3) + i})
        for i, t in enumerate(TAUS)
    ]
    base = ckpt("base", {"w": b, "norm": torch.ones(3)})
    merge(base, experts, R.IsoC(), tmp_path / "out", dtype="float32")
    got = load(tmp_path / "out")
    expected = [[0.335005, 0.303638, 0.021805], [-0.278355, 0.318662, -0.160849]]
    np.testing.assert_allclose((got["w"] - b).numpy(), expected, atol=1e-6)
    assert torch.allclose(got["norm"], torch.full((3,), 2.0))  # non-2-D: mean of the deltas


def test_ties_paper_trims_over_the_whole_model(ckpt, tmp_path):
    gen = torch.Generator().manual_seed(0)
    big = {"a": torch.randn(100, generator=gen) * 10, "b": torch.randn(300, generator=gen) * 0.1}
    base = ckpt("base", {k: torch.zeros_like(v) for k, v in big.items()}, shards=2)
    e1 = ckpt("e1", big, shards=2)
    merge(base, [e1], R.Ties(density=0.2), tmp_path / "model")
    merge(base, [e1], R.Ties(density=0.2, scope="tensor"), tmp_path / "tensor")
    model, tensor = load(tmp_path / "model"), load(tmp_path / "tensor")
    d = 400
    assert sum(int(torch.count_nonzero(v)) for v in model.values()) == int(d * 0.2) + 1
    assert int(torch.count_nonzero(model["b"])) == 0  # all the kept mass is in "a"
    assert (
        int(torch.count_nonzero(tensor["a"])) == 20 and int(torch.count_nonzero(tensor["b"])) == 60
    )


def test_ties_paper_majority_sign_decides_exact_cancellations(ckpt, tmp_path):
    """Where the trimmed deltas cancel exactly, the paper takes the model's majority sign (here
    -): the merge pass first assumes +, sees the cancellation and the - majority, runs again."""
    base = ckpt("base", {"w": torch.zeros(6)})
    e1 = ckpt("e1", {"w": torch.tensor([0.5, -0.1, -0.2, -0.3, 0.0, 0.0])})
    e2 = ckpt("e2", {"w": torch.tensor([-0.5, -0.1, -0.2, -0.3, 0.0, 0.0])})
    summary = merge(base, [e1, e2], R.Ties(density=1.0), tmp_path / "out")
    np.testing.assert_allclose(load(tmp_path / "out")["w"].numpy(), [-0.5, -0.1, -0.2, -0.3, 0, 0])
    assert summary.passes == 2  # the coarse statistics pass, then the merge pass ran twice


def test_ties_paper_bf16_cut_from_the_coarse_pass_alone(ckpt, tmp_path):
    """bf16 task vectors have few significant bits: the coarse bin holding the cut holds one
    value, the fine pass is skipped, and the result is the in-memory paper TIES."""
    gen = torch.Generator().manual_seed(1)
    b = (torch.randn(2, 500, generator=gen) * 0.02).bfloat16()
    steps = torch.randint(-3, 4, (2, 500), generator=gen) * (
        torch.rand(2, 500, generator=gen) < 0.4
    )
    from rl360.merge import ulp

    e = ulp.from_ordinal(ulp.ordinal(b) + steps, torch.bfloat16)
    base = ckpt("base", {"a": b[0], "b": b[1]}, shards=2)
    e1 = ckpt("e1", {"a": e[0], "b": e[1]}, shards=2)
    summary = merge(base, [e1], R.Ties(density=0.2), tmp_path / "out", dtype="float32")
    tau = e.float() - b.float()
    flat = tau.reshape(-1).abs()
    kth = float(flat.kthvalue(flat.numel() - int(flat.numel() * 0.2)).values)
    want = b.float() + torch.where(tau.abs() >= kth, tau, 0.0)
    got = load(tmp_path / "out")
    assert torch.equal(torch.stack([got["a"], got["b"]]), want)
    assert summary.passes == 1 and kth > 0


def test_shape_mismatch_names_tensor_and_shapes(ckpt, tmp_path):
    base = ckpt("base", {"x": torch.zeros(4, 3), "y": torch.zeros(2)})
    bad = ckpt("bad", {"x": torch.zeros(4, 3), "y": torch.zeros(3)})
    with pytest.raises(
        MergeError, match=r"tensor y: shape \[3\] in expert 'bad' but \[2\] in the base"
    ):
        merge(base, [bad], R.Ram(), tmp_path / "out")


def test_missing_and_extra_tensors(ckpt, tmp_path):
    base = ckpt("base", {"x": torch.zeros(2), "y": torch.zeros(2)})
    short = ckpt("short", {"x": torch.zeros(2)})
    with pytest.raises(MergeError, match="expert 'short': tensor y is missing"):
        merge(base, [short], R.Soup(), tmp_path / "out")
    extra = ckpt("extra", {"x": torch.zeros(2), "y": torch.zeros(2), "z": torch.zeros(1)})
    with pytest.raises(MergeError, match="tensor z is not in the base"):
        merge(base, [extra], R.Soup(), tmp_path / "out2")


def test_non_float_tensors_are_copied_after_checking(ckpt, tmp_path):
    ids = torch.arange(5)
    base = ckpt("base", {"w": torch.zeros(3), "ids": ids})
    same = ckpt("same", {"w": torch.ones(3), "ids": ids.clone()})
    summary = merge(base, [same], R.Soup(), tmp_path / "out")
    got = load(tmp_path / "out")
    assert torch.equal(got["ids"], ids) and got["ids"].dtype == torch.int64
    assert summary.stats.copied == 1
    other = ckpt("other", {"w": torch.ones(3), "ids": ids + 1})
    with pytest.raises(
        MergeError, match="tensor ids: non-float tensor differs between expert 'other'"
    ):
        merge(base, [other], R.Soup(), tmp_path / "out2")


def test_output_layout_index_config_and_reader_parity(ckpt, tmp_path):
    gen = torch.Generator().manual_seed(1)
    names = [f"layers.{i}.w" for i in range(6)]
    b = {n: torch.randn(64, 32, generator=gen).bfloat16() for n in names}
    e = [
        {
            n: (v.float() + 0.05 * torch.randn(v.shape, generator=gen)).bfloat16()
            for n, v in b.items()
        }
        for _ in range(2)
    ]
    base = ckpt("base", b, shards=3)
    experts = [ckpt("e0", e[0], shards=2), ckpt("e1", e[1])]  # index + single file
    s1 = merge(base, experts, R.Ties(), tmp_path / "a", shard="5KB")
    s2 = merge(
        base,
        experts,
        R.Ties(),
        tmp_path / "b",
        shard="5KB",
        run=R.Run(progress=False, reader="safetensors"),
    )
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 6 and files[0] == "model-00001-of-00006.safetensors"
    for f in files:  # the official reader accepts our files, and both readers agree
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
        with safe_open(str(tmp_path / "a" / f), "pt") as h:
            for k in h.keys():
                assert h.get_tensor(k).dtype == torch.bfloat16
    assert json.loads((tmp_path / "a" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (tmp_path / "a" / "tokenizer_config.json").is_file()
    assert s1.stats.elements == s2.stats.elements == 6 * 64 * 32
    summary = json.loads((tmp_path / "a" / "merge_summary.json").read_text())
    assert summary["method"] == "ties" and set(summary["shares"]) == {"e0", "e1"}


def test_ram_defaults_to_fp32_and_config_dtype_follows(spec_model, tmp_path):
    base, experts, _ = spec_model
    merge(base, experts, R.Ram(), tmp_path / "out")
    assert load(tmp_path / "out")["w"].dtype == torch.float32
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"


def bf16_ulp_model(ckpt):
    from test_merge_methods import ulp_example

    base, experts = ulp_example()
    return ckpt("base", {"w": base}), [ckpt(f"e{i}", {"w": e}) for i, e in enumerate(experts)], base


def steps_of(out: Path, base: torch.Tensor) -> list[int]:
    from rl360.merge import ulp

    return ulp.signed_steps(base, load(out)["w"].float()).tolist()


def test_bf16_absorption_is_reported(ckpt, tmp_path):
    base, experts, b = bf16_ulp_model(ckpt)
    s = merge(base, experts, R.Soup(), tmp_path / "soup")  # auto: the base's bf16
    assert steps_of(tmp_path / "soup", b) == [1, 0, 1, -1, 0, 0]
    assert s.stats.absorbed == 3 and s.stats.bf16_elements == 6
    assert "absorbed        3 updates lost" in s.text()
    s = merge(base, experts, R.UlpGate(policy="report"), tmp_path / "ulp")
    assert steps_of(tmp_path / "ulp", b) == [1, 1, 2, -2, -1, -1] and s.stats.absorbed == 0
    s = merge(base, experts, R.UlpGate(gate=2), tmp_path / "ulp2")  # policy fp32
    assert load(tmp_path / "ulp2")["w"].dtype == torch.float32
    assert steps_of(tmp_path / "ulp2", b) == [0, 0, 3, -2, 0, 0]
    s = merge(base, experts, R.Ram(), tmp_path / "ram", dtype="bfloat16")
    assert steps_of(tmp_path / "ram", b) == [1, 0, 2, -2, -1, -1]
    s = merge(base, experts, R.Soup(), tmp_path / "soup32", dtype="float32")
    assert s.stats.absorbed_bf16 == 3 and "a bf16 save would absorb 3" in s.text()


def test_ulp_gate_snap_policy(ckpt, tmp_path):
    base, experts, b = bf16_ulp_model(ckpt)
    s = merge(base, experts, R.UlpGate(policy="snap"), tmp_path / "snap", weights=[0.3, 1.0, 1.0])
    assert s.stats.absorbed == s.stats.snapped == 1  # position 5: 0.3 of one step
    assert steps_of(tmp_path / "snap", b)[5] == -1


def test_soup_of_identical_experts_is_that_expert_bitwise(ckpt, tmp_path):
    gen = torch.Generator().manual_seed(2)
    b = {"w": torch.randn(50, 20, generator=gen).bfloat16()}
    e = {"w": (b["w"].float() + torch.randn(50, 20, generator=gen) * 0.01).bfloat16()}
    base = ckpt("base", b)
    experts = [ckpt(f"e{i}", e) for i in range(3)]
    merge(base, experts, R.Soup(), tmp_path / "out")
    assert torch.equal(load(tmp_path / "out")["w"], e["w"])
    merge(base, experts, R.TaskArithmetic(lam=0.0), tmp_path / "ta0")
    assert torch.equal(load(tmp_path / "ta0")["w"], b["w"])


def test_dare_end_to_end_is_seeded(spec_model, tmp_path):
    base, experts, _ = spec_model
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        merge(base, experts, R.DareTies(density=0.5, seed=seed), tmp_path / name)
    read = {n: (tmp_path / n / "model-00001-of-00001.safetensors").read_bytes() for n in "abc"}
    assert read["a"] == read["b"] != read["c"]


def test_output_dir_must_be_empty_or_overwritten(spec_model, tmp_path):
    base, experts, _ = spec_model
    merge(base, experts, R.Soup(), tmp_path / "out")
    with pytest.raises(MergeError, match="not empty"):
        merge(base, experts, R.Soup(), tmp_path / "out")
    out = R.Output(dir=str(tmp_path / "out"), overwrite=True)
    merge_checkpoints(base, experts_of(experts), R.Soup(), out, RUN)
    with pytest.raises(MergeError, match="one of the input checkpoints"):
        merge(base, experts, R.Soup(), base)


def test_greedy_soup_with_a_callable_evaluator(ckpt, tmp_path):
    b = torch.zeros(4)
    target = torch.tensor([1.0, 1.0, 0.0, 0.0])
    vecs = {"a": [2.0, 0.0, 0.0, 0.0], "b": [0.0, 2.0, 0.0, 0.0], "c": [0.0, 0.0, 3.0, 3.0]}
    paths = {k: ckpt(k, {"w": b + torch.tensor(v)}) for k, v in vecs.items()}
    base = ckpt("base", {"w": b})
    seen = []

    def score(model_dir: Path) -> float:
        seen.append(model_dir.name)
        return -float((load(model_dir)["w"] - target).norm())

    experts = [R.Expert(path=str(paths[k])) for k in ("c", "a", "b")]
    out = R.Output(dir=str(tmp_path / "soup"))
    s = greedy_soup(base, experts, score, out, RUN)
    assert torch.allclose(load(tmp_path / "soup")["w"], target)  # soup of a and b; c skipped
    assert s.method == "greedy_soup" and s.experts == ["a", "b"]
    assert "c: " in s.extra["greedy"] and "skipped" in s.extra["greedy"]
    assert seen[:3] == ["c", "a", "b"] and len(seen) == 5


def test_recipe_evaluator_reads_the_eval_summary(tmp_path):
    """A stand-in for `rl360 eval` that writes eval_summary.json where --set run.* says."""
    script = tmp_path / "fake_rl360.py"
    script.write_text(
        "import json, pathlib, sys\n"
        "a = sys.argv[1:]\n"
        "assert a[0] == 'eval' and a[2] == '--model'\n"
        "sets = dict(v.split('=', 1) for k, v in zip(a, a[1:]) if k == '--set')\n"
        "run = pathlib.Path(json.loads(sets['run.out_dir']), json.loads(sets['run.name']))\n"
        "run.mkdir(parents=True)\n"
        "reward = 0.25 if a[3].endswith('x') else 0.5\n"
        "(run / 'eval_summary.json').write_text(json.dumps({'rows': [], 'overall': {'mean_reward': reward}}))\n"
        "print('task table ...')\n"
    )
    recipe = tmp_path / "eval.toml"
    recipe.write_text("")
    score = recipe_evaluator(recipe, command=[sys.executable, str(script)])
    assert score(tmp_path / "x") == 0.25 and score(tmp_path / "y") == 0.5
    assert read_metric('noise\n{"reward": {"mean": 3}}', "reward.mean") == 3.0
    with pytest.raises(MergeError, match="no key"):
        read_metric('{"other": 1}')
    failing = recipe_evaluator(
        recipe, command=[sys.executable, "-c", "import sys; sys.exit('boom')"]
    )
    with pytest.raises(MergeError, match="exited 1: boom"):
        failing(tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("out", ["auto", "float32", "bfloat16"])
def test_sparse_path_matches_dense_on_negative_zeros(ckpt, tmp_path, dtype, out):
    """The sparse loader finds the base's -0 entries chunk by chunk and builds a same-dtype
    output in the base's own buffer: the bytes stay those of the dense path (the safetensors
    reader), also when a cast to a narrower dtype makes new -0 entries."""
    gen = torch.Generator().manual_seed(2)
    dt = getattr(torch, dtype)
    b = {f"w{i}": (torch.randn(300, 7, generator=gen) * 0.02).to(dt) for i in range(5)}
    for v in b.values():
        flat = v.view(-1)
        flat[torch.randint(0, flat.numel(), (40,), generator=gen)] = -0.0
        flat[:3] = -1e-42  # an fp32 denormal: rounds to -0 in bf16
    e = []
    for _ in range(2):
        moved = {}
        for n, v in b.items():
            x = v.clone().view(-1)
            pos = torch.randint(0, x.numel(), (x.numel() // 10,), generator=gen)
            x[pos] = (x[pos].float() + 0.01).to(dt)
            moved[n] = x.view(v.shape)
        e.append(moved)
    base = ckpt("base", b)
    experts = [ckpt("e0", e[0]), ckpt("e1", e[1])]
    for cfg in (R.TaskArithmetic(), R.Ram()):
        a, d = tmp_path / f"a-{type(cfg).__name__}", tmp_path / f"d-{type(cfg).__name__}"
        merge(base, experts, cfg, a, out)
        merge(base, experts, cfg, d, out, run=R.Run(progress=False, reader="safetensors"))
        files = sorted(f.name for f in a.glob("*.safetensors"))
        assert files and files == sorted(f.name for f in d.glob("*.safetensors"))
        for f in files:
            assert (a / f).read_bytes() == (d / f).read_bytes(), (cfg, f)
