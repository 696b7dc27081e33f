#!/bin/bash
mkdir -p /logs/verifier
python3 - <<'PY'
import csv
# the verifier recomputes the answer from the pristine data shipped with the tests
with open("/tests/jobs.csv") as f:
    want = sum(1 for r in csv.DictReader(f) if r["status"] == "ok" and int(r["seconds"]) < 60)
try:
    got = int(open("/app/count.txt").read().strip())
except Exception:
    got = None
open("/logs/verifier/reward.txt", "w").write("1" if got == want else "0")
PY
