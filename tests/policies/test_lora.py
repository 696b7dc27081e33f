"""trainer.lora on the torch trainer: adapters only train, the KL reference is the base with
adapters off, the synced weights are the merged model, checkpoints are peft's adapter files and
resume to the identical next step; our adapter files load in peft and peft's in ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rl360.policies.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoraLinear,
    LoraSpec,
    adapters_off,
    add_lora,
    merged_state,
    read_adapter,
    target_names,
)
from rl360.policies.trainer_torch import STATE_FILE, TorchTrainer
from rl360.recipe import LoraSection, LossSection, TrainerSection
from rl360.types import Batch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_cfg(**kw) -> TrainerSection:  # type: ignore[no-untyped-def]
    lora = kw.pop("lora", LoraSection(rank=4, alpha=8.0, targets=list(TARGETS)))
    return TrainerSection(lr=kw.pop("lr", 1e-2), lora=lora, **kw)


def logits(model, tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def adapters(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items() if ".lora_" in k}


def test_a_fresh_adapter_changes_nothing_and_merging_is_the_low_rank_forward() -> None:
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 7, bias=True)
    x = torch.randn(3, 12)
    lin = LoraLinear(base, rank=2, alpha=4.0)
    assert torch.equal(lin(x), base(x))  # B = 0
    with torch.no_grad():
        lin.lora_B.weight.normal_()
    merged = merged_state({"p.weight": lin.weight, "p.bias": lin.bias,
                           "p.lora_A.weight": lin.lora_A.weight,
                           "p.lora_B.weight": lin.lora_B.weight}, lin.scaling)
    assert set(merged) == {"p.weight", "p.bias"}
    dense = torch.nn.functional.linear(x, merged["p.weight"], merged["p.bias"])
    assert torch.allclose(lin(x), dense, atol=1e-5)
    assert not torch.allclose(lin(x), base(x))
    with adapters_off(torch.nn.Sequential(lin)):
        assert torch.equal(lin(x), base(x))
    assert lin.adapter_on


def test_only_adapters_train_and_the_base_is_the_kl_reference(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    t = TorchTrainer(lora_cfg(loss=LossSection(kl_coef=0.1)), tiny_dir)
    assert t.reference is t.model  # no second model
    names = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(t.params) == len(names)
    base = {k: v.clone() for k, v in t.model.state_dict().items() if ".lora_" not in k}
    before = adapters(t)
    probe = make_samples(1, seed=11)[0].tokens
    ref = logits(t.model, probe)
    batch = Batch(samples=make_samples(6, seed=4))
    m1 = t.train_step(batch)
    assert m1["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the adapted model is the base
    m2 = t.train_step(batch)
    assert m2["kl"] > 1e-7
    after = t.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base never moves
    assert any(not torch.equal(after[k], v) for k, v in before.items())
    assert not torch.allclose(logits(t.model, probe), ref)
    with adapters_off(t.model):
        assert torch.equal(logits(t.model, probe), ref)


def test_synced_weights_are_the_merged_plain_model(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    t = TorchTrainer(lora_cfg(), tiny_dir)
    for seed in (1, 2):
        t.train_step(Batch(samples=make_samples(6, seed=seed)))
    sd = t.state_dict_for_sync()
    assert not any(".lora_" in k for k in sd)
    assert all(v.device.type == "cpu" and v.is_contiguous() and not v.requires_grad
               for v in sd.values())
    plain = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    plain.load_state_dict(sd, strict=True)
    probe = make_samples(1, seed=12)[0].tokens
    assert torch.allclose(logits(plain, probe), logits(t.model, probe), atol=1e-5)
    assert set(t.adapter_for_sync()) == {k for k in t.model.state_dict() if ".lora_" in k}


def test_checkpoint_is_the_adapter_alone_and_resumes_bit_identical(
    tiny_dir: Path, make_samples, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    cfg = lora_cfg(warmup_steps=3)
    a = TorchTrainer(cfg, tiny_dir)
    a.train_step(Batch(samples=make_samples(4, seed=8)))
    ckpt = a.save(tmp_path / "ckpt")
    files = {p.name for p in ckpt.iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS, STATE_FILE} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    conf = json.loads((ckpt / ADAPTER_CONFIG).read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert Path(conf["base_model_name_or_path"]) == tiny_dir.resolve()
    b = TorchTrainer(cfg, tiny_dir)
    b.load(ckpt)
    assert b.step == 1
    # a trainer built from the adapter directory (a resumed run's policy) starts from it too
    c = TorchTrainer(cfg, ckpt)
    assert c.model_path == tiny_dir.resolve()
    assert all(torch.equal(v, adapters(a)[k]) for k, v in adapters(c).items())
    nxt = Batch(samples=make_samples(4, seed=9))
    ma, mb = a.train_step(nxt), b.train_step(nxt)
    assert ma["lr"] == mb["lr"] and ma["loss"] == mb["loss"]
    assert all(torch.equal(v, adapters(b)[k]) for k, v in adapters(a).items())
    other = lora_cfg(lora=LoraSection(rank=2, targets=["q_proj"]))
    with pytest.raises(ValueError, match="adapter rank 4"):
        TorchTrainer(other, tiny_dir).load(ckpt)
    with pytest.raises(ValueError, match="is a LoRA adapter"):
        TorchTrainer(TrainerSection(), ckpt)


def test_targets_must_name_projections_of_the_model(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"'qkv_proj' is not a linear projection.*q_proj"):
        TorchTrainer(lora_cfg(lora=LoraSection(targets=["q_proj", "qkv_proj"])), tiny_dir)
    t = TorchTrainer(lora_cfg(lora=LoraSection(rank=2, targets=["v_proj"])), tiny_dir)
    assert sorted({n.rsplit(".", 1)[-1] for n, m in t.model.named_modules()
                   if isinstance(m, LoraLinear)}) == ["v_proj"]
    assert "lm_head" not in target_names(t.model)


def test_fused_logprobs_and_full_logits_give_the_same_adapter_step(tiny_dir: Path, make_samples) -> None:  # type: ignore[no-untyped-def]
    batch = Batch(samples=make_samples(8, seed=5, max_len=30))
    out = []
    for fused in (True, False):
        torch.manual_seed(0)
        t = TorchTrainer(lora_cfg(fused_logprobs=fused), tiny_dir, seed=0)
        out.append((t.train_step(batch), adapters(t)))
    (m1, w1), (m2, w2) = out
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


def test_dropout_acts_only_in_the_gradient_forward() -> None:
    torch.manual_seed(0)
    lin = LoraLinear(torch.nn.Linear(16, 16), rank=4, alpha=4.0, dropout=0.5)
    with torch.no_grad():
        lin.lora_B.weight.normal_()
        x = torch.randn(4, 16)
        assert torch.equal(lin(x), lin(x))
    assert not torch.equal(lin(x), lin(x))


def test_our_checkpoint_loads_in_peft_and_peft_adapters_load_in_ours(
    tiny_dir: Path, make_samples, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    t = TorchTrainer(lora_cfg(), tiny_dir)
    t.train_step(Batch(samples=make_samples(6, seed=3)))
    ckpt = t.save(tmp_path / "ours")
    probe = make_samples(1, seed=13)[0].tokens
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, ckpt)
    assert torch.allclose(logits(theirs, probe), logits(t.model, probe), atol=1e-5)

    # peft's own adapter (its init, B made non-zero) read by ours gives peft's outputs
    base2 = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    conf = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "down_proj"])
    pm = peft.get_peft_model(base2, conf)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pm.save_pretrained(tmp_path / "peft")
    adapter = read_adapter(tmp_path / "peft")
    assert adapter.spec == LoraSpec(rank=2, alpha=6.0, dropout=0.0,
                                    targets=adapter.spec.targets)
    assert set(adapter.spec.targets) == {"q_proj", "down_proj"}
    mine = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    add_lora(mine, adapter.spec)
    from rl360.policies.lora import load_adapter_tensors

    load_adapter_tensors(mine, adapter.tensors)
    assert torch.allclose(logits(mine, probe), logits(pm, probe), atol=1e-5)


@pytest.fixture
def private_group():  # type: ignore[no-untyped-def]
    """The fsdp trainer on its own makes a 1-process group; leave none behind."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fsdp_adapters_step_like_torch_and_resume(
    tiny_dir: Path, make_samples, tmp_path: Path, private_group: None  # type: ignore[no-untyped-def]
) -> None:
    from rl360.policies.trainer_backends import build_trainer

    cfg = lora_cfg(loss=LossSection(kl_coef=0.05), micro_batch_size=3)
    seed = TorchTrainer(cfg, tiny_dir)
    seed.train_step(Batch(samples=make_samples(6, seed=1)))
    start = seed.save(tmp_path / "start")  # both start from this adapter (and fresh Adam)
    ref = TorchTrainer(cfg, start)
    fsdp = build_trainer(TrainerSection(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__},
                                           "backend": "fsdp"}), start)
    assert fsdp.reference is fsdp.model
    batch = Batch(samples=make_samples(8, seed=2, max_len=30))
    m_ref, m_fsdp = ref.train_step(batch), fsdp.train_step(batch)
    for key in ("loss", "grad_norm", "kl"):
        assert m_fsdp[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-7), key
    a, b = fsdp.state_dict_for_sync(), ref.state_dict_for_sync()
    assert sorted(a) == sorted(b) and not any(".lora_" in k for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    ckpt = fsdp.save(tmp_path / "fsdp")
    assert (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / "model.safetensors").exists()
    assert read_adapter(ckpt).tensors.keys() == fsdp.adapter_for_sync().keys()
    nxt = Batch(samples=make_samples(5, seed=3))
    m1 = fsdp.train_step(nxt)
    w1 = fsdp.adapter_for_sync()
    fsdp.load(ckpt)
    assert fsdp.train_step(nxt)["loss"] == m1["loss"]
    assert all(torch.equal(v, w1[k]) for k, v in fsdp.adapter_for_sync().items())


def test_an_adapter_directory_is_not_a_model_path(tiny_dir: Path, tmp_path: Path) -> None:
    from rl360.policies.loading import ModelNotFound, resolve_model_path

    ckpt = TorchTrainer(lora_cfg(), tiny_dir).save(tmp_path / "ad")
    with pytest.raises(ModelNotFound, match="is a LoRA adapter, not a model: merge it"):
        resolve_model_path(str(ckpt))
