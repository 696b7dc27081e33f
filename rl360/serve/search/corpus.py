"""Search corpora: JSONL documents (`id`, `title`, `text`), chunking with overlap, and a real
corpus that needs no download: the Python standard library's own documentation (the language
reference topics of `pydoc_data.topics` plus every importable stdlib module's docstring and the
docstrings of its public classes and functions), generated from this interpreter.

    write_stdlib_corpus("corpus.jsonl")            # or: rl360 index corpus-stdlib corpus.jsonl
    for chunk in chunk_documents(iter_documents("corpus.jsonl"), 1200, 200): ...
"""

from __future__ import annotations

import importlib
import inspect
import io
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import msgspec


class Document(msgspec.Struct, omit_defaults=True):
    id: str
    text: str
    title: str = ""


class Chunk(msgspec.Struct, omit_defaults=True):
    """One indexed passage: `id` is "<doc id>#<n>" (n from 0); hits are chunks."""

    id: str
    doc_id: str
    title: str
    text: str


class CorpusError(ValueError):
    """A corpus file is malformed; the message names the file and line."""


def iter_documents(path: str | os.PathLike[str]) -> Iterator[Document]:
    """Stream documents from a JSONL file (blank lines skipped); errors name file:line."""
    p = Path(path)
    if not p.is_file():
        raise CorpusError(f"{p}: no such corpus file")
    decoder = msgspec.json.Decoder(Document)
    seen: set[str] = set()
    with p.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = decoder.decode(line)
            except msgspec.DecodeError as e:
                raise CorpusError(f"{p}:{lineno}: not a document {{id, title, text}}: {e}") from None
            if doc.id in seen:
                raise CorpusError(f"{p}:{lineno}: duplicate document id {doc.id!r}")
            seen.add(doc.id)
            yield doc


def split_text(text: str, chunk_chars: int, overlap: int) -> list[str]:
    """Pieces of at most ~chunk_chars characters, cut at whitespace, each starting `overlap`
    characters before the previous one ended (a word cut in half moves to the next piece)."""
    if chunk_chars <= 0:
        raise ValueError("chunk_chars must be > 0")
    if not 0 <= overlap < chunk_chars:
        raise ValueError("overlap must be >= 0 and < chunk_chars")
    text = text.strip()
    if len(text) <= chunk_chars:
        return [text] if text else []
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + chunk_chars)
        if end < len(text):
            cut = text.rfind(" ", start + chunk_chars // 2, end)
            cut = max(cut, text.rfind("\n", start + chunk_chars // 2, end))
            end = cut if cut > start else end
        pieces.append(text[start:end].strip())
        if end >= len(text):
            break
        nxt = max(start + 1, end - overlap)
        space = text.find(" ", nxt, end)  # start the next piece on a word boundary
        start = space + 1 if 0 <= space < end else nxt
    return [p for p in pieces if p]


def chunk_documents(docs: Iterable[Document], chunk_chars: int = 1200,
                    overlap: int = 200) -> Iterator[Chunk]:
    for doc in docs:
        for n, piece in enumerate(split_text(doc.text, chunk_chars, overlap)):
            yield Chunk(id=f"{doc.id}#{n}", doc_id=doc.id, title=doc.title or doc.id, text=piece)


# ----------------------------------------------------------------------------- stdlib corpus

_SKIP_MODULES = re.compile(r"^(antigravity|this|idlelib|turtledemo|tkinter|turtle|test|lib2to3|"
                           r"ensurepip|venv|__phello__|_.*)(\.|$)")


def _public_members(mod: object) -> Iterator[tuple[str, str]]:
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for name in sorted(set(names)):
        obj = getattr(mod, name, None)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != getattr(mod, "__name__", None):
            continue  # re-exported from elsewhere: documented there
        doc = inspect.getdoc(obj)
        if doc:
            yield name, doc


def stdlib_documents() -> Iterator[Document]:
    """The stdlib's documentation that this interpreter carries: pydoc's language topics, and
    each importable public stdlib module's docstring with its public classes and functions
    (one document per module). Deterministic for a given Python build."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield Document(id=f"topic:{key}", title=f"Python language reference: {key}",
                       text=topics[key])
    for name in sorted(sys.stdlib_module_names):
        if _SKIP_MODULES.match(name):
            continue
        with warnings.catch_warnings(), redirect_stdout(io.StringIO()), \
                redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                mod = importlib.import_module(name)
            except BaseException:  # not built here (e.g. a missing C library) or not importable
                continue
        parts = [inspect.getdoc(mod) or ""]
        for member, doc in _public_members(mod):
            parts.append(f"{name}.{member}: {doc}")
        text = "\n\n".join(p for p in parts if p)
        if text.strip():
            yield Document(id=f"module:{name}", title=f"{name} module", text=text)


def write_documents(docs: Iterable[Document], out: str | os.PathLike[str]) -> int:
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with p.open("wb") as f:
        for doc in docs:
            f.write(msgspec.json.encode(doc) + b"\n")
            n += 1
    return n


def write_stdlib_corpus(out: str | os.PathLike[str]) -> int:
    """Write the stdlib documentation corpus as JSONL; returns the number of documents."""
    return write_documents(stdlib_documents(), out)
