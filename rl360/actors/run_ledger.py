"""The run's ledger: which task occurrences started, settled, re-ran and were trained on.

A task occurrence is the n-th task taken from the task stream (`occ`, kept when the task is
re-queued by tail cancellation or carried over a resume as pending). The rollout controller
records events (`start`, `rerun`, `settle`, `requeue`, `park`); the driver appends them to
`<run dir>/ledger.jsonl`, one row per step (with the group ids that step trained on), one per
checkpoint (with the tasks a resume runs first) and one per injected fault. A resume keeps
only the rows up to the checkpoint it starts from, so the file always tells the story of the
model that exists.

`account(rows)` turns the rows into the figures the fault drills assert on:
  lost        occurrences taken from the stream that never settled (handed to the buffer,
              queued or filtered), were not skipped as parked (a `park` event) and are not
              pending in the last checkpoint;
  duplicated  occurrences that settled more than once (trained twice), or a group id trained
              in two steps;
  reruns      episodes run again after an infrastructure failure;
  episodes_lost  episodes of settled groups that still ended as infra errors, plus the
              episodes of lost occurrences.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

LEDGER = "ledger.jsonl"


class RunLedger:
    """Driver side: appends rows to `<run dir>/ledger.jsonl`. `resume_step`: the step of the
    checkpoint a resumed run starts from (rows after it describe work the resume redoes)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        self.path = run_dir / LEDGER
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_ledger(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)
        elif resume_step is None:
            self.path.unlink(missing_ok=True)

    def write(self, step: int, kind: str, events: list[dict[str, Any]] | None = None,
              **extra: Any) -> None:
        row = {"step": step, "kind": kind, **extra, "events": events or []}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_ledger(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a row cut by kill -9 mid-write
                continue
    return rows


def account(rows: list[dict[str, Any]], group_size: int) -> dict[str, Any]:
    """Lost / duplicated / re-run figures over a ledger's rows (see the module docstring)."""
    settled: dict[int, list[str]] = collections.defaultdict(list)
    infra_left = 0
    reruns = 0
    trained: collections.Counter[str] = collections.Counter()
    taken = 0
    pending: set[int] = set()
    started: set[int] = set()
    parked: set[int] = set()
    for r in rows:
        for e in r.get("events", []):
            occ = int(e.get("occ", -1))
            if e["ev"] == "start":
                started.add(occ)
            elif e["ev"] == "park":
                parked.add(occ)
            elif e["ev"] == "rerun":
                reruns += 1
            elif e["ev"] == "settle":
                settled[occ].append(e["gid"])
                infra_left += int(e.get("infra", 0))
        trained.update(r.get("trained", []))
        if r["kind"] == "checkpoint":
            taken = max(taken, int(r.get("tasks_taken", 0)))
            pending = set(r.get("pending_occ", []))
    # every occurrence below the last checkpoint's stream position must have settled or be
    # pending there; one started after it (and not settled) was in flight when the run ended
    lost = sorted(o for o in range(taken)
                  if o not in settled and o not in pending and o not in parked)
    dup_occ = sorted(o for o, gids in settled.items() if len(gids) > 1 and o >= 0)
    dup_gid = sorted(g for g, n in trained.items() if n > 1)
    return {
        "occurrences": taken, "settled": len(settled), "pending": len(pending),
        "parked_skips": len(parked),
        "lost": len(lost), "lost_occ": lost[:20],
        "duplicated": len(dup_occ) + len(dup_gid), "duplicated_occ": dup_occ[:20],
        "duplicated_groups": dup_gid[:20],
        "episodes_rerun": reruns,
        "episodes_lost": infra_left + group_size * len(lost),
        "episodes_duplicated": group_size * (len(dup_occ) + len(dup_gid)),
        "faults": per_fault(rows, set(lost), set(dup_occ)),
    }


def per_fault(rows: list[dict[str, Any]], lost: set[int] | None = None,
              duplicated: set[int] | None = None) -> list[dict[str, Any]]:
    """Each `fault` row with what followed it until the next one: episodes re-run, the lost
    and duplicated occurrences that were running when it hit (started before it, settled
    after), and `recovery_s`: from the kill to the end of the next step that trained."""
    out: list[dict[str, Any]] = []
    started_at: dict[int, int] = {}  # occ -> its last start's row index
    for i, r in enumerate(rows):
        for e in r.get("events", []):
            if e["ev"] == "start":
                started_at[int(e.get("occ", -1))] = i
        if r["kind"] != "fault":
            continue
        f = {"part": r["part"], "killed": r.get("killed", ""), "step": r["step"],
             "episodes_rerun": 0, "lost": 0, "duplicated": 0, "recovery_s": None}
        for later in rows[i + 1:]:
            if later["kind"] == "fault":
                break
            f["episodes_rerun"] += sum(e["ev"] == "rerun" for e in later.get("events", []))
            if f["recovery_s"] is None and later["kind"] == "step" and "t" in later:
                f["recovery_s"] = round(later["t"] - r["t"], 2)
        hit = {o for o, j in started_at.items() if j <= i}
        f["lost"] = len(hit & (lost or set()))
        f["duplicated"] = len(hit & (duplicated or set()))
        out.append(f)
    return out
