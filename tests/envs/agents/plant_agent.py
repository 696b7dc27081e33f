"""A stdlib-only agent program for the verifier cheat tests, run inside the sandbox:

    plant_agent.py COMMAND

It asks the model once (an agent that never asks is scored 0 before any verification), then
runs COMMAND with bash in its work dir (what it leaves there for the verifier) and exits 0."""

import json
import os
import subprocess
import sys
import urllib.request

body = {"model": os.environ.get("RL360_MODEL", "m"), "messages": [{"role": "user", "content": "go"}]}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                             data=json.dumps(body).encode(),
                             headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                      "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    r.read()
subprocess.run(["bash", "-c", sys.argv[1]], check=False)
