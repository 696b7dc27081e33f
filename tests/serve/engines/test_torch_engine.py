"""The torch engine backend: logprob correctness, batching, stops, seeds, versioned weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.torch_backend import TorchBackend, load_causal_lm
from rl360.types import SamplingParams
from rl360.weights.payloads import TensorUpdate


@pytest.fixture(scope="module")
def lm(tiny_dir):  # type: ignore[no-untyped-def]
    return load_causal_lm(str(tiny_dir), "float32")  # the engine's own Llama modules


@pytest.fixture(scope="module")
def hf(tiny_dir):  # type: ignore[no-untyped-def]
    """transformers' model of the same checkpoint: the teacher-forcing reference."""
    return load_causal_lm(str(tiny_dir), "float32", native=False)[0]


def make_backend(lm, **kw) -> TorchBackend:  # type: ignore[no-untyped-def]
    model, tok = lm
    return TorchBackend(EngineSection(**kw), ModelSection(), model=model, tokenizer=tok)


async def until(cond) -> None:  # type: ignore[no-untyped-def]
    """Yield to the engine loop until `cond()` holds (an event, not a timing)."""
    for _ in range(100_000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def teacher_forced_logprobs(model, prompt: list[int], out: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]


async def test_logprobs_match_teacher_forcing_in_a_ragged_batch(lm, hf) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(lm, batch_wait_ms=50)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [40, 41], list(range(60, 90))]
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
    gens = await asyncio.gather(*(be.generate(p, sp) for p in prompts))
    assert be.health()["batches"] == 1, "the three requests should have run as one batch"
    for p, g in zip(prompts, gens, strict=True):
        assert len(g.token_ids) == len(g.logprobs) == 24
        ref = teacher_forced_logprobs(hf, p, g.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, g.logprobs, strict=True)) <= 1e-4


async def test_greedy_batched_equals_one_at_a_time(lm) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(lm, batch_wait_ms=50)
    prompts = [[5, 6, 7], list(range(100, 140)), [9]]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    together = await asyncio.gather(*(be.generate(p, sp) for p in prompts))
    alone = [await make_backend(lm, batch_wait_ms=0).generate(p, sp) for p in prompts]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


async def test_seed_reproducible_and_truncation_logprob_is_of_sampling_distribution(lm, hf) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(lm)
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=16, seed=11)
    a = await be.generate([1, 2, 3], sp)
    b = await be.generate([1, 2, 3], sp)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    c = await be.generate([1, 2, 3], SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                     max_tokens=16, seed=12))
    assert c.token_ids != a.token_ids
    # truncated distributions put all mass on <= 5 tokens: each logprob >= log(1/5)-ish bound
    # is not guaranteed, but every sampled token must be inside the top-5 of the raw logits
    ids = [1, 2, 3]
    for t in a.token_ids:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        assert t in torch.topk(logits, 5).indices.tolist()
        ids.append(t)
    assert all(lp <= 0.0 for lp in a.logprobs)


async def test_stops_by_token_string_and_length(lm, tiny_tokenizer) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(lm)
    free = await be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_tok = free.token_ids[5]
    g = await be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20,
                                                    stop_token_ids=[stop_tok]))
    assert g.finish_reason == "stop" and g.stop_kind == "stop_token"
    assert g.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]
    text = tiny_tokenizer.decode(free.token_ids)
    needle = text[8:10]
    g = await be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, stop=[needle]))
    assert g.stop_kind == "stop_string" and g.stop_string == needle
    assert needle in tiny_tokenizer.decode(g.token_ids)
    assert len(g.token_ids) < 20


async def test_weight_updates_are_versioned_and_never_go_back(lm, caplog) -> None:  # type: ignore[no-untyped-def]
    model, tok = load_causal_lm(str(lm[0].name_or_path), "float32")
    be = TorchBackend(EngineSection(weight_update="drain"), ModelSection(), model=model, tokenizer=tok)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    before = await be.generate([1, 2, 3], sp)
    assert before.token_versions == [0] * 8
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    # draining: an update issued while a sequence runs waits for it: it is all version 0
    slow = asyncio.create_task(be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=64)))
    base = be.health()["steps"]
    await until(lambda: be.health()["steps"] >= base + 2)
    assert await be.update_weights(1, TensorUpdate(new_state))
    during = await slow
    assert set(during.token_versions) == {0} and not during.mixed_versions
    after = await be.generate([1, 2, 3], sp)
    assert after.policy_version == 1 and set(after.token_versions) == {1}
    assert after.token_ids != before.token_ids or after.logprobs != before.logprobs
    assert not await be.update_weights(1, TensorUpdate(new_state))
    assert not await be.update_weights(0, TensorUpdate(new_state))
    assert "ignoring weight update to version 0" in caplog.text
    assert be.version == 1


async def test_bad_weight_update_names_the_tensor(lm) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(lm)
    with pytest.raises(ValueError, match="lacks"):
        await be.update_weights(5, TensorUpdate({"nope.weight": torch.zeros(2)}))
    assert be.version == 0


async def test_pause_holds_new_batches(lm) -> None:  # type: ignore[no-untyped-def]
    be = make_backend(lm)
    await be.pause()
    task = asyncio.create_task(be.generate([1, 2], SamplingParams(max_tokens=4)))
    await asyncio.sleep(0.1)
    assert not task.done()
    await be.resume()
    assert len((await task).token_ids) == 4


def test_batches_are_split_by_prompt_length() -> None:
    import asyncio as aio

    from rl360.serve.engines.torch_requests import Request, split_by_length

    loop = aio.new_event_loop()
    reqs = [Request([1] * n, SamplingParams(), loop.create_future()) for n in (80, 2000, 90, 120, 1900)]
    chunks = split_by_length(reqs)
    assert [[len(r.prompt_ids) for r in c] for c in chunks] == [[80, 90, 120], [1900, 2000]]
    loop.close()
