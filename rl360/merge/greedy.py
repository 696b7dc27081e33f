"""Greedy soup (Wortsman et al., 2022): rank experts by held-out score, then add each one to
the soup only if the soup's score does not drop. Candidate soups are merged to a scratch
directory next to the output and scored by an evaluator (`Path -> float`, higher is better).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from rl360.merge import recipe as R
from rl360.merge.report import Summary
from rl360.merge.runner import SUMMARY_FILE, merge_checkpoints


def greedy_soup(
    base: str | Path,
    experts: Sequence[R.Expert],
    evaluator: Callable[[Path], float],
    output: R.Output,
    run: R.Run | None = None,
    ray: bool | None = None,
    progress: bool | None = None,
) -> Summary:
    """Write the greedy soup of `experts` to output.dir; the summary's `extra` has the log."""
    scores = [float(evaluator(Path(e.path))) for e in experts]
    order = sorted(range(len(experts)), key=lambda i: -scores[i])
    chosen, best = [order[0]], scores[order[0]]
    log = [f"{experts[i].label}={scores[i]:.4g}" for i in order]
    out = Path(output.dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".greedy-soup-", dir=out.parent))
    steps = []
    try:
        for k, i in enumerate(order[1:]):
            cand = [*chosen, i]
            cand_out = R.Output(dir=str(scratch / f"candidate-{k}"), dtype=output.dtype,
                                max_shard_size=output.max_shard_size)  # fmt: skip
            merge_checkpoints(base, [experts[j] for j in cand], R.Soup(), cand_out, run, ray, False)
            s = float(evaluator(Path(cand_out.dir)))
            kept = s >= best
            steps.append(f"+{experts[i].label}: {s:.4g} {'kept' if kept else 'skipped'}")
            if kept:
                chosen, best = cand, s
            shutil.rmtree(cand_out.dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = merge_checkpoints(
        base, [experts[j] for j in chosen], R.Soup(), output, run, ray, progress
    )
    summary.method = "greedy_soup"
    summary.extra = {
        "scores": " ".join(log),
        "greedy": "; ".join(steps) or "single expert",
        "soup": f"{', '.join(experts[j].label for j in chosen)} (score {best:.4g})",
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary
