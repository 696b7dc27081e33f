"""The demo's warm-start data is disjoint from the 32 demo tasks (no solution, test or
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


HARBOR = REPO / "examples/tasks/harbor"


def _chat_text(chat: dict) -> str:  # type: ignore[type-arg]
    parts = []
    for m in chat["messages"]:
        parts.append(m.get("content") or "")
        parts += [c["function"]["arguments"] for c in m.get("tool_calls") or ()]
    return "\n".join(parts)


def test_tool_chats_never_contain_a_demo_harbor_task() -> None:
    """No demo Harbor task's instruction, file name, file content, solution command or expected
    output appears in the tool-use warm start (its families only share the tasks' shapes)."""
    fam = _families()
    tasks = sorted(p for p in HARBOR.iterdir() if p.is_dir())
    assert [t.name for t in tasks] == ["fix-mean-bug", "run-report-script"]
    banned = ["answer.txt", "def mean(", "`mean`", "sum(xs) / (len(xs) - 1)", "sum(xs) / len(xs)"]
    for t in tasks:
        banned.append((t / "instruction.md").read_text().strip())
        for f in (t / "environment" / "files").iterdir():
            banned += [f.name, f.stem, f.read_text().strip()]
        for line in (t / "solution" / "solve.sh").read_text().splitlines()[1:]:
            if line.strip() and line.strip() != "cd /app":
                banned.append(line.strip())
    chats = fam.tool_chats(2000, seed=3)
    assert {len(c["messages"]) for c in chats} == {5, 7}  # both families drawn
    for c in chats:
        text = _chat_text(c)
        for b in banned:
            assert b not in text, (b, text)


def test_tool_chats_are_what_the_harbor_env_sends_and_their_commands_work(tmp_path: Path) -> None:
    """Each tool chat opens with HarborEnv's system prompt and tools, and its commands do what
    the instruction asks: run in a copy of the work dir, the sed call turns the planted bug
    into the correct function (and the bug was one)."""
    import subprocess

    from rl360.envs.harbor import SYSTEM_PROMPT
    from rl360.envs.tools import BUILTIN_TOOLS

    fam = _families()
    for i, c in enumerate(fam.tool_chats(200, seed=4)):
        assert c["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT.format(workdir="/app")}
        assert [t["function"]["name"] for t in c["tools"]] == list(BUILTIN_TOOLS)
        msgs = c["messages"]
        calls = [json.loads(m["tool_calls"][0]["function"]["arguments"])["command"]
                 for m in msgs if m.get("tool_calls")]
        if len(msgs) == 5:  # run a script into a file
            _, dst = re.findall(r"`(/app/[^`]+)`", msgs[1]["content"])
            assert calls == [f"python3 /app/*.py > {dst}"]
            continue
        fn = re.search(r"`(\w+)`", msgs[1]["content"]).group(1)  # type: ignore[union-attr]
        source = msgs[3]["content"].removesuffix("\n[exit code 0]") + "\n"
        assert calls[0] == "cat /app/*.py"
        work = tmp_path / str(i)
        work.mkdir()
        (work / "mod.py").write_text(source)
        subprocess.run(calls[1].replace("/app/", f"{work}/"), shell=True, check=True)
        fixed = (work / "mod.py").read_text()
        family = next(f for f in fam.FAMILIES + fam.EXTRA
                      for k in fam.free(f) if f.func(k) == fn)
        k = next(k for k in fam.free(family) if family.func(k) == fn)
        ns: dict = {}  # type: ignore[type-arg]
        ref: dict = {}  # type: ignore[type-arg]
        buggy: dict = {}  # type: ignore[type-arg]
        exec(fixed, ns)
        exec(fam.solution(family, k), ref)
        exec(source, buggy)
        for x in family.inputs:
            assert ns[fn](x) == ref[fn](x), (fixed, x)
        assert any(_differs(buggy[fn], ref[fn], x) for x in family.inputs), source


def _differs(f, g, x) -> bool:  # type: ignore[no-untyped-def]
    try:
        return f(x) != g(x)
    except Exception:
        return True


def test_warm_start_mixes_code_and_tool_chats() -> None:
    fam = _families()
    chats = fam.warmstart_mix(1000, seed=0)
    n_tool = sum("tools" in c for c in chats)
    assert n_tool == round(1000 * fam.TOOL_SHARE) and 0 < n_tool < 1000
    code = [c for c in chats if "tools" not in c]
    # the code chats are warmstart_chats' own (shuffled in with the tool chats)
    assert sorted(map(json.dumps, code)) == sorted(map(json.dumps, fam.warmstart_chats(len(code), 0)))
