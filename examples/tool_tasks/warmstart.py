"""A short, generic warm start on the tool-call format (`sft.data =
"examples/tool_tasks/warmstart.py:format_chats"`).

The released SmolLM2-135M-Instruct writes no tool call in this setting (its calibration on the
tool tasks scores 0), so GRPO would get no signal. These chats teach the call format and the
turn shape: a user asks for a plain shell job, the assistant calls `bash`, reads the result
(acting on it in a second call where the job needs that: save a command's output to a file,
write down what a command printed), and ends with a one-line answer and no call. The jobs are
deliberately NOT the task families' (no counting, searching, running scripts, renaming,
moving, copying or editing files: no wc, grep, cut, mv, cp, rm, sed or python scripts), and the
file names come from their own pool, so no task instance, train or held-out, appears in them;
`tests/envs/test_tool_tasks.py` checks that. The system prompt and the tool list are the ones
the recipe's env sends.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

WORKDIR = "/app"
SYSTEM_PROMPT = (
    "You are an agent in a Linux sandbox; the work dir is {workdir}. Use the bash tool to do "
    "the task. When it is done, reply with one short sentence and no tool call."
)


def bash_spec() -> dict[str, Any]:
    """The bash tool exactly as HarborEnv sends it (env.params.tools = ["bash"])."""
    import msgspec

    from rl360.envs.tools import BUILTIN_TOOLS

    spec = msgspec.to_builtins(BUILTIN_TOOLS["bash"].spec)
    spec.setdefault("type", "function")
    return spec


NAMES = ("readme.md", "main.c", "photo.jpg", "setup.cfg", "index.html", "style.css", "app.js",
         "Makefile", "notes.org", "song.mp3", "build.sh", "logo.png", "todo.org", "data.db",
         "paper.pdf", "diary.txt", "recipe.txt", "poem.txt", "letter.txt", "hello.txt")
DIRS = ("src", "docs", "images", "bin", "assets", "tmp_files", "music", "videos", "lib", "www")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo")
LINES = ("hello there", "good morning", "see you soon", "all is well", "keep going",
         "nice to meet you", "thank you", "have a nice day", "well done", "on my way")

Job = tuple[str, list[tuple[str, str]], str]  # user text, [(command, output)], final answer


def _out(stdout: str = "", code: int = 0) -> str:
    """A tool result as HarborEnv's bash tool writes it."""
    return (stdout.rstrip("\n") + "\n" if stdout else "") + f"[exit code {code}]"


def _ls(rng: random.Random) -> Job:
    names = sorted(rng.sample(NAMES, rng.randint(2, 5)))
    return ("List the files in the work dir.", [("ls", _out("\n".join(names)))],
            f"The work dir holds {', '.join(names)}.")


def _pwd(rng: random.Random) -> Job:
    return (rng.choice(["Which directory am I in?", "Print the current directory."]),
            [("pwd", _out(WORKDIR))], f"The current directory is {WORKDIR}.")


def _mkdir(rng: random.Random) -> Job:
    d = rng.choice(DIRS)
    return (f"Create a folder named {d}.", [(f"mkdir {d}", _out())], f"Created the folder {d}.")


def _touch(rng: random.Random) -> Job:
    f = rng.choice(NAMES)
    return (f"Create an empty file called {f}.", [(f"touch {f}", _out())], f"Created {f}.")


def _echo(rng: random.Random) -> Job:
    text = rng.choice(LINES)
    return (f"Print the text '{text}'.", [(f"echo '{text}'", _out(text))], f"It printed: {text}.")


def _write(rng: random.Random) -> Job:
    f, w = rng.choice(NAMES), rng.choice(WORDS)
    return (f"Write the word {w} into the file {f}.", [(f"echo {w} > {f}", _out())],
            f"Wrote {w} to {f}.")


def _cat(rng: random.Random) -> Job:
    f = rng.choice(NAMES)
    body = "\n".join(rng.sample(LINES, rng.randint(1, 3)))
    return (f"Show me what is in {f}.", [(f"cat {f}", _out(body))],
            f"{f} says: {body.replace(chr(10), ' / ')}.")


def _head(rng: random.Random) -> Job:
    f, n = rng.choice(NAMES), rng.randint(1, 3)
    body = "\n".join(rng.sample(LINES, n))
    return (f"Show the first {n} lines of {f}.", [(f"head -n {n} {f}", _out(body))],
            f"Those are the first {n} lines of {f}.")


