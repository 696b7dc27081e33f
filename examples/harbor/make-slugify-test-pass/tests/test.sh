#!/bin/bash
mkdir -p /logs/verifier
cd /app
python3 - <<'PY'
import json, sys
sys.path.insert(0, "/app")
cases = [("Hello World", "hello-world"), ("  RL360: fast & async!  ", "rl360-fast-async"),
         ("a--b__c", "a-b-c"), ("---", ""), ("Already-slug-42", "already-slug-42")]
passed = 0
try:
    from textutil import slugify
    for text, want in cases:
        try:
            passed += slugify(text) == want
        except Exception:
            pass
except Exception:
    pass
json.dump({"reward": passed / len(cases), "passed": passed, "total": len(cases)},
          open("/logs/verifier/reward.json", "w"))
PY
