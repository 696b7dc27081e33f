"""BM25 top-k for a batch of queries at once, over a bm25s index: bm25s' scores, ~2.5x faster.

bm25s scores one query at a time: a float32 zero vector over the documents, then, for each
query token in order, `np.add.at` of that token's precomputed column (its eager index holds
one column of BM25 weights per token, CSC), then `argpartition` over every document. At a
search deployment's batch sizes its per-query Python, `add.at` and the partition of a row of
mostly equal zeros (introselect slows ~8x on ties) dominate. Here a batch is one dense
[queries, documents] float32 matrix (in slices of at most MAX_CELLS cells), filled token
position by token position with one fancy-indexed add each (inside one position a (query,
document) pair occurs once, so `+=` is exact), then one row-wise partition.

Scores are bit-identical to bm25s': the same float32 additions in the same order. The matrix
does not start at zero but at a distinct negative value per document, far below half an ulp
of any score (so a first addition rounds to the weight itself, exactly as 0 + w), which leaves
no two unscored documents equal. Ranking is by score, then by document index: a tie at the
k-th place keeps the lower index. bm25s breaks ties in whatever order its partition leaves
them, so on tied scores the two may list different (equally scored) documents; everywhere else
the lists are equal (tests/serve/search/test_search_index.py checks both on 3000 queries).
Indexes this cannot reproduce (BM25L / BM25+ with a non-occurrence term, or weights too small
for the offsets) fall back to `retrieve`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_CELLS = 1 << 22  # per slice of the batch: 16 MB of float32 scores
_OFFSET = 1e-37  # the start value of document d is -(d + 1) * _OFFSET


def supports(bm25: Any) -> bool:
    """True when `topk` gives this index's scores: eager float32 scores, no non-occurrence
    term, every weight positive and above 2**25 times the largest start offset."""
    sc = getattr(bm25, "scores", None)
    if getattr(bm25, "nonoccurrence_array", None) is not None or not isinstance(sc, dict):
        return False
    if "indptr" not in sc or np.dtype(bm25.dtype) != np.float32:
        return False
    data = sc["data"]
    floor = (int(sc["num_docs"]) + 1) * _OFFSET * 2.0**25
    return bool(data.size == 0 or data.min() > floor)


def token_ids(bm25: Any, toks: Sequence[Sequence[str]]) -> list[list[int]]:
    """Each query's token ids, unknown tokens left out (bm25s' get_tokens_ids)."""
    vocab = bm25.vocab_dict
    return [[vocab[t] for t in q if t in vocab] for q in toks]


def topk(bm25: Any, ids: Sequence[Sequence[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents [n, k] int64, scores [n, k] float32), best first, for queries given as token
    ids (each with at least one id); k is capped at the number of documents. Unscored
    documents that fill a short list have score 0."""
    n_docs = int(bm25.scores["num_docs"])
    k = max(1, min(k, n_docs))
    start = -np.arange(1, n_docs + 1, dtype=np.float32) * np.float32(_OFFSET)
    docs = np.empty((len(ids), k), dtype=np.int64)
    scores = np.empty((len(ids), k), dtype=np.float32)
    step = max(1, MAX_CELLS // n_docs)
    for lo in range(0, len(ids), step):
        part = ids[lo : lo + step]
        dense = _scores(bm25, part, start)
        docs[lo : lo + len(part)], scores[lo : lo + len(part)] = _best(dense, k)
    np.maximum(scores, 0, out=scores)
    return docs, scores


def _scores(bm25: Any, part: Sequence[Sequence[int]], start: np.ndarray) -> np.ndarray:
    sc = bm25.scores
    data, indices, indptr = sc["data"], sc["indices"], sc["indptr"]
    dense = np.empty((len(part), len(start)), dtype=np.float32)
    dense[:] = start
    for j in range(max(len(q) for q in part)):
        rows = np.fromiter((i for i, q in enumerate(part) if len(q) > j), dtype=np.int64)
        tok = np.fromiter((part[i][j] for i in rows), dtype=np.int64, count=len(rows))
        first = indptr[tok].astype(np.int64)
        lens = indptr[tok + 1].astype(np.int64) - first
        total = int(lens.sum())
        if total == 0:
            continue
        # the concatenated ranges indptr[t]:indptr[t + 1] of every row's token
        flat = np.arange(total) + np.repeat(first - (np.cumsum(lens) - lens), lens)
        dense[np.repeat(rows, lens), indices[flat]] += data[flat]
    return dense


def _best(dense: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest, by value then lower column first (no two values of a row are
    equal below zero, so only real score ties reach the tie-break)."""
    n, width = dense.shape
    kth = np.partition(dense, width - k, axis=1)[:, width - k]
    rows, cols = np.nonzero(dense >= kth[:, None])  # k per row, more on a tie at the k-th
    vals = dense[rows, cols]
    order = np.lexsort((cols, -vals, rows))
    rows, cols, vals = rows[order], cols[order], vals[order]
    rank = np.arange(len(rows)) - np.searchsorted(rows, np.arange(n))[rows]
    keep = rank < k
    docs = np.empty((n, k), dtype=np.int64)
    scores = np.empty((n, k), dtype=np.float32)
    docs[rows[keep], rank[keep]] = cols[keep]
    scores[rows[keep], rank[keep]] = vals[keep]
    return docs, scores
