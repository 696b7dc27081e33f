"""Adapter versions (trainer.lora): packed with a checksum that catches a flipped bit, a sender
in adapter mode, and the torch engine serving base + adapter with the trainer's logprobs (fp32,
within 1e-5) after 3 adapter updates; end to end through the object store and the gloo
collective with real Serve replicas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from rl360.policies.lora import LoraSpec
from rl360.policies.trainer_torch import TorchTrainer
from rl360.recipe import EngineSection, LoraSection, ModelSection, TrainerSection
from rl360.types import Batch, SamplingParams, TrainSample
from rl360.weights.adapters import (
    AdapterChecksumError,
    describe,
    pack_adapter,
    received_adapter,
    unpack_adapter,
)
from rl360.weights.payloads import AdapterUpdate
from rl360.weights.sender import WeightSender
from rl360.weights.sender_calls import Describe, Spec

TOL = 1e-5
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [40, 41], list(range(60, 90))]


def _samples(n: int, seed: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        toks = torch.randint(3, 200, (14,), generator=g).tolist()
        out.append(TrainSample(tokens=toks, mask=[0] * 4 + [1] * 10,
                               sampling_logprobs=[0.0] * 4 + [-5.0] * 10,
                               advantage=1.0 if i % 2 else -1.0))
    return out


def _adapter(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 8, generator=g),
            "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 2, generator=g)}


SPEC = LoraSpec(rank=2, alpha=4.0, targets=("q_proj",))


def test_a_packed_adapter_round_trips_and_a_flipped_bit_is_caught() -> None:
    tensors = _adapter()
    for dtype in (None, "bfloat16"):
        update = unpack_adapter(pack_adapter(3, SPEC, tensors, dtype))
        assert (update.rank, update.alpha, update.targets, update.scaling) == (2, 4.0,
                                                                              ["q_proj"], 2.0)
        for k, v in tensors.items():
            want = v.to(torch.bfloat16) if dtype else v
            assert torch.equal(update.tensors[k], want)
        assert update.nbytes == sum(v.numel() for v in tensors.values()) * (2 if dtype else 4)
    packet = pack_adapter(4, SPEC, tensors)
    bad = packet.arrays[1].copy()
    bad.view(np.uint8)[5] ^= 1
    packet.arrays[1] = bad
    with pytest.raises(AdapterChecksumError, match="version 4: checksum mismatch"):
        unpack_adapter(packet)
    meta = describe(SPEC, tensors)
    assert received_adapter(tensors, meta).checksum == meta["checksum"]
    changed = {**tensors, "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)}
    with pytest.raises(AdapterChecksumError):
        received_adapter(changed, meta)


def test_a_sender_in_adapter_mode_sends_the_adapter() -> None:
    tensors = _adapter()
    sender = WeightSender(lambda: tensors, adapter=SPEC)
    assert [n for n, _, _ in sender.handle(Spec())] == sorted(tensors)
    assert sender.handle(Describe()) == {"adapter": describe(SPEC, tensors)}
    assert WeightSender(lambda: tensors).handle(Describe()) == {}


def _engine(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from rl360.serve.engines.torch_backend import TorchBackend, load_causal_lm

    model, tok = load_causal_lm(str(tiny_dir), "float32")
    return TorchBackend(EngineSection(batch_wait_ms=20), ModelSection(), model=model,
                        tokenizer=tok)


def _trainer_logprobs(t: TorchTrainer, prompt: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        logits = t.model(input_ids=torch.tensor([prompt + out])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(out)]


async def test_the_torch_engine_serves_the_trainers_adapter_within_1e_5(tiny_dir: Path) -> None:
    lora = LoraSection(rank=4, alpha=8.0)
    t = TorchTrainer(TrainerSection(lr=2e-2, lora=lora), tiny_dir)
    be = _engine(tiny_dir)
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    base = await asyncio.gather(*(be.generate(p, sp) for p in PROMPTS))
    worst, moved = 0.0, 0.0
    for version in (1, 2, 3):
        t.train_step(Batch(samples=_samples(8, seed=version)))
        update = unpack_adapter(pack_adapter(version, t.lora, t.adapter_for_sync()))
        assert isinstance(update, AdapterUpdate)
        assert await be.update_weights(version, update)
        gens = await asyncio.gather(*(be.generate(p, sp) for p in PROMPTS))
        for p, g, b in zip(PROMPTS, gens, base, strict=True):
            assert g.policy_version == version
            ref = _trainer_logprobs(t, p, g.token_ids)
            worst = max(worst, *(abs(a - r) for a, r in zip(g.logprobs, ref, strict=True)))
            if g.token_ids == b.token_ids:
                moved = max(moved, *(abs(a - c) for a, c in zip(g.logprobs, b.logprobs,
                                                                strict=True)))
            else:
                moved = 1.0
    print(f"engine vs trainer logprobs after 3 adapter versions: max |diff| {worst:.2e}")
    assert worst < TOL
    assert moved > 1e-3  # the adapter changed what the engine serves
    assert be.health()["version"] == 3
    # an adapter of another shape is refused, and the replica keeps serving version 3
    other = unpack_adapter(pack_adapter(4, LoraSpec(2, 4.0, (), ("q_proj",)),
                                        {k: v for k, v in t.adapter_for_sync().items()
                                         if ".q_proj." in k}))
    with pytest.raises(ValueError, match="adapter rank 2"):
        await be.update_weights(4, other)
    assert be.health()["version"] == 3
    await be.close()


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_adapter_versions_reach_serve_replicas(ray_cluster, tiny_dir: Path,  # type: ignore[no-untyped-def]
                                               transport: str) -> None:
    """trainer rank 0 in adapter mode -> object store (or gloo) -> a torch replica, 3 versions;
    the replica fetched the adapter's bytes only and serves what the trainer's merged weights
    give (within 1e-5)."""
    import ray
    from ray import serve
    from transformers import AutoModelForCausalLM

    from rl360.actors.trainer_group import TrainerGroup
    from rl360.recipe import CollectiveSync, ObjectStoreSync
    from rl360.weights.transports import CollectiveTransport, ObjectStoreTransport
    from tests.serving import serving

    with serving(["engine.replicas=1"]) as handles:
        trainer = TrainerGroup(TrainerSection(num_cpus=0, lr=2e-2, lora=LoraSection(rank=4)),
                               tiny_dir)
        try:
            if transport == "object_store":
                sync: object = ObjectStoreTransport(handles, trainer, ObjectStoreSync(),
                                                    dtype="float32")
            else:
                sync = CollectiveTransport(handles, trainer.workers[0], 1,
                                           options=CollectiveSync(checksum=True))
            pub = handles.publisher
            for version in (1, 2, 3):
                trainer.train_step(Batch(samples=_samples(6, seed=version), step=version))
                assert sync.publish(version)  # type: ignore[attr-defined]
                assert ray.get(pub.wait_applied.remote(version, 1, 120.0)) == version
            if transport == "object_store":
                [fetched] = ray.get(pub.status.remote())["fetched"].values()
                assert fetched["adapter"] and fetched["version"] == 3
                assert sync.last["kind"] == "adapter"  # type: ignore[attr-defined]
                assert fetched["bytes"] == sync.last["nbytes"]  # type: ignore[attr-defined]
                full = sum(v.numel() * 4 for v in trainer.state_dict_for_sync().values())
                assert fetched["bytes"] < full / 2
            else:
                assert all(r.ok for r in sync.last_reports)  # type: ignore[attr-defined]
            merged = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
            merged.load_state_dict(trainer.state_dict_for_sync())
            engine = serve.get_deployment_handle("engine", handles.app_name)
            sp = SamplingParams(temperature=1.0, max_tokens=12, seed=2)
            for p in PROMPTS:
                g = engine.generate.remote(p, sp).result(timeout_s=120)
                assert g.policy_version == 3
                with torch.no_grad():
                    logits = merged(input_ids=torch.tensor([p + g.token_ids])).logits[0]
                logp = torch.log_softmax(logits.float(), dim=-1)
                ref = [float(logp[len(p) - 1 + i, tok]) for i, tok in enumerate(g.token_ids)]
                assert max(abs(a - b) for a, b in zip(g.logprobs, ref, strict=True)) < TOL
        finally:
            trainer.shutdown()