def _save_ls(rng: random.Random) -> Job:
    f = rng.choice(NAMES)
    return (f"Save the list of files in the work dir to {f}.", [(f"ls > {f}", _out())],
            f"Saved the file list to {f}.")


def _save_date(rng: random.Random) -> Job:
    f = rng.choice(NAMES)
    return (f"Save the current date and time to {f}.", [(f"date > {f}", _out())],
            f"Saved the date to {f}.")


def _save_head(rng: random.Random) -> Job:
    a, b = rng.sample(NAMES, 2)
    n = rng.randint(1, 5)
    return (f"Save the first {n} lines of {a} to {b}.", [(f"head -n {n} {a} > {b}", _out())],
            f"Saved the first {n} lines of {a} to {b}.")


def _pwd_write(rng: random.Random) -> Job:
    f = rng.choice(NAMES)
    return (f"Find out which directory you are in and write its path to {f}.",
            [("pwd", _out(WORKDIR)), (f"echo {WORKDIR} > {f}", _out())],
            f"Wrote {WORKDIR} to {f}.")


def _whoami_write(rng: random.Random) -> Job:
    f, user = rng.choice(NAMES), rng.choice(["nobody", "agent", "runner", "worker"])
    return (f"Find out which user you are and write the user name to {f}.",
            [("whoami", _out(user)), (f"echo {user} > {f}", _out())], f"Wrote {user} to {f}.")


def _cat_then_write(rng: random.Random) -> Job:
    a, b = rng.sample(NAMES, 2)
    word = rng.choice(WORDS)
    return (f"{a} holds one word. Write that word, in upper case, to {b}.",
            [(f"cat {a}", _out(word)), (f"echo {word.upper()} > {b}", _out())],
            f"Wrote {word.upper()} to {b}.")


def _date(rng: random.Random) -> Job:
    day = rng.choice(["Mon", "Tue", "Wed", "Thu", "Fri"])
    stamp = f"{day} Mar {rng.randint(1, 28)} {rng.randint(10, 23)}:{rng.randint(10, 59)}:00 UTC 2026"
    return ("What is the date today?", [("date", _out(stamp))], f"It is {stamp}.")


def _python_version(rng: random.Random) -> Job:
    v = f"Python 3.11.{rng.randint(2, 9)}"
    return ("Which Python version is installed?", [("python3 --version", _out(v))],
            f"{v} is installed.")


def _missing(rng: random.Random) -> Job:
    f = rng.choice(NAMES)
    err = f"cat: {f}: No such file or directory"
    return (f"Show me what is in {f}.", [(f"cat {f}", _out(f"[stderr]\n{err}", 1))],
            f"There is no file named {f}.")


def _mkdir_ls(rng: random.Random) -> Job:
    d = rng.choice(DIRS)
    names = sorted([*rng.sample(NAMES, rng.randint(1, 3)), d])
    return (f"Create a folder named {d}, then list the files.",
            [(f"mkdir {d}", _out()), ("ls", _out("\n".join(names)))],
            f"Created {d}; the work dir now holds {', '.join(names)}.")


JOBS: list[Callable[[random.Random], Job]] = [
    _ls, _pwd, _mkdir, _touch, _echo, _write, _cat, _head, _date, _python_version, _missing,
    _mkdir_ls, _save_ls, _save_date, _save_head, _pwd_write, _whoami_write, _cat_then_write,
]


def _call(i: int, command: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{i}", "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


def format_chats(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n chats, a job drawn uniformly for each."""
    rng = random.Random(seed)
    tools = [bash_spec()]
    chats = []
    for _ in range(n):
        user, steps, answer = rng.choice(JOBS)(rng)
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT.format(workdir=WORKDIR)},
            {"role": "user", "content": user}]
        for i, (cmd, out) in enumerate(steps):
            msgs += [_call(i, cmd),
                     {"role": "tool", "content": out, "tool_call_id": f"call_{i}", "name": "bash"}]
        msgs.append({"role": "assistant", "content": answer})
        chats.append({"tools": tools, "messages": msgs})
    return chats


if __name__ == "__main__":
    for c in format_chats(5):
        print(json.dumps(c))
