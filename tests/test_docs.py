"""The manual stays true to the code: every `rl360 ...` command in a fenced code block of
README.md and docs/*.md parses with the CLI's own argument parser (nothing is started), the
recipe and example files such a command names exist, and every relative link (and its
#anchor) in those documents resolves. No Ray, no torch: it runs in about a second."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from rl360.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
MANUAL = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = [*MANUAL, REPO / "ARCHITECTURE.md", REPO / "CHANGELOG.md", REPO / "bench" / "RESULTS.md"]

FENCE = re.compile(r"^(\s*)(```|~~~)(.*)$")
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}  # "text": diagrams and output
# [text](target) and ![alt](target); the target stops at whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block."""
    blocks: list[tuple[str, list[str]]] = []
    lang: str | None = None
    lines: list[str] = []
    marker = ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if lang is None and m:
            lang, marker, lines = m.group(3).strip().lower(), m.group(2), []
        elif lang is not None and line.strip().startswith(marker) and not line.strip()[3:]:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def shell_commands(lines: list[str]) -> list[str]:
    """Logical shell lines (backslash continuations joined, a leading `$ ` dropped)."""
    out: list[str] = []
    pending = ""
    for raw in lines:
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        out.append(line.removeprefix("$ "))
    return out


def rl360_argv(line: str) -> list[str] | None:
    """The argument list after `rl360` (or `python -m rl360`, or after `--` of a
    `ray job submit`), or None when the line does not run rl360."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value prefixes
    if words[:2] == ["ray", "job"] and "--" in words:
        words = words[words.index("--") + 1 :]
    for prefix in (["rl360"], ["python", "-m", "rl360"], [".venv/bin/rl360"]):
        if words[: len(prefix)] == prefix:
            return words[len(prefix) :]
    return None


def manual_commands() -> list[tuple[str, str]]:
    found = []
    for path in MANUAL:
        for lang, lines in fenced_blocks(path.read_text()):
            if lang not in SHELL_LANGS:
                continue
            for line in shell_commands(lines):
                if rl360_argv(line) is not None:
                    found.append((path.relative_to(REPO).as_posix(), line))
    return found


COMMANDS = manual_commands()


def test_the_manual_shows_commands() -> None:
    assert any(doc == "README.md" for doc, _ in COMMANDS), "README.md shows no rl360 command"


@pytest.mark.parametrize(("doc", "line"), COMMANDS, ids=[f"{d}: {c}" for d, c in COMMANDS])
def test_command_parses(doc: str, line: str) -> None:
    argv = rl360_argv(line)
    assert argv is not None
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:  # --help exits 0; a bad command exits 2
            assert exc.code == 0, f"{doc}: `{line}` does not parse: {err.getvalue().strip()}"
    for word in argv:
        if word.startswith(("recipes/", "examples/")) and not any(c in word for c in "*<{"):
            path = word.split(":", 1)[0]  # "examples/demo/families.py:warmstart_mix"
            assert (REPO / path).exists(), f"{doc}: `{line}` names {path}, which does not exist"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    found: list[str] = []
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            found += LINK.findall(CODE_SPAN.sub("", line))
    return found


LINKS = [
    (path.relative_to(REPO).as_posix(), target)
    for path in LINKED
    if path.exists()
    for target in links(path)
    if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
]


@pytest.mark.parametrize(("doc", "target"), LINKS, ids=[f"{d} -> {t}" for d, t in LINKS])
def test_link_resolves(doc: str, target: str) -> None:
    source = REPO / doc
    file_part, _, anchor = target.partition("#")
    dest = (source.parent / file_part).resolve() if file_part else source
    assert dest.exists(), f"{doc}: link to {target}: {file_part} does not exist"
    assert dest.is_relative_to(REPO), f"{doc}: link to {target} leaves the repository"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{doc}: link to {target}: no heading #{anchor}"
