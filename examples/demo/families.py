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
import re
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


# ----------------------------------------------------------------------------- tool use
#
# Harbor-like tool-use episodes, written out as the chats the agent loop produces: HarborEnv's
# system prompt and built-in tools, the instruction as the user turn, assistant tool calls,
# the tools' results exactly as the ToolBox formats them, and a closing summary. Two families
# share the two demo Harbor tasks' shapes (run a script into a file; read a file and fix a
# buggy function) but never their files, names, commands or contents: the demo's names are
# kept out of the pools below and `tests/test_demo_data.py` checks every chat against the
# demo's Harbor task directories.

WORKDIR = "/app"
_VERBS = ("compute", "print", "count", "sum", "build", "gen", "calc", "check", "emit", "show")
_NOUNS = ("total", "score", "digest", "tally", "metric", "value", "summary", "result", "size",
          "parity")
SCRIPTS = tuple(f"{v}_{n}" for v in _VERBS for n in _NOUNS)
MODULES = ("calc", "mathutil", "helpers", "ops", "numbers", "textops", "util", "funcs", "core",
           "lib", "shapes", "tools")
# half of the file names are made-up words: the BPE splits them into pieces no other chat has,
# so the policy learns to copy a path it has never seen, piece by piece (as the demo's are)
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
DEMO_NAMES = ("make_report", "answer", "stats", "mean")  # the demo Harbor tasks' (never used)


def made_up(rng: random.Random, parts: int) -> str:
    while True:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(parts))
        if not any(d in name for d in DEMO_NAMES):
            return name


def pick_name(rng: random.Random, pool: tuple[str, ...], sep: str = "_") -> str:
    """A name from `pool` half of the time (never when it is empty), else a made-up one."""
    if pool and rng.random() < 0.5:
        return rng.choice(pool)
    if rng.random() < 0.5:
        return made_up(rng, rng.randint(2, 3))
    return made_up(rng, 2) + sep + made_up(rng, 2)
RUN_TEXTS = (
    "Run the script `{script}` and write the single number it prints to\n`{out}` (just the "
    "number).\n",
    "Run `{script}` and save the number it prints to `{out}`.\n",
)
FIX_TEXT = ("The function `{fn}` in `{path}` returns wrong results. Fix it so that it returns "
            "{text}. Do not rename the function.")


def _harbor_prompt_and_tools() -> tuple[str, list[dict[str, Any]]]:
    """HarborEnv's system prompt and tool list (the built-in tools), as the env sends them."""
    import msgspec

    from rl360.envs.harbor import SYSTEM_PROMPT
    from rl360.envs.tools import BUILTIN_TOOLS

    tools = [msgspec.to_builtins(t.spec) for t in BUILTIN_TOOLS.values()]
    for t in tools:
        t.setdefault("type", "function")
    return SYSTEM_PROMPT.format(workdir=WORKDIR), tools


def _call(i: int, name: str, **args: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{i}", "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)}}]}


def _result(i: int, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "content": content, "tool_call_id": f"call_{i}", "name": name}


def _wrap(text: str) -> str:
    """Wrapped at ~92 columns like the demo's instruction.md files, ending with a newline."""
    import textwrap

    return textwrap.fill(text, width=92, break_long_words=False, break_on_hyphens=False) + "\n"


def run_script_chat(rng: random.Random) -> list[dict[str, Any]]:
    """Run the script (a glob: the work dir holds the one script), its output redirected into
    the file the instruction names; then say so."""
    script = f"{WORKDIR}/{pick_name(rng, SCRIPTS)}.py"
    out = f"{WORKDIR}/{pick_name(rng, ())}.txt"  # always made up: copied, never recalled
    text = rng.choice(RUN_TEXTS).format(script=script, out=out)
    return [{"role": "user", "content": text},
            _call(0, "bash", command=f"python3 {WORKDIR}/*.py > {out}"),
            _result(0, "bash", "[exit code 0]"),
            {"role": "assistant", "content": f"Done: {out} holds the number."}]


def _bugs(expr: str, k: Any) -> list[tuple[str, str, str]]:
    """(buggy expression, old, new) of the bugs planted in a correct expression: a stray ` - 1`
    or ` + 1` (at the end, or around an integer constant), fixed by deleting it. (Wrong
    constants and operators were tried too: with their per-bug sed commands the 0.35M policy
    wrote no valid fix after 220 steps.)"""
    out = [(f"{expr} - 1", " - 1", ""), (f"{expr} + 1", " + 1", "")]
    if isinstance(k, int) and str(k) in expr and expr.count(str(k)) == 1:
        out.append((expr.replace(str(k), f"({k} - 1)"), " - 1", ""))
        out.append((expr.replace(str(k), f"({k} + 1)"), " + 1", ""))
    return out


