"""The run ledger's accounting (rl360.actors.run_ledger): lost and duplicated task occurrences,
re-runs, and a resume keeping only the rows up to its checkpoint."""

from __future__ import annotations

from pathlib import Path

from rl360.actors.run_ledger import RunLedger, account, read_ledger


def ev(kind: str, occ: int, gid: str = "", **extra: object) -> dict:
    return {"ev": kind, "occ": occ, "gid": gid or f"g{occ}", "task": f"t{occ}", **extra}


def clean_rows() -> list[dict]:
    return [
        {"step": 1, "kind": "step", "trained": ["g0", "g1"],
         "events": [ev("start", o) for o in range(4)] + [ev("settle", 0, queued=True, infra=0),
                                                         ev("settle", 1, queued=True, infra=0)]},
        {"step": 1, "kind": "checkpoint", "tasks_taken": 4, "pending_occ": [2, 3],
         "events": [ev("rerun", 2, member=0), ev("settle", 2, queued=False, infra=0)]},
    ]


def test_a_clean_ledger_has_nothing_lost_or_duplicated() -> None:
    acc = account(clean_rows(), group_size=2)
    assert acc["lost"] == 0 and acc["duplicated"] == 0
    assert acc["occurrences"] == 4 and acc["settled"] == 3 and acc["episodes_rerun"] == 1


def test_an_occurrence_neither_settled_nor_pending_is_lost() -> None:
    rows = clean_rows()
    rows[1]["pending_occ"] = [2]  # occ 3 vanished: not settled, not carried to a resume
    acc = account(rows, group_size=2)
    assert acc["lost"] == 1 and acc["lost_occ"] == [3] and acc["episodes_lost"] == 2


def test_settling_twice_or_training_a_group_twice_is_duplicated() -> None:
    rows = clean_rows()
    rows[1]["events"].append(ev("settle", 1, "g1-again", queued=True, infra=0))
    assert account(rows, 2)["duplicated_occ"] == [1]
    rows = clean_rows()
    rows.append({"step": 2, "kind": "step", "trained": ["g1"], "events": []})
    assert account(rows, 2)["duplicated_groups"] == ["g1"]


def test_infra_members_left_after_reruns_count_as_episodes_lost() -> None:
    rows = clean_rows()
    rows[0]["events"][4]["infra"] = 1
    assert account(rows, 2)["episodes_lost"] == 1


def test_a_resume_keeps_the_rows_up_to_its_checkpoint(tmp_path: Path) -> None:
    led = RunLedger(tmp_path)
    for step in (1, 2, 3):
        led.write(step, "step", [ev("start", step)])
    (tmp_path / "ledger.jsonl").open("a").write('{"step": 4, "kind": "st')  # cut by kill -9
    RunLedger(tmp_path, resume_step=2)
    assert [r["step"] for r in read_ledger(tmp_path / "ledger.jsonl")] == [1, 2]
    RunLedger(tmp_path)  # a fresh run starts a fresh ledger
    assert read_ledger(tmp_path / "ledger.jsonl") == []
