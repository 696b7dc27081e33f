#!/bin/bash
mkdir -p /logs/verifier
cd /app
if python3 - <<'PY'
import sys
sys.path.insert(0, "/app")
from stats import mean
assert mean([1, 2, 3]) == 2
assert mean([5]) == 5
assert abs(mean([1.5, 2.5]) - 2.0) < 1e-9
PY
then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
