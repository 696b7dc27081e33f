"""The torch engine's continuous batching, prefix cache and in-flight weight updates.

Ordering is asserted through the engine's step counter and request completion, never timing.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl360.recipe import EngineSection, ModelSection
from rl360.serve.engines.prefix_cache import PrefixCache
from rl360.serve.engines.torch_backend import TorchBackend, load_causal_lm
from rl360.types import SamplingParams
from rl360.weights.payloads import TensorUpdate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def lm(tiny_dir):  # type: ignore[no-untyped-def]
    return load_causal_lm(str(tiny_dir), "float32")


def make(lm, **kw) -> TorchBackend:  # type: ignore[no-untyped-def]
    return TorchBackend(EngineSection(**kw), ModelSection(), model=lm[0], tokenizer=lm[1])


async def until(cond) -> None:  # type: ignore[no-untyped-def]
    """Yield to the engine loop until `cond()` holds."""
    for _ in range(100_000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


async def test_requests_joining_a_running_batch_get_one_at_a_time_greedy_ids(lm) -> None:  # type: ignore[no-untyped-def]
    prompts = [[5, 6, 7], list(range(100, 140)), [9], list(range(30, 47)), [200, 201, 3, 4]]
    lengths = [40, 7, 25, 3, 16]
    alone = []
    for p, n in zip(prompts, lengths, strict=True):
        be = make(lm, batch_wait_ms=0)
        alone.append((await be.generate(p, SamplingParams(temperature=0.0, max_tokens=n))).token_ids)
        await be.close()
    be = make(lm, batch_wait_ms=0, prefix_cache_mb=0)
    tasks = []
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        # each request arrives two steps after the previous one: every one joins a running batch
        await until(lambda i=i: be.health()["steps"] >= 2 * i)
        tasks.append(asyncio.create_task(be.generate(p, SamplingParams(temperature=0.0, max_tokens=n))))
        # admitted before the next one is sent: a decode burst can run the step counter past
        # 2 * (i + 1) before the engine thread hands back, and two requests would join together
        await until(lambda i=i: be.health()["batches"] >= i + 1)
    together = await asyncio.gather(*tasks)
    assert [g.token_ids for g in together] == alone
    assert be.health()["batches"] == len(prompts), "each request should have joined on its own"


async def test_a_request_arriving_mid_batch_finishes_before_the_batch(lm) -> None:  # type: ignore[no-untyped-def]
    be = make(lm, batch_wait_ms=0)
    long = asyncio.create_task(be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200)))
    await until(lambda: be.health()["steps"] >= 3)
    joined_at = be.health()["steps"]
    short = await be.generate([7, 8], SamplingParams(temperature=0.0, max_tokens=4))
    done_at = be.health()["steps"]
    assert len(short.token_ids) == 4
    assert not long.done(), "the short request waited for the long one"
    # admitted at the next step boundary, then one token a step. The counter is read when this
    # coroutine wakes up, and the engine thread keeps stepping the long row meanwhile: on a
    # loaded box that is several steps late (CI saw 4 + 4). Waiting for the batch would take
    # the long row's ~197 remaining steps
    assert done_at - joined_at <= 4 + 12
    assert len((await long).token_ids) == 200


async def test_cancelled_request_leaves_the_batch(lm) -> None:  # type: ignore[no-untyped-def]
    be = make(lm, batch_wait_ms=0)
    keep = asyncio.create_task(be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60)))
    drop = asyncio.create_task(be.generate([4, 5], SamplingParams(temperature=0.0, max_tokens=10_000)))
    await until(lambda: be.health()["running"] == 2)
    drop.cancel()
    await until(lambda: be.health()["cancelled"] == 1)
    assert be.health()["running"] == 1
    assert len((await keep).token_ids) == 60
    ref = make(lm, batch_wait_ms=0)
    assert (await keep).token_ids == (await ref.generate(
        [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60))).token_ids


async def test_prefix_cache_hit_gives_the_same_outputs(lm) -> None:  # type: ignore[no-untyped-def]
    cached, plain = make(lm), make(lm, prefix_cache_mb=0)
    turn1 = list(range(40, 70))
    first = await cached.generate(turn1, GREEDY)
    # the next turn: the previous prompt and reply, then a tool response
    turn2 = turn1 + first.token_ids + [11, 12, 13, 14, 15]
    for sp in (GREEDY, SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=5)):
        hit = await cached.generate(turn2, sp)
        miss = await plain.generate(turn2, sp)
        assert hit.token_ids == miss.token_ids
        assert max(abs(a - b) for a, b in zip(hit.logprobs, miss.logprobs, strict=True)) <= 1e-4
    h = cached.health()
    assert h["prefix_hits"] == 2 and h["prefix_tokens_reused"] >= 2 * (len(turn1) + 11)
    assert plain.health()["prefix_hits"] == 0


async def test_a_groups_identical_prompts_share_one_prefill(lm) -> None:  # type: ignore[no-untyped-def]
    """A group's members arrive together with one prompt: one prefill serves them (the
    others' rows get its K/V), and each still samples on its own: the same tokens and logprobs
    as the same seeded request sent alone."""
    a, b = list(range(40, 70)), [7, 8, 9, 10, 11]
    reqs = [(a, 1), (b, 2), (a, 3), (a, 4), (b, 5), (list(range(40, 69)), 6)]

    def sp(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=10, seed=seed)

    alone = []
    for p, seed in reqs:
        be = make(lm, prefix_cache_mb=0)
        alone.append(await be.generate(p, sp(seed)))
        await be.close()
    be = make(lm, batch_wait_ms=50, prefix_cache_mb=0)
    together = await asyncio.gather(*(be.generate(p, sp(seed)) for p, seed in reqs))
    h = be.health()
    assert h["batches"] == 1, "the requests should have been admitted together"
    assert h["prefills_shared"] == 3  # a x 3 and b x 2: two prefills instead of five
    for one, many in zip(alone, together, strict=True):
        assert many.token_ids == one.token_ids
        assert max(abs(x - y) for x, y in zip(many.logprobs, one.logprobs, strict=True)) <= 1e-4
    assert len({tuple(g.token_ids) for g in together[:1] + together[2:4]}) > 1  # own samples
    await be.close()


async def test_copies_of_a_cached_prompt_take_their_leaders_kv_not_the_cache(lm) -> None:  # type: ignore[no-untyped-def]
    """The next turn of a group, sent together: the leader reuses the cached prefix once, its
    copies take its K/V (one cache hit, not one per request), and the outputs match a plain
    engine's."""
    cached, plain = make(lm, batch_wait_ms=50), make(lm, batch_wait_ms=50, prefix_cache_mb=0)
    turn1 = list(range(40, 70))
    first = await cached.generate(turn1, GREEDY)
    await plain.generate(turn1, GREEDY)
    turn2 = turn1 + first.token_ids + [11, 12, 13]
    sps = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in (1, 2, 3)]
    hit = await asyncio.gather(*(cached.generate(turn2, sp) for sp in sps))
    miss = await asyncio.gather(*(plain.generate(turn2, sp) for sp in sps))
    h = cached.health()
    assert h["prefix_hits"] == 1 and h["prefills_shared"] == 2
    assert h["prefix_tokens_reused"] == len(turn1) + len(first.token_ids) - 1
    for a, b in zip(hit, miss, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-4
    await cached.close()
    await plain.close()


def test_prefix_cache_is_lru_by_bytes() -> None:
    kv = lambda n: torch.zeros(1, 2, 1, n, 4)  # noqa: E731  (32 bytes a token)
    cache = PrefixCache(budget_bytes=32 * 75, min_tokens=2)
    a, b = list(range(50)), list(range(100, 150))
    cache.insert(a, kv(50))
    cache.insert(b, kv(50))
    assert len(cache) == 1 and cache.lookup([*a, 1])[0] == 0  # a was evicted for b
    assert cache.lookup([*b, 1])[0] == 50
    assert cache.lookup([*b[:20], 7, 7])[0] == 20  # the longest common prefix counts
    cache.insert([*b, 1, 2], kv(52))  # extends b: b's entry is dropped, not kept twice
    assert len(cache) == 1


async def test_inflight_update_tags_later_tokens_with_the_new_version(lm) -> None:  # type: ignore[no-untyped-def]
    model, tok = load_causal_lm(str(lm[0].name_or_path), "float32")
    be = TorchBackend(EngineSection(batch_wait_ms=0), ModelSection(), model=model, tokenizer=tok)
    sp = SamplingParams(temperature=0.0, max_tokens=80)
    reference = await be.generate([1, 2, 3], sp)  # all version 0
    new_state = {k: v + 0.2 * torch.randn_like(v) for k, v in model.state_dict().items()}
    run = asyncio.create_task(be.generate([1, 2, 3], sp))
    await until(lambda: be.health()["steps"] >= 90 + 5)  # 5 tokens into the second request
    assert await be.update_weights(1, TensorUpdate(new_state))
    assert not run.done(), "the update waited for the running sequence"
    gen = await run
    switch = gen.token_versions.index(1)
    assert switch >= 5 and gen.token_versions == [0] * switch + [1] * (80 - switch)
    assert gen.mixed_versions and gen.policy_version == 1
    assert gen.token_ids[:switch] == reference.token_ids[:switch]
    assert gen.token_ids != reference.token_ids  # the new weights did take over
    assert be.health()["sync_pause_max_s"] > 0


async def test_a_sequence_that_ran_across_a_swap_leaves_no_kv_in_the_prefix_cache(lm) -> None:  # type: ignore[no-untyped-def]
    """Its prompt's K/V came from the old weights: cached, it would make the next request with
    that prompt (a group's next member) sample from the old encoding under a new version tag."""
    model, tok = load_causal_lm(str(lm[0].name_or_path), "float32")
    be = TorchBackend(EngineSection(batch_wait_ms=0), ModelSection(), model=model, tokenizer=tok)
    prompt, sp = list(range(40, 70)), SamplingParams(temperature=0.0, max_tokens=40)
    new_state = {k: v + 0.2 * torch.randn_like(v) for k, v in model.state_dict().items()}
    run = asyncio.create_task(be.generate(prompt, sp))
    await until(lambda: be.health()["steps"] >= 5)
    assert await be.update_weights(1, TensorUpdate(new_state))
    assert not run.done() and set((await run).token_versions) == {0, 1}
    assert be.health()["prefix_entries"] == 0
    fresh_model, _ = load_causal_lm(str(lm[0].name_or_path), "float32")
    fresh_model.load_state_dict(new_state)
    fresh = TorchBackend(EngineSection(batch_wait_ms=0, prefix_cache_mb=0), ModelSection(),
                         model=fresh_model, tokenizer=tok)
    want = await fresh.generate(prompt, sp)
    for _ in range(2):  # a miss, then a hit on the new weights' own K/V
        got = await be.generate(prompt, sp)
        assert got.token_ids == want.token_ids and set(got.token_versions) == {1}
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= 1e-4
    assert be.health()["prefix_hits"] == 1
    await be.close()
    await fresh.close()


async def test_drain_update_waits_for_running_sequences(lm) -> None:  # type: ignore[no-untyped-def]
    model, tok = load_causal_lm(str(lm[0].name_or_path), "float32")
    be = TorchBackend(EngineSection(batch_wait_ms=0, weight_update="drain"), ModelSection(),
                      model=model, tokenizer=tok)
    run = asyncio.create_task(be.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60)))
    await until(lambda: be.health()["steps"] >= 3)
    update = asyncio.create_task(be.update_weights(1, TensorUpdate(dict(model.state_dict()))))
    await until(lambda: be.health()["steps"] >= 6)
    late = asyncio.create_task(be.generate([4, 5], SamplingParams(temperature=0.0, max_tokens=3)))
    assert await update
    assert run.done() and set(run.result().token_versions) == {0}
    assert not late.done() or set(late.result().token_versions) == {1}
    assert set((await late).token_versions) == {1}  # admitted only after the swap


