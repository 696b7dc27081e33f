#!/bin/bash
# The agent's stats.py runs only in a child process of verify.py; the values it returns are
# compared there with values the verifier computes itself.
mkdir -p /logs/verifier
exec python3 -I /tests/verify.py
