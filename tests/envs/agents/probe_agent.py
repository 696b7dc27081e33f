"""A stdlib-only agent program for the agent worker's tests, run inside the sandbox:

    probe_agent.py MODE [ARG]

Modes: `solve` (asks the model once, then writes the task's answer), `crash` (asks once, then
exits 3), `hang` (asks once, then sleeps), `silent` (exits 0 without asking), `ask` (asks
once and exits 0), `hostile ARG` (tries every way out it knows, ARG being the host's loopback
port and Unix socket and the task's host path, then reports what it reached as the content of
a model call and forges a reward). It speaks to $OPENAI_BASE_URL with $OPENAI_API_KEY as any
OpenAI client would."""

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

BASE = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]


def request(path, body=None, key=KEY, method=None, base=BASE):
    """(status, text) of one request to the episode's endpoint."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method or ("POST" if data else "GET"),
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return -1, f"{type(e).__name__}: {e}"


def ask(content, key=KEY, **extra):
    return request("/chat/completions", {"model": os.environ.get("RL360_MODEL", "m"),
                                         "messages": [{"role": "user", "content": content}],
                                         **extra}, key=key)


def reach_tcp(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        return "connected"
    except OSError as e:
        return type(e).__name__


def reach_unix(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()


def readable(path):
    try:
        with open(path, "rb") as f:
            f.read(1)
        return "read"
    except OSError as e:
        return type(e).__name__


def hostile(arg):
    port, unix_path, task_path = arg.split(",")
    root = BASE[: -len("/v1")]
    report = {
        # other sessions, opening and closing sessions, the sessionless routes, through the bridge
        "other_session": request("/sessions/other/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "x"}]}, base=root)[0],
        "open_session": request("/sessions", {}, base=root)[0],
        "close_own_session": request("/sessions/s1", method="DELETE", base=root)[0],
        "stats": request("/stats", base=root)[0],
        "wrong_token": ask("x", key="other-token")[0],
        # the host's loopback (the session server's own port, Ray's ports) and its Unix sockets
        "host_loopback": reach_tcp(int(port)),
        "host_unix_socket": reach_unix(unix_path),
        "ray_tmp": readable("/tmp/ray/session_latest/session.json"),
        # the verifier's files: the task's tests on the host, /tests in the sandbox
        "task_tests_on_host": readable(os.path.join(task_path, "tests", "test.sh")),
        "tests_dir": readable("/tests/test.sh"),
    }
    os.makedirs("/logs/verifier", exist_ok=True)
    with open("/logs/verifier/reward.txt", "w") as f:  # a forged reward
        f.write("1")
    status, _ = ask("REPORT " + json.dumps(report), temperature=0.0, max_tokens=100000)
    return 0 if status == 200 else 1


def main():
    mode = sys.argv[1]
    if mode == "silent":
        return 0
    if mode == "hostile":
        return hostile(sys.argv[2])
    status, text = ask("hello")
    if status != 200:
        print(f"model call failed: {status} {text}", file=sys.stderr)
        return 1
    if mode == "crash":
        return 3
    if mode == "hang":
        time.sleep(3600)
    if mode == "solve":
        import csv

        with open("/app/jobs.csv") as f:
            n = sum(1 for r in csv.DictReader(f) if r["status"] == "ok" and int(r["seconds"]) < 60)
        with open("/app/count.txt", "w") as f:
            f.write(f"{n}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
