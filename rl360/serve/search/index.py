"""A retrieval index over chunked documents: BM25 (bm25s, sparse, no model) and, when an
embedding model is given, a dense inner-product index (faiss) over normalized embeddings.

    build_index("corpus.jsonl", "idx/", chunk_chars=1200, overlap=200, embed_model="minilm")
    index = SearchIndex.load("idx/")
    index.search(["how do I sort a list"], k=5)     # -> [[Hit(id, doc_id, title, score, snippet)]]

On disk: meta.json (format, settings, counts), chunks.jsonl (one Chunk a line, in index
order), bm25/ (bm25s' own files) and, with a model, dense.faiss. Queries are tokenized exactly
like the chunks (lower-case words of 2+ characters, English stop words dropped); words the
index never saw are ignored, and a query with none left has no hits.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import numpy as np

from rl360.serve.search import bm25_batch
from rl360.serve.search.corpus import Chunk, chunk_documents, iter_documents

FORMAT = 1
Mode = Literal["bm25", "dense", "hybrid"]
_WORD = re.compile(r"(?u)\b\w\w+\b")


class Hit(msgspec.Struct, omit_defaults=True):
    id: str  # the chunk's id, "<doc id>#<n>"
    doc_id: str
    title: str
    score: float
    snippet: str = ""  # left out (and off the wire) when the request asked for no snippets


class SearchIndexError(ValueError):
    """An index directory that cannot be used; the message names it and what is wrong."""


class Searcher(Protocol):
    """What the search deployment serves; SearchIndex is the real one."""

    def search(self, queries: Sequence[str], k: int, mode: Mode = "bm25",
               snippets: bool = True) -> list[list[Hit]]: ...


_SNIPPET_CACHE = 200_000  # snippets kept (~300 characters each)


def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def tokenize(texts: Sequence[str], stop: frozenset[str]) -> list[list[str]]:
    return [[w for w in _WORD.findall(t.lower()) if w not in stop] for t in texts]


def first_positions(text: str) -> dict[str, int]:
    """Where each word (as `tokenize` cuts them) first occurs in `text`."""
    out: dict[str, int] = {}
    for m in _WORD.finditer(text.lower()):
        out.setdefault(m.group(), m.start())
    return out


def snippet(text: str, terms: Sequence[str], chars: int,
            positions: dict[str, int] | None = None) -> str:
    """`chars` characters of `text` around the first query word it contains (else its head);
    `positions` (first_positions(text)) saves scanning the text."""
    if len(text) <= chars:
        return text
    positions = positions if positions is not None else first_positions(text)
    return snippet_at(text, min([positions[t] for t in terms if t in positions], default=0), chars)


def snippet_at(text: str, pos: int, chars: int) -> str:
    """`chars` characters of `text` around character `pos`, cut at a word boundary."""
    start = max(0, min(pos - chars // 4, len(text) - chars))
    if start > 0:
        space = text.find(" ", start, start + 40)
        start = space + 1 if space >= 0 else start
    out = text[start : start + chars].strip()
    return ("..." if start > 0 else "") + out + ("..." if start + chars < len(text) else "")


def build_index(corpus: str | os.PathLike[str], out: str | os.PathLike[str], *,
                chunk_chars: int = 1200, overlap: int = 200, embed_model: str = "",
                embed_batch: int = 64) -> dict[str, Any]:
    """Chunk `corpus` (JSONL documents), index it under `out`; returns the meta dict."""
    import bm25s

    t0 = time.monotonic()
    root = Path(out)
    chunks = list(chunk_documents(iter_documents(corpus), chunk_chars, overlap))
    if not chunks:
        raise SearchIndexError(f"{corpus}: no documents with text to index")
    root.mkdir(parents=True, exist_ok=True)
    stop = _stopwords()
    retriever = bm25s.BM25()
    retriever.index(tokenize([f"{c.title}\n{c.text}" for c in chunks], stop), show_progress=False)
    retriever.save(str(root / "bm25"), show_progress=False)
    with (root / "chunks.jsonl").open("wb") as f:
        for c in chunks:
            f.write(msgspec.json.encode(c) + b"\n")
    dense: dict[str, Any] | None = None
    if embed_model:
        import faiss

        from rl360.serve.search.embed import Embedder

        emb = Embedder(embed_model)
        vecs = emb.encode([f"{c.title}\n{c.text}" for c in chunks], batch_size=embed_batch)
        dindex = faiss.IndexFlatIP(vecs.shape[1])
        dindex.add(vecs)
        faiss.write_index(dindex, str(root / "dense.faiss"))
        dense = {"model": embed_model, "dim": int(vecs.shape[1])}
    meta = {
        "format": FORMAT,
        "corpus": str(corpus),
        "chunks": len(chunks),
        "documents": len({c.doc_id for c in chunks}),
        "chunk_chars": chunk_chars,
        "overlap": overlap,
        "dense": dense,
        "build_s": round(time.monotonic() - t0, 3),
    }
    (root / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


class SearchIndex:
    """A loaded index; `search` is thread-safe for reads and answers a batch of queries."""

    def __init__(self, root: Path, meta: dict[str, Any], chunks: list[Chunk], bm25: Any,
                 dense: Any = None, embedder: Any = None, snippet_chars: int = 300) -> None:
        self.root, self.meta, self.chunks = root, meta, chunks
        self.bm25, self.dense, self.embedder = bm25, dense, embedder
        self.snippet_chars = snippet_chars
        self.stop = _stopwords()
        # per chunk, where each word first occurs (for snippets; filled as chunks are hit)
        self._positions: list[dict[str, int] | None] = [None] * len(chunks)
        # snippets by (chunk, position of the first query word in it): a snippet depends on
        # nothing else, and popular chunks are hit by many queries (cleared when it grows)
        self._snippets: dict[tuple[int, int], str] = {}

    @classmethod
    def load(cls, root: str | os.PathLike[str], snippet_chars: int = 300,
             dense: bool = True) -> SearchIndex:
        import bm25s

        p = Path(root)
        if not (p / "meta.json").is_file():
            raise SearchIndexError(f"{p}: not a search index (no meta.json; build one with "
                              "`rl360 index build CORPUS --out DIR`)")
        meta = json.loads((p / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise SearchIndexError(f"{p}: index format {meta.get('format')!r}, expected {FORMAT}; rebuild it")
        dec = msgspec.json.Decoder(Chunk)
        with (p / "chunks.jsonl").open("rb") as f:
            chunks = [dec.decode(line) for line in f if line.strip()]
        bm25 = bm25s.BM25.load(str(p / "bm25"))
        dindex = embedder = None
        if dense and meta.get("dense"):
            import faiss

            from rl360.serve.search.embed import Embedder

            dindex = faiss.read_index(str(p / "dense.faiss"))
            embedder = Embedder(meta["dense"]["model"])
        return cls(p, meta, chunks, bm25, dindex, embedder, snippet_chars)

    @property
    def has_dense(self) -> bool:
        return self.dense is not None

    def bm25_ranked(self, queries: Sequence[str], k: int,
                    toks: list[list[str]] | None = None) -> list[list[tuple[int, float]]]:
        """(chunk index, score) per query, best first; only chunks with a positive score. The
        whole batch is scored at once (bm25_batch: bm25s' own scores and order)."""
        k = max(1, min(k, len(self.chunks)))
        toks = toks if toks is not None else tokenize(queries, self.stop)
        out: list[list[tuple[int, float]]] = [[] for _ in queries]
        ids = bm25_batch.token_ids(self.bm25, toks)
        live = [i for i, q in enumerate(ids) if q]
        if not live:
            return out
        if bm25_batch.supports(self.bm25):
            docs, scores = bm25_batch.topk(self.bm25, [ids[i] for i in live], k)
        else:
            docs, scores = self.bm25.retrieve([toks[i] for i in live], k=k, show_progress=False)
        # scores are float32: rounded once here, as float64, for short wire numbers
        drows, srows = docs.tolist(), np.round(scores.astype(np.float64), 6).tolist()
        for row, i in enumerate(live):
            out[i] = [(d, s) for d, s in zip(drows[row], srows[row], strict=True) if s > 0]
        return out

    def dense_ranked(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        if self.dense is None:
            raise SearchIndexError(f"{self.root}: built without an embedding model (no dense index)")
        k = max(1, min(k, len(self.chunks)))
        vecs = self.embedder.encode(list(queries))
        scores, ids = self.dense.search(vecs, k)
        return [[(int(d), round(float(s), 6)) for d, s in zip(ids[r], scores[r], strict=True)
                 if d >= 0]
                for r in range(len(queries))]

    def search(self, queries: Sequence[str], k: int, mode: Mode = "bm25",
               snippets: bool = True) -> list[list[Hit]]:
        """Each query's hits, best first; `snippets=False` leaves the snippets out (ids,
        titles and scores only: what a caller that fetches text itself needs)."""
        toks = tokenize(queries, self.stop)
        if mode == "bm25":
            ranked = self.bm25_ranked(queries, k, toks)
        elif mode == "dense":
            ranked = self.dense_ranked(queries, k)
        else:  # reciprocal-rank fusion of both lists (60: the usual RRF constant)
            a, b = self.bm25_ranked(queries, k, toks), self.dense_ranked(queries, k)
            ranked = []
            for ra, rb in zip(a, b, strict=True):
                fused: dict[int, float] = {}
                for lst in (ra, rb):
                    for rank, (d, _) in enumerate(lst):
                        fused[d] = fused.get(d, 0.0) + 1.0 / (60 + rank + 1)
                ranked.append([(d, round(f, 6)) for d, f in
                               sorted(fused.items(), key=lambda x: (-x[1], x[0]))[:k]])
        if not snippets:
            chunks = self.chunks
            return [[Hit(chunks[d].id, chunks[d].doc_id, chunks[d].title, score)
                     for d, score in row] for row in ranked]
        return [self._hits(ranked[q], toks[q]) for q in range(len(queries))]

    def _hits(self, ranked: list[tuple[int, float]], toks: list[str]) -> list[Hit]:
        """One query's hits; a snippet is cut around the first of the query's words the chunk
        holds, and kept by (chunk, that position): it depends on nothing else."""
        terms = tuple(dict.fromkeys(toks))
        chunks, positions, cache, chars = self.chunks, self._positions, self._snippets, self.snippet_chars
        hits = []
        for d, score in ranked:
            c = chunks[d]
            pos = positions[d]
            if pos is None:
                pos = positions[d] = first_positions(c.text)
            at = min([pos[t] for t in terms if t in pos], default=0)
            snip = cache.get((d, at))
            if snip is None:
                if len(cache) >= _SNIPPET_CACHE:
                    cache.clear()
                snip = cache[(d, at)] = (c.text if len(c.text) <= chars
                                         else snippet_at(c.text, at, chars))
            hits.append(Hit(c.id, c.doc_id, c.title, score, snip))
        return hits


def as_float32(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))
