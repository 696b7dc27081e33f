"""Keys that moved (rl360.recipe.loading.MOVED): an old key is refused in one line naming the
key it moved to, from a recipe, a `--set` or a section built with `checked`; the new key works;
CHANGELOG.md lists every move."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl360.recipe import (
    MOVED,
    RecipeError,
    TrainerSection,
    TrainSection,
    apply_overrides,
    checked,
    decode_recipe,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_key_is_refused_naming_the_new_one(old: str) -> None:
    with pytest.raises(RecipeError) as err:
        decode_recipe(apply_overrides({}, [f"{old}=1"]))
    assert str(err.value) == f"{old} moved to {MOVED[old]}"


def test_the_new_keys_hold_the_values() -> None:
    r = decode_recipe(apply_overrides({}, [
        "train.breaker.groups=3", "train.parking.after=2", "train.tail.keep=1",
        "train.curriculum.mode='positive-first'", "train.checkpoints.every=5",
        "trainer.megatron.tensor_parallel=2"]))
    assert (r.train.breaker.groups, r.train.parking.after, r.train.tail.keep) == (3, 2, 1)
    assert r.train.curriculum.mode == "positive-first" and r.train.checkpoints.every == 5
    assert r.trainer.megatron.tensor_parallel == 2


def test_the_old_flat_curriculum_and_section_level_keys_are_refused() -> None:
    with pytest.raises(RecipeError, match=r"^train\.curriculum = 'positive-first' moved to "
                                          r"train\.curriculum\.mode$"):
        decode_recipe({"train": {"curriculum": "positive-first"}})
    with pytest.raises(RecipeError, match=r"^train\.park_after moved to train\.parking\.after$"):
        checked(TrainSection, park_after=3)
    with pytest.raises(RecipeError, match=r"^trainer\.tensor_parallel moved to "
                                          r"trainer\.megatron\.tensor_parallel$"):
        checked(TrainerSection, tensor_parallel=2)


def test_the_changelog_lists_every_move() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    missing = [old for old, new in MOVED.items() if f"`{old}`" not in text or f"`{new}`" not in text]
    assert missing == []
