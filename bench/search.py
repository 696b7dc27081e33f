"""Search serving: queries/s through the `search` Serve deployment (POST /search over HTTP,
serve.batch) vs the same scorer in process (`SearchIndex.search`, what each replica runs per
batch) on the same queries and index: the ratio is what serving costs. The scorer's own speed-up
over `bm25s.retrieve` is reported apart, and recall@10 of the served hits against bm25s' (they
must be identical).

    .venv/bin/python bench/search.py [--queries 2000] [--concurrency 64] [--batch 32]
                                     [--replicas 1] [--index DIR] [--ingress haproxy|proxy]
                                     [--snippets]

Corpus: the Python stdlib's docs (`rl360 index stdlib-corpus`, built here unless --index).
Queries: 3-6 words drawn (seeded) from random chunks. Baseline: one `SearchIndex.search` call
over all queries in this process (the replica's own scorer, bm25_batch, one thread; snippets as
asked), tokenizing included. Reference for the hits and the scorer's speed-up: one bm25s
`retrieve` call over all queries (its batch mode, one thread): ids and scores. Ours:
`--concurrency` clients each sending requests of `--batch` queries (1 = one query per request,
what an agent's tool call sends; both are measured), asking for the same ids and scores
(`snippets: false`; `--snippets` asks for titles and snippets too), through the recipe's
`serve.ingress` (`--ingress`, default haproxy: Serve's HAProxy ingress; proxy: Serve's Python
proxy actor). Median of 3 runs each, with the spread; the load average is printed. Lists are
compared with the baseline's: recall@k, and "identical": the same scores at every rank and the
same documents at every score above the last one (at the k-th place a tie may be broken
either way: ours keeps the lower index, bm25s whatever its partition leaves). The last line is
{"bench": "search", "ours": <q/s served at --batch>, "baseline": <q/s, the same scorer in
process>, "ratio": ours/baseline, "scorer_speedup": <in-process scorer over bm25s>, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
REPO = Path(__file__).resolve().parents[1]


def build(tmp: Path) -> Path:
    for args in (["stdlib-corpus", str(tmp / "corpus.jsonl")],
                 ["build", str(tmp / "corpus.jsonl"), "--out", str(tmp / "index")]):
        subprocess.run([sys.executable, "-m", "rl360", "index", *args], cwd=REPO, check=True)
    return tmp / "index"


def make_queries(index_dir: Path, n: int, seed: int = 0) -> list[str]:
    from rl360.serve.search.index import SearchIndex

    chunks = SearchIndex.load(index_dir).chunks
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [w for w in rng.choice(chunks).text.split() if w.isalpha() and len(w) > 3]
        out.append(" ".join(rng.sample(words, min(len(words), rng.randint(3, 6)))) or "python")
    return out


Ranked = list[tuple[str, float]]  # one query's (chunk id, score) list, best first


def baseline(index_dir: Path, queries: list[str], k: int) -> tuple[float, list[Ranked]]:
    import bm25s

    from rl360.serve.search.index import SearchIndex, tokenize

    idx = SearchIndex.load(index_dir)
    retriever = bm25s.BM25.load(str(index_dir / "bm25"))
    t0 = time.perf_counter()
    docs, scores = retriever.retrieve(tokenize(queries, idx.stop), k=k, show_progress=False)
    wall = time.perf_counter() - t0
    ids = [[(idx.chunks[int(d)].id, round(float(s), 6)) for d, s in zip(drow, srow, strict=True)
            if s > 0] for drow, srow in zip(docs, scores, strict=True)]
    return len(queries) / wall, ids


async def served(url: str, queries: list[str], k: int, conc: int, batch: int,
                 warm: list[str], snippets: bool) -> tuple[float, list[Ranked]]:
    import aiohttp
    import msgspec

    reqs = [queries[i : i + batch] for i in range(0, len(queries), batch)]
    results: list[list[Ranked]] = [[] for _ in reqs]
    nxt = iter(range(len(reqs)))

    async def worker(http: aiohttp.ClientSession) -> None:
        for i in nxt:
            body: dict[str, object] = ({"query": reqs[i][0]} if batch == 1
                                       else {"queries": reqs[i]})
            body.update(k=k, snippets=snippets)
            async with http.post(url, json=body) as r:
                raw = await r.read()
                assert r.status == 200, raw[:300]
                data = msgspec.json.decode(raw)
            rows = [data["hits"]] if batch == 1 else data["results"]
            results[i] = [[(h["id"], h["score"]) for h in row] for row in rows]

    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn) as http:
        # warm up (connections, the replica's code paths) on other queries (`warm`): no
        # measured query was served before, so the replica's snippet cache holds only what
        # other queries put there
        measured = reqs
        reqs = [warm[i : i + batch] for i in range(0, len(warm), batch)]
        results = [[] for _ in reqs]
        nxt = iter(range(len(reqs)))
        await asyncio.gather(*(worker(http) for _ in range(min(conc, 8))))
        reqs, results = measured, [[] for _ in measured]
        nxt = iter(range(len(reqs)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(conc)))
        wall = time.perf_counter() - t0
    return len(queries) / wall, [row for rows in results for row in rows]


def same_up_to_ties(o: Ranked, b: Ranked) -> bool:
    """The same scores at every rank, and the same documents at each score above the last."""
    if [s for _, s in o] != [s for _, s in b]:
        return False
    last = b[-1][1] if b else 0.0
    return all({d for d, s in o if s == v} == {d for d, s in b if s == v}
               for v in {s for _, s in b if s > last})


def recall(ours: list[Ranked], base: list[Ranked]) -> tuple[float, float]:
    """(mean recall@k of ours against base over queries with hits, fraction identical up to
    ties at the k-th place)."""
    rec = [len({d for d, _ in o} & {d for d, _ in b}) / len(b)
           for o, b in zip(ours, base, strict=True) if b]
    same = sum(same_up_to_ties(o, b) for o, b in zip(ours, base, strict=True)) / len(base)
    return sum(rec) / len(rec), same


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.0f} q/s (min {min(xs):.0f}, max {max(xs):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="queries per request at batch load")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--index", default="")
    ap.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy")
    ap.add_argument("--snippets", action="store_true",
                    help="ask for titles and snippets too (the baseline returns ids and scores)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rl360-bench-search-"))
    index_dir = Path(args.index) if args.index else build(tmp)
    queries = make_queries(index_dir, args.queries)
    print(f"workload: {len(queries)} queries per run (fresh ones each run: the replica's snippet "
          f"cache never sees a query twice), k={args.k}, index {index_dir} "
          f"({json.loads((index_dir / 'meta.json').read_text())['chunks']} chunks), ingress "
          f"{args.ingress}, snippets {'on' if args.snippets else 'off'}; "
          f"cpus {os.cpu_count()}; load before {open('/proc/loadavg').read().split()[:3]}")
    from rl360.launch.ingress import check_ingress, ingress_env
    from rl360.recipe import ServeSection

    section = ServeSection(ingress=args.ingress)
    check_ingress(section)
    os.environ.update(ingress_env(section, local=True))  # before Ray starts: every process reads it
    import ray
    from ray import serve

    from rl360.launch.search_app import start_search
    from rl360.recipe import apply_overrides, decode_recipe
    from rl360.serve.search.index import SearchIndex

    recipe = decode_recipe(apply_overrides({}, [
        f"serve.port={args.port}", f"search.index={json.dumps(str(index_dir))}",
        f"search.replicas={args.replicas}", "search.max_batch_size=256",
        f"search.max_k={args.k}", "search.num_cpus=0"]))
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    idx = SearchIndex.load(index_dir)
    batches = sorted({1, args.batch})
    base_runs: list[float] = []
    full: list[float] = []
    runs: dict[int, list[float]] = {b: [] for b in batches}
    recalls: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        handles = start_search(recipe)
        assert handles is not None
        for run in range(3):  # interleaved, so a load swing on a shared box hits both sides
            queries = make_queries(index_dir, args.queries, seed=run)
            qps, base_ids = baseline(index_dir, queries, args.k)
            base_runs.append(qps)
            t0 = time.perf_counter()
            idx.search(queries, args.k, "bm25", args.snippets)
            full.append(len(queries) / (time.perf_counter() - t0))
            for batch in batches:
                warm = make_queries(index_dir, args.concurrency * batch, seed=1000 + run)
                qps, ids = asyncio.run(
                    served(handles.url, queries, args.k, args.concurrency, batch, warm,
                           args.snippets))
                runs[batch].append(qps)
                recalls[batch].append(recall(ids, base_ids))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"baseline, in process (SearchIndex.search, what each replica runs per batch, 1 "
          f"thread; snippets {'on' if args.snippets else 'off'}): {spread(full)}")
    print(f"the scorer apart: bm25s.retrieve in process (1 thread) {spread(base_runs)}; "
          f"SearchIndex.search over it {statistics.median(full) / statistics.median(base_runs):.2f}x")
    report: dict[int, tuple[list[float], float, float]] = {}
    for batch in batches:
        rec, same = min(r for r, _ in recalls[batch]), min(x for _, x in recalls[batch])
        report[batch] = (runs[batch], rec, same)
        print(f"through Serve, {args.concurrency} clients x {batch} quer{'y' if batch == 1 else 'ies'}"
              f"/request, {args.replicas} replica(s): {spread(runs[batch])}; recall@{args.k} vs "
              f"bm25s {rec:.4f}, identical up to ties {same:.4f} (worst run)")
    load = open("/proc/loadavg").read().split()[:3]
    print(f"load after {load} (a shared box: figures are noisy)")
    b = statistics.median(full)
    ref = statistics.median(base_runs)
    runs, rec, same = report[args.batch]
    ours = statistics.median(runs)
    single = statistics.median(report[1][0])
    print(json.dumps({"bench": "search", "ours": round(ours, 1), "baseline": round(b, 1),
                      "ratio": round(ours / b, 3), "scorer_speedup": round(b / ref, 3),
                      "bm25s": round(ref, 1), "batch": args.batch,
                      "concurrency": args.concurrency, "replicas": args.replicas,
                      "ingress": args.ingress, "snippets": args.snippets,
                      "single_query_ratio": round(single / b, 3), "recall_at_k": round(rec, 4),
                      "identical": round(same, 4), "load": load}))


if __name__ == "__main__":
    main()