def test_unsupported_model_type_is_refused_in_one_line() -> None:
    from types import SimpleNamespace

    from rl360.serve.engines.torch_model import check_supported

    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        check_supported(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))


class _HeldUpdate(dict):  # type: ignore[type-arg]
    """A version's tensors that record the thread that reads them and hold the swap until the
    test lets it go, so the test can act while the weights are changing."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        import threading

        super().__init__(state)
        self.started, self.release = threading.Event(), threading.Event()
        self.thread = ""

    def __iter__(self):  # type: ignore[no-untyped-def]
        import threading

        if not self.started.is_set():  # the swap's first look at the names
            self.thread = threading.current_thread().name
            self.started.set()
            assert self.release.wait(60)
        return super().__iter__()


async def test_inflight_swap_runs_on_the_engine_thread_between_two_decode_steps(lm) -> None:  # type: ignore[no-untyped-def]
    """In-flight mode: the swap happens on the engine thread inside its decode loop; a running
    sequence gets its next token one step after the swap (its tokens carry both versions), and
    a request that arrives while the weights change waits for nobody's sequence to finish."""
    model, tok = load_causal_lm(str(lm[0].name_or_path), "float32")
    be = TorchBackend(EngineSection(batch_wait_ms=0), ModelSection(), model=model, tokenizer=tok)
    sp = SamplingParams(temperature=0.0, max_tokens=200)
    long = asyncio.create_task(be.generate([1, 2, 3], sp))
    await until(lambda: be.health()["steps"] >= 5)
    upd = _HeldUpdate({k: v + 0.2 * torch.randn_like(v) for k, v in model.state_dict().items()})
    update = asyncio.create_task(be.update_weights(1, TensorUpdate(upd)))
    await until(upd.started.is_set)
    # weights are changing now; a new request arrives meanwhile
    late = asyncio.create_task(be.generate([4, 5], SamplingParams(temperature=0.0, max_tokens=3)))
    await asyncio.sleep(0.01)
    assert not long.done() and not late.done()
    upd.release.set()
    assert await update
    assert upd.thread.startswith("rl360-torch-engine")  # the engine thread itself swapped
    short = await late
    assert not long.done(), "the new request waited for the running sequence"
    assert set(short.token_versions) == {1}
    gen = await long
    switch = gen.token_versions.index(1)
    assert switch >= 5 and gen.token_versions == [0] * switch + [1] * (200 - switch)
    (entry,) = be.sync_log
    assert entry["version"] == 1 and entry["rows"] == 1
    assert entry["steps_across"] == 1  # the row's next token came from the step right after
    assert entry["pause_s"] >= entry["swap_s"] > 0
    assert be.health()["sync_pause_max_s"] == entry["pause_s"]
    # the engine thread's minor page faults in the swap and the steps around it (a step on
    # weights this process has mapped takes none; bench/cold_weights.py for what it does take)
    assert all(isinstance(entry[k], int) and entry[k] >= 0
               for k in ("swap_faults", "step_faults", "step_before_faults"))


