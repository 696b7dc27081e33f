"""HF <-> megatron-core weight conversion (Llama, Qwen2 and Qwen3 families).

The pure round trips and the layout checks need only torch; the ones through a real GPTModel
(HF logits == megatron logits, and state read back from megatron) need megatron-core."""

from __future__ import annotations

import pytest
import torch

from rl360.policies.megatron.convert import hf_to_mcore, mcore_to_hf, shape_from_hf
from rl360.recipe import TrainerSection
from tests.megatron.conftest import MEGATRON_MISSING, hf_config, hf_model

CASES = [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False),
         ("qwen3", True), ("qwen3", False)]


@pytest.mark.parametrize(("family", "tied"), CASES)
def test_round_trip_is_bit_exact(family: str, tied: bool) -> None:
    model = hf_model(family, tied=tied)
    shape = shape_from_hf(model.config)
    hf = model.state_dict()
    back = mcore_to_hf(hf_to_mcore(hf, shape), shape)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    if tied:
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


def test_qkv_is_grouped_by_kv_head_and_fc1_is_gate_then_up() -> None:
    model = hf_model("qwen2", tied=False)
    s = shape_from_hf(model.config)
    hf = model.state_dict()
    mc = hf_to_mcore(hf, s)
    d, per = s.head_dim, s.num_heads // s.num_kv_heads
    a = "model.layers.1.self_attn."
    qkv = mc["decoder.layers.1.self_attention.linear_qkv.weight"]
    bias = mc["decoder.layers.1.self_attention.linear_qkv.bias"]
    assert qkv.shape == ((s.num_heads + 2 * s.num_kv_heads) * d, s.hidden_size)
    block = (per + 2) * d
    for g in range(s.num_kv_heads):
        rows = slice(g * block, (g + 1) * block)
        q = hf[a + "q_proj.weight"][g * per * d:(g + 1) * per * d]
        k = hf[a + "k_proj.weight"][g * d:(g + 1) * d]
        v = hf[a + "v_proj.weight"][g * d:(g + 1) * d]
        assert torch.equal(qkv[rows], torch.cat([q, k, v]))
        qb = hf[a + "q_proj.bias"][g * per * d:(g + 1) * per * d]
        assert torch.equal(bias[rows][: per * d], qb)
    fc1 = mc["decoder.layers.1.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))
    assert "output_layer.weight" in mc
    assert "output_layer.weight" not in hf_to_mcore(hf_model("llama", tied=True).state_dict(),
                                                    shape_from_hf(hf_config("llama", tied=True)))


def test_qwen3_qk_norm_maps_to_q_and_k_layernorm() -> None:
    model = hf_model("qwen3", tied=False)
    s = shape_from_hf(model.config)
    assert s.qk_norm and not s.qkv_bias and s.head_dim == 24
    hf = model.state_dict()
    mc = hf_to_mcore(hf, s)
    a, m = "model.layers.1.self_attn.", "decoder.layers.1.self_attention."
    assert torch.equal(mc[m + "q_layernorm.weight"], hf[a + "q_norm.weight"])
    assert torch.equal(mc[m + "k_layernorm.weight"], hf[a + "k_norm.weight"])
    assert mc[m + "q_layernorm.weight"].shape == (24,)
    assert mc[m + "linear_qkv.weight"].shape == ((s.num_heads + 2 * s.num_kv_heads) * 24, 64)
    assert not any(k.endswith("linear_qkv.bias") for k in mc)
    from rl360.policies.megatron.convert import shard_tp, tp_split_dim

    assert tp_split_dim(m + "q_layernorm.weight") is None  # replicated over TP ranks
    assert torch.equal(shard_tp(mc, 2, 1)[m + "k_layernorm.weight"], hf[a + "k_norm.weight"])


def test_unsupported_configs_are_refused_by_name() -> None:
    from transformers import LlamaConfig, Qwen2Config

    with pytest.raises(ValueError, match="rope type 'llama3'"):
        shape_from_hf(LlamaConfig(rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    with pytest.raises(ValueError, match="use_sliding_window"):
        shape_from_hf(Qwen2Config(use_sliding_window=True))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        from transformers import GPT2Config

        shape_from_hf(GPT2Config())
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        hf = hf_model("llama", tied=True).state_dict()
        del hf["model.norm.weight"]
        hf_to_mcore(hf, shape_from_hf(hf_config("llama", tied=True)))


@pytest.mark.parametrize(("family", "tied"), CASES)
def test_megatron_gpt_matches_hf_logits_and_reads_back_exactly(family: str, tied: bool) -> None:
    pytest.importorskip("megatron.core", reason=MEGATRON_MISSING)
    from rl360.policies.megatron.model import (
        ParallelConfig,
        build_gpt,
        init_parallel,
        load_hf_into,
        mcore_state,
    )

    init_parallel(ParallelConfig.of(TrainerSection()), seed=0)
    model = hf_model(family, tied=tied, seed=3)
    s = shape_from_hf(model.config)
    gpt = build_gpt(s, ParallelConfig.of(TrainerSection()))
    load_hf_into(gpt, model.state_dict(), s)
    gpt.train(False)
    back = mcore_to_hf(mcore_state(gpt), s)
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    ids = torch.randint(0, s.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(17).expand(3, 17)
    causal = torch.ones(17, 17, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        ours = gpt(ids, pos, causal)
        ref = model(input_ids=ids).logits
    assert ours.shape == ref.shape
    assert float((ours - ref).abs().max()) < 1e-5


def test_tensor_parallel_shards_round_trip_and_keep_whole_groups() -> None:
    from rl360.policies.megatron.convert import shard_tp, unshard_tp

    tp = 2  # the tiny configs have 2 KV groups; megatron needs groups % TP == 0
    model = hf_model("qwen2", tied=False)
    s = shape_from_hf(model.config)
    mc = hf_to_mcore(model.state_dict(), s)
    shards = [shard_tp(mc, tp, r) for r in range(tp)]
    full = unshard_tp(shards)
    assert set(full) == set(mc) and all(torch.equal(full[k], mc[k]) for k in mc)
    # rank r's fc1 is [gate_r; up_r]; its qkv rows are whole query groups
    gate = model.state_dict()["model.layers.0.mlp.gate_proj.weight"]
    up = model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    n = gate.shape[0] // tp
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([gate[n:2 * n], up[n:2 * n]]))
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    rows = qkv.shape[0] // tp
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"],
                       qkv[rows:2 * rows])
    assert shards[1]["decoder.layers.0.self_attention.linear_proj.weight"].shape[1] == \
        s.num_heads * s.head_dim // tp
    with pytest.raises(ValueError, match="not divisible by tensor_parallel 3"):
        shard_tp(mc, 3, 0)
