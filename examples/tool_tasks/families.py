"""Task families for tool use in a sandbox: small shell jobs a real chat model can learn.

Each family draws one instance from a `random.Random`: the files the agent starts with, the
instruction, a reference solution (a bash script that scores 1) and what the verifier needs to
check the result (`expected`, written to the task's tests/, which the agent never sees). The
verifier (check.py) compares the agent's work dir against values computed here, from the
pristine inputs; it never runs or imports what the agent wrote.

Families (each needs the tools: the answer is in a file the model has not seen, or the job is
a change to the sandbox's files). Where SmolLM2-135M-Instruct does not reach for the right
command by itself (counting, searching, running a script, editing), the instruction names the
command; the model still has to write the whole command line (arguments, file names,
redirection) and act on what it reads:
- count_lines: write the number of lines of a file to answer.txt
- run_script: run a Python script and save what it prints
- grep_lines: save the lines of a log that contain a word
- read_value: read a key's value from a config file and write it to answer.txt
- rename: rename a file
- move_into: move a file into a folder
- json_edit: set one key of a JSON file
- fix_bug: fix a one-token bug in a script so it computes what it should
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STEMS = (
    "notes", "data", "report", "items", "todo", "names", "words", "list", "records", "memo",
    "draft", "summary", "inventory", "guests", "cities", "fruits", "colors", "tasks", "log",
    "entries", "values", "results", "scores", "orders", "books", "songs", "plants", "tools",
    "events", "errors", "metrics", "samples", "users", "hosts", "jobs", "parts", "stock",
)
WORDS = (
    "apple", "river", "stone", "cloud", "green", "table", "light", "house", "paper", "music",
    "water", "bread", "chair", "night", "money", "plant", "train", "sugar", "glass", "field",
    "horse", "pilot", "smile", "storm", "tiger", "lemon", "ocean", "piano", "radio", "salad",
    "honey", "candle", "garden", "window", "bottle", "forest", "silver", "pocket", "yellow",
    "rabbit", "orange", "button", "dragon", "castle", "rocket", "puzzle", "basket", "mirror",
)
KEYS = ("port", "user", "mode", "level", "timeout", "host", "name", "size", "color", "limit",
        "retries", "region", "owner", "theme", "version", "workers")
LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
MESSAGES = ("disk almost full", "request served", "user logged in", "cache miss", "job started",
            "job finished", "connection reset", "retrying upload", "config reloaded",
            "slow query", "token expired", "backup done", "queue is empty", "worker restarted")
FOLDERS = ("archive", "backup", "done", "old", "inbox", "outbox", "saved", "drafts", "keep",
           "misc", "shared", "public")


@dataclass
class Instance:
    family: str
    instruction: str
    files: dict[str, str]  # path relative to the work dir -> content
    solution: str  # bash, run in the work dir
    expected: dict[str, Any]  # what check.py compares against
    key: str = ""  # identity of the instance (family + its inputs), for split disjointness
    meta: dict[str, Any] = field(default_factory=dict)


def _fname(rng: random.Random, ext: str, taken: set[str] | None = None) -> str:
    while True:
        name = f"{rng.choice(STEMS)}_{rng.randrange(10, 100)}.{ext}"
        if not taken or name not in taken:
            return name


def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


def count_lines(rng: random.Random) -> Instance:
    f = _fname(rng, "txt")
    n = rng.randint(3, 40)
    text = "".join(_line(rng) + "\n" for _ in range(n))
    return Instance(
        "count_lines",
        f"Count the lines in the file {f} with wc and write the number to answer.txt.",
        {f: text}, f"wc -l < {f} > answer.txt",
        {"kind": "number", "path": "answer.txt", "value": n})


def run_script(rng: random.Random) -> Instance:
    s = _fname(rng, "py")
    out = _fname(rng, "txt")
    nums = [rng.randint(1, 50) for _ in range(rng.randint(2, 5))]
    k = rng.randint(2, 9)
    word = rng.choice(WORDS)
    code = (f"nums = {nums}\n"
            f"total = sum(nums) * {k}\n"
            f"print('{word}', total)\n")
    return Instance(
        "run_script",
        f"Run the Python script {s} with python3 and save what it prints to {out}.",
        {s: code}, f"python3 {s} > {out}",
        {"kind": "text", "path": out, "value": f"{word} {sum(nums) * k}"})


def grep_lines(rng: random.Random) -> Instance:
    f = _fname(rng, "log")
    out = _fname(rng, "txt", {f})
    level = rng.choice(LEVELS)
    while True:
        lines = [f"{rng.choice(LEVELS)} {rng.choice(MESSAGES)} id={rng.randrange(1000, 9999)}"
                 for _ in range(rng.randint(6, 20))]
        hits = [ln for ln in lines if ln.split()[0] == level]
        if 1 <= len(hits) < len(lines):
            break
    return Instance(
        "grep_lines",
        f"Use grep to write every line of {f} that contains {level} to {out}.",
        {f: "".join(ln + "\n" for ln in lines)}, f"grep {level} {f} > {out}",
        {"kind": "lines", "path": out, "value": hits})


def read_value(rng: random.Random) -> Instance:
    f = _fname(rng, "cfg")
    keys = rng.sample(KEYS, rng.randint(3, 7))
    values = {k: str(rng.randrange(2, 9999)) if rng.random() < 0.5 else rng.choice(WORDS)
              for k in keys}
    key = rng.choice(keys)
    return Instance(
        "read_value",
        f"The file {f} sets {key}. Write the value of {key} to answer.txt.",
        {f: "".join(f"{k}={v}\n" for k, v in values.items())},
        f"grep '^{key}=' {f} | cut -d= -f2 > answer.txt",
        {"kind": "text", "path": "answer.txt", "value": values[key]})


def rename(rng: random.Random) -> Instance:
    a = _fname(rng, "txt")
    b = _fname(rng, "txt", {a})
    text = "".join(_line(rng) + "\n" for _ in range(rng.randint(1, 6)))
    return Instance(
        "rename", f"Rename the file {a} to {b}.", {a: text}, f"mv {a} {b}",
        {"kind": "moved", "src": a, "dest": b, "content": text})


def move_into(rng: random.Random) -> Instance:
    f = _fname(rng, "txt")
    d = rng.choice(FOLDERS)
    text = "".join(_line(rng) + "\n" for _ in range(rng.randint(1, 6)))
    return Instance(
        "move_into", f"Move the file {f} into the folder {d}.",
        {f: text, f"{d}/README": f"files kept in {d}\n"}, f"mv {f} {d}/",
        {"kind": "moved", "src": f, "dest": f"{d}/{f}", "content": text})


def json_edit(rng: random.Random) -> Instance:
    f = _fname(rng, "json")
    keys = rng.sample(KEYS, rng.randint(3, 5))
    doc: dict[str, Any] = {k: rng.randrange(1, 500) for k in keys}
    key = rng.choice(keys)
    new = doc[key] + rng.randint(1, 99)
    return Instance(
        "json_edit", f"In the JSON file {f}, set {key} to {new} (python3 can edit JSON).",
        {f: json.dumps(doc, indent=2) + "\n"},
        f"python3 -c \"import json; d = json.load(open('{f}')); d['{key}'] = {new}; "
        f"json.dump(d, open('{f}', 'w'), indent=2)\"",
        {"kind": "json", "path": f, "value": {**doc, key: new}})


_BUGS = (  # (operator written, operator meant, what it does)
    ("-", "+", "the sum of"), ("+", "-", "the difference of"), ("*", "+", "the sum of"),
    ("+", "*", "the product of"),
)


def fix_bug(rng: random.Random) -> Instance:
    s = _fname(rng, "py")
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    wrong, right, what = rng.choice(_BUGS)
    va, vb = rng.choice(WORDS[:20]), rng.choice(WORDS[20:40])
    code = f"{va} = {a}\n{vb} = {b}\nprint({va} {wrong} {vb})\n"
    fixed = f"{va} = {a}\n{vb} = {b}\nprint({va} {right} {vb})\n"
    want = {"+": a + b, "-": a - b, "*": a * b}[right]
    return Instance(
        "fix_bug",
        f"The script {s} should print {what} {va} and {vb} ({want}). It has a one-character "
        f"bug. Fix the bug in {s} (sed -i can replace text in a file).",
        {s: code}, f"sed -i 's/{va} {wrong} {vb}/{va} {right} {vb}/' {s}",
        {"kind": "python_ast", "path": s, "value": fixed})


FAMILIES: dict[str, Callable[[random.Random], Instance]] = {
    f.__name__: f
    for f in (count_lines, run_script, grep_lines, read_value, rename, move_into, json_edit,
              fix_bug)
}


def instance_key(inst: Instance) -> str:
    """What makes two instances the same: the family, the files and the instruction."""
    return json.dumps([inst.family, inst.instruction, sorted(inst.files.items())],
                      sort_keys=True)


def draw(family: str, rng: random.Random) -> Instance:
    inst = FAMILIES[family](rng)
    inst.key = instance_key(inst)
    return inst
