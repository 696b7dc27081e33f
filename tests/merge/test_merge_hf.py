"""A merged checkpoint of a tiny Llama loads with transformers and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rl360.merge import methods as M
from rl360.merge import recipe as R
from rl360.merge.runner import merge_checkpoints

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A bf16 base (hidden 32, 2 layers, vocab 64) saved in several shards, and two experts
    that each moved a different sparse 3% of every weight."""
    root = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "base", max_shard_size="20KB")
    paths = []
    for e in range(2):
        gen = torch.Generator().manual_seed(100 + e)
        with torch.no_grad():
            expert = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
            expert.load_state_dict(model.state_dict())
            for p in expert.parameters():
                mask = torch.rand(p.shape, generator=gen) < 0.03
                p.add_((mask * 0.05 * torch.randn(p.shape, generator=gen)).to(p.dtype))
        expert.save_pretrained(root / f"e{e}", max_shard_size="20KB")
        paths.append(root / f"e{e}")
    return root / "base", paths


def state(path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "cfg",
    [R.Ram(), R.Ties(density=0.5), R.UlpGate(policy="report")],
    ids=lambda c: type(c).__name__,
)
def test_merged_tiny_llama_loads_and_generates(llama, tmp_path, cfg):
    base, experts = llama
    assert len(json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    out = tmp_path / "merged"
    summary = merge_checkpoints(
        base, [R.Expert(path=str(p), name=p.name) for p in experts], cfg,
        R.Output(dir=str(out), max_shard_size="30KB"), R.Run(progress=False),
    )  # fmt: skip
    assert summary.shards > 1 and (out / "model.safetensors.index.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    want = torch.float32 if isinstance(cfg, R.Ram) else torch.bfloat16
    assert next(model.parameters()).dtype == want
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 8)
    # the loaded weights are the RAM merge of the experts' task vectors
    if isinstance(cfg, R.Ram):
        b, e0, e1 = state(base), state(experts[0]), state(experts[1])
        name = "model.layers.0.mlp.up_proj.weight"
        taus = [e0[name].float() - b[name].float(), e1[name].float() - b[name].float()]
        want_w = b[name].float() + M.ram(taus).delta
        assert torch.equal(model.state_dict()[name], want_w)
        assert 0 < summary.stats.changed < summary.stats.elements
        assert all(0.3 < s < 0.7 for s in summary.shares)
