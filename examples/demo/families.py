"""Task families of the CPU demo: the 30 function-level demo tasks and the warm-start data.

Every demo task belongs to a family parameterised by a constant (add 7, count 'a', ...). The
demo tasks use RESERVED constants; the warm-start (SFT) data is generated from the same
families with every other constant, plus eight warm-start-only families (starts_with_<c>,
last_<k>_chars, ...), so no demo task's solution, tests or wording appears in it.
`python examples/demo/families.py tasks > examples/tasks/code.jsonl` regenerates the tasks;
`rl360 sft` calls `warmstart_chats()`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
          "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def word(k: int) -> str:
    """A number as it appears in a function name: 7 -> seven, 42 -> forty_two."""
    if k < 20:
        return _WORDS[k]
    tens, ones = divmod(k, 10)
    return _TENS[tens] + (f"_{_WORDS[ones]}" if ones else "")


@dataclass(frozen=True)
class Family:
    name: str
    arg: str
    func: Callable[[Any], str]  # constant -> function name
    text: Callable[[Any], str]  # constant -> what the function returns (instruction tail)
    expr: Callable[[Any], str]  # constant -> the returned expression
    constants: tuple[Any, ...]  # every constant the family may use
    reserved: tuple[Any, ...]  # the demo tasks' constants (never in warm-start data)
    inputs: tuple[Any, ...]  # test inputs


LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
INTS = tuple(range(2, 21))
STRS = ("banana", "hello world", "zebra pizza", "Mississippi")
LISTS = ([3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50, 60, 70], list(range(12)))

FAMILIES = [
    Family("add_k", "x", lambda k: f"add_{word(k)}", lambda k: f"x plus {k}",
           lambda k: f"x + {k}", INTS, (3, 7, 12), (0, 5, -2)),
    Family("sub_k", "x", lambda k: f"subtract_{word(k)}", lambda k: f"x minus {k}",
           lambda k: f"x - {k}", INTS, (4, 9, 15), (0, 20, -1)),
    Family("mul_k", "x", lambda k: f"times_{word(k)}", lambda k: f"x times {k}",
           lambda k: f"x * {k}", INTS, (4, 6, 11), (0, 2, -3)),
    Family("multiple_k", "x", lambda k: f"is_multiple_of_{word(k)}",
           lambda k: f"True if x is divisible by {k}, else False", lambda k: f"x % {k} == 0",
           INTS, (2, 3, 5), (12, 13, 20, 30)),
    Family("greater_k", "x", lambda k: f"is_greater_than_{word(k)}",
           lambda k: f"True if x is greater than {k}, else False", lambda k: f"x > {k}",
           INTS, (6, 10), (11, 10, 3, 7)),
    Family("less_k", "x", lambda k: f"is_less_than_{word(k)}",
           lambda k: f"True if x is less than {k}, else False", lambda k: f"x < {k}",
           INTS, (5, 8), (4, 8, 12, 6)),
    Family("count_char", "s", lambda c: f"count_{c}", lambda c: f"the number of times '{c}' occurs in s",
           lambda c: f"s.count('{c}')", LETTERS, ("a", "e", "z"), STRS),
    Family("mod_k", "x", lambda k: f"remainder_by_{word(k)}",
           lambda k: f"the remainder of x divided by {k}", lambda k: f"x % {k}",
           INTS, (3, 7), (10, 22, 5)),
    Family("repeat_k", "s", lambda k: f"repeat_{word(k)}_times", lambda k: f"s repeated {k} times",
           lambda k: f"s * {k}", INTS, (2, 3), ("ab", "x", "")),
    Family("prefix_k", "s", lambda k: f"first_{word(k)}_chars",
           lambda k: f"the first {k} characters of s", lambda k: f"s[:{k}]",
           INTS, (2, 4, 5), STRS),
    Family("item_k", "xs", lambda k: f"item_at_{word(k)}", lambda k: f"the item of xs at index {k}",
           lambda k: f"xs[{k}]", tuple(range(0, 7)), (1, 3), LISTS),
    Family("pow_k", "x", lambda k: f"power_{word(k)}", lambda k: f"x to the power {k}",
           lambda k: f"x ** {k}", tuple(range(2, 10)), (2, 3), (2, -3, 0, 5)),
]


# Warm-start-only families: no demo task is one of them. They put the demo's constants (letters,
# small numbers) into more names and bodies, so a short warm start learns to copy a constant
# from the instruction instead of recalling names it has seen. A reserved constant is reserved
# in its own family (count_a is a demo task; starts_with_a is not).
EXTRA = [
    Family("starts_char", "s", lambda c: f"starts_with_{c}",
           lambda c: f"True if s starts with '{c}', else False", lambda c: f"s.startswith('{c}')",
           LETTERS, (), STRS),
    Family("ends_char", "s", lambda c: f"ends_with_{c}",
           lambda c: f"True if s ends with '{c}', else False", lambda c: f"s.endswith('{c}')",
           LETTERS, (), STRS),
    Family("find_char", "s", lambda c: f"find_{c}",
           lambda c: f"the index of the first '{c}' in s, or -1", lambda c: f"s.find('{c}')",
           LETTERS, (), STRS),
    Family("remove_char", "s", lambda c: f"remove_{c}",
           lambda c: f"s without any '{c}'", lambda c: f"s.replace('{c}', '')",
           LETTERS, (), STRS),
    Family("suffix_k", "s", lambda k: f"last_{word(k)}_chars",
           lambda k: f"the last {k} characters of s", lambda k: f"s[-{k}:]", INTS, (), STRS),
    Family("drop_k", "s", lambda k: f"drop_first_{word(k)}_chars",
           lambda k: f"s without its first {k} characters", lambda k: f"s[{k}:]", INTS, (), STRS),
    Family("item_end_k", "xs", lambda k: f"item_from_end_{word(k)}",
           lambda k: f"the item of xs at index -{k}", lambda k: f"xs[-{k}]", tuple(range(1, 8)),
           (), LISTS),
    Family("floordiv_k", "x", lambda k: f"divide_by_{word(k)}",
           lambda k: f"x divided by {k}, rounded down", lambda k: f"x // {k}", INTS, (),
           (10, 22, 5)),
]


def instruction(f: Family, k: Any) -> str:
    return f"Write a Python function {f.func(k)}({f.arg}) that returns {f.text(k)}."


def solution(f: Family, k: Any) -> str:
    return f"def {f.func(k)}({f.arg}):\n    return {f.expr(k)}"


def tests(f: Family, k: Any) -> list[str]:
    ns: dict[str, Any] = {}
    exec(solution(f, k), ns)
    fn = ns[f.func(k)]
    return [f"assert {f.func(k)}({x!r}) == {fn(x)!r}" for x in f.inputs]


def demo_tasks() -> Iterator[dict[str, Any]]:
    i = 0
    for f in FAMILIES:
        for k in f.reserved:
            i += 1
            yield {"id": f"code-{i:02d}-{f.func(k)}", "instruction": instruction(f, k),
                   "entry_point": f.func(k), "tests": tests(f, k),
                   "reference": solution(f, k), "family": f.name}


def free(f: Family) -> list[Any]:
    """The family's constants no demo task uses (the warm start's)."""
    return [k for k in f.constants if k not in f.reserved]


def warmstart_pairs() -> list[tuple[str, str]]:
    """Every (instruction, solution) of the families with a non-reserved constant."""
    return [(instruction(f, k), solution(f, k)) for f in FAMILIES + EXTRA for k in free(f)]


def warmstart_chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n chats (user instruction -> assistant solution): a family drawn uniformly (the demo
    families and the warm-start-only ones), then one of its non-reserved constants (uniform
    over pairs, item_k's 5 constants would be rare)."""
    rng = random.Random(seed)
    families = [(f, free(f)) for f in FAMILIES + EXTRA]
    chats = []
    for _ in range(n):
        f, ks = rng.choice(families)
        k = rng.choice(ks)
        chats.append({"messages": [{"role": "user", "content": instruction(f, k)},
                                   {"role": "assistant", "content": solution(f, k)}]})
    return chats


if __name__ == "__main__":
    if sys.argv[1:] == ["tasks"]:
        for t in demo_tasks():
            print(json.dumps(t))
    elif sys.argv[1:2] == ["warmstart"]:
        for c in warmstart_chats(int(sys.argv[2]) if len(sys.argv) > 2 else 1000):
            print(json.dumps(c))
    else:
        sys.exit("usage: families.py tasks | warmstart [N]")