async def test_step_changes_are_the_control_and_leave_out_the_step_after_a_swap(lm) -> None:  # type: ignore[no-untyped-def]
    """`step_changes` (the control the bench sets the pause across a swap against): one entry
    per plain decode step that follows a plain step of the same rows; the step right after an
    in-flight swap is not one of them."""
    n = 200
    sp = SamplingParams(temperature=0.0, max_tokens=n)
    be = make(lm, batch_wait_ms=0)
    gen = await be.generate([1, 2, 3], sp)  # one prefill step, then n - 1 plain decode steps
    assert len(gen.token_ids) == n and len(be.step_changes) == n - 2
    assert be.health()["step_change_max_s"] == max(be.step_changes)
    await be.close()

    model, tok = load_causal_lm(str(lm[0].name_or_path), "float32")
    be = TorchBackend(EngineSection(batch_wait_ms=0), ModelSection(), model=model, tokenizer=tok)
    run = asyncio.create_task(be.generate([1, 2, 3], sp))
    await until(lambda: be.health()["steps"] >= 4)
    upd = _HeldUpdate(dict(model.state_dict()))
    upd.release.set()
    assert await be.update_weights(1, TensorUpdate(upd))
    gen = await run
    assert len(gen.token_ids) == n and len(be.sync_log) == 1 and 1 in gen.token_versions
    assert len(be.step_changes) == n - 3  # the step after the swap left out
    # the swap came between two decode steps of the one row: it counts for the bar, as its
    # pause minus the swap minus the plain step before it
    entry, health = be.sync_log[0], be.health()
    assert entry["same_rows"] and health["sync_over_n"] == 1
    assert health["sync_over_max_s"] == health["sync_over_median_s"] == pytest.approx(
        entry["pause_s"] - entry["swap_s"] - entry["step_before_s"])
    await be.close()


async def test_waiting_requests_get_a_row_lowest_priority_first(lm) -> None:  # type: ignore[no-untyped-def]
    """One row, busy: the queued requests are admitted by `priority` (lower first), in arrival
    order within one priority (the controller's start order: the oldest batch's turns first)."""
    be = make(lm, batch_wait_ms=0, max_batch_size=1)
    done: list[str] = []

    async def gen(name: str, prio: int, n: int) -> None:
        await be.generate([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=n, priority=prio))
        done.append(name)

    first = asyncio.create_task(gen("running", 9, 60))
    await until(lambda: be.health()["steps"] >= 2)
    queued = [asyncio.create_task(gen(name, prio, 3))
              for name, prio in [("b5", 5), ("c1", 1), ("d5", 5), ("e0", 0)]]
    await until(lambda: be.health()["queued"] == 4)
    await asyncio.gather(first, *queued)
    assert done == ["running", "e0", "c1", "b5", "d5"]
    await be.close()