def _changes(f: Family, k: Any, buggy: str) -> bool:
    """True when the buggy body gives another result (or raises) on one of the family's inputs."""
    good: dict[str, Any] = {}
    bad: dict[str, Any] = {}
    exec(solution(f, k), good)
    exec(f"def {f.func(k)}({f.arg}):\n    return {buggy}", bad)
    for x in f.inputs:
        try:
            if bad[f.func(k)](x) != good[f.func(k)](x):
                return True
        except Exception:
            return True
    return False


def _source(f: Family, k: Any, buggy: str) -> str:
    return f'def {f.func(k)}({f.arg}):\n    """Return {f.text(k)}."""\n    return {buggy}\n'


_SED_SPECIAL = re.compile(r"[\\/.*\[\]^$&']")


def planted_bugs(f: Family, k: Any) -> list[tuple[str, str, str]]:
    """The bugs of _bugs that one `sed -i 's/old/new/'` fixes (old once in the file: x - 11 - 1
    holds " - 1" twice; no character sed or the shell would read) and that change a result
    (s[:12] is s[:11] on every test input)."""
    return [b for b in _bugs(f.expr(k), k)
            if _source(f, k, b[0]).count(b[1]) == 1 and _changes(f, k, b[0])
            and not _SED_SPECIAL.search(b[1] + b[2])]


def fix_function_chat(rng: random.Random) -> list[dict[str, Any]]:
    """Show the work dir's Python file, fix the planted bug with sed, then say so. The file is
    reached by a glob (the work dir holds the one module): a 0.35M policy copies a path it has
    never seen poorly, a glob needs no copying."""
    while True:
        f = rng.choice(FAMILIES + EXTRA)
        k = rng.choice(free(f))
        bugs = planted_bugs(f, k)
        if bugs:
            break
    buggy, old, new = rng.choice(bugs)
    path = f"{WORKDIR}/{pick_name(rng, MODULES)}.py"
    text = _wrap(FIX_TEXT.format(fn=f.func(k), path=path, text=f.text(k)))
    source = _source(f, k, buggy)
    return [{"role": "user", "content": text},
            _call(0, "bash", command=f"cat {WORKDIR}/*.py"),
            _result(0, "bash", source.rstrip("\n") + "\n[exit code 0]"),
            _call(1, "bash", command=f"sed -i 's/{old}/{new}/' {WORKDIR}/*.py"),
            _result(1, "bash", "[exit code 0]"),
            {"role": "assistant", "content": f"Fixed {f.func(k)} in {path}."}]


TOOL_FAMILIES: dict[str, Callable[[random.Random], list[dict[str, Any]]]] = {
    "run_script": run_script_chat,
    "fix_function": fix_function_chat,
}


def tool_chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n tool-use chats (a family drawn uniformly), each with the Harbor system prompt and
    tools."""
    rng = random.Random(seed)
    system, tools = _harbor_prompt_and_tools()
    names = sorted(TOOL_FAMILIES)
    return [{"tools": tools,
             "messages": [{"role": "system", "content": system},
                          *TOOL_FAMILIES[rng.choice(names)](rng)]} for _ in range(n)]


TOOL_SHARE = 0.25  # of the warm-start chats


def warmstart_mix(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The demo's warm start: code chats (warmstart_chats) with TOOL_SHARE tool-use chats
    shuffled in."""
    n_tool = round(n * TOOL_SHARE)
    chats = warmstart_chats(n - n_tool, seed) + tool_chats(n_tool, seed + 1)
    random.Random(seed + 2).shuffle(chats)
    return chats


if __name__ == "__main__":
    if sys.argv[1:] == ["tasks"]:
        for t in demo_tasks():
            print(json.dumps(t))
    elif sys.argv[1:2] in (["warmstart"], ["tools"]):
        make = warmstart_mix if sys.argv[1] == "warmstart" else tool_chats
        for c in make(int(sys.argv[2]) if len(sys.argv) > 2 else 1000):
            print(json.dumps(c))
    else:
        sys.exit("usage: families.py tasks | warmstart [N] | tools [N]")
