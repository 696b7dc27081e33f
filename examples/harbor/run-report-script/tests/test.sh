#!/bin/bash
mkdir -p /logs/verifier
expected=$(python3 -c 'print(sum(v for v in [(i * 37 + 11) % 101 for i in range(200)] if v % 3 == 0))')
got=$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)
if [ "$got" = "$expected" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
