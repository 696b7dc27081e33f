"""The demo's warm-start data is disjoint from the 30 demo tasks (no solution, test or
wording of a demo task in it), and the shipped code.jsonl is what the families generate."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _families():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("demo_families", REPO / "examples/demo/families.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["demo_families"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_shipped_tasks_are_the_generated_ones() -> None:
    fam = _families()
    shipped = [json.loads(line) for line in (REPO / "examples/tasks/code.jsonl").open()]
    assert shipped == list(fam.demo_tasks())


def test_warmstart_never_contains_a_demo_task() -> None:
    fam = _families()
    tasks = list(fam.demo_tasks())
    names = {t["entry_point"] for t in tasks}
    instructions = {t["instruction"] for t in tasks}
    solutions = {t["reference"] for t in tasks}
    pairs = fam.warmstart_pairs()
    assert len(pairs) > 100
    for q, a in pairs:
        assert q not in instructions and a not in solutions
        fn = re.match(r"def (\w+)\(", a).group(1)  # type: ignore[union-attr]
        assert fn not in names  # not even the function name of a demo task
    chats = fam.warmstart_chats(500, seed=1)
    assert {c["messages"][0]["content"] for c in chats}.isdisjoint(instructions)
