"""The isolated test runner: runs INSIDE a sandbox (stdlib only, never imports rl360).

Started as `python -I -S -c <this source> parent` with the spec (JSON: nonce, solution, tests,
per-test timeout) on stdin. The PARENT makes itself non-dumpable (no ptrace, no /proc/<pid>/mem
or fd/ from the sandbox's capability-less processes), reads and closes stdin and then, for
each test, starts a fresh CHILD (`... -c <source> child`) that loads the solution. The child
gets only two new pipes (requests in, replies out) and /dev/null; it never holds the nonce, the
tests, or the parent's stdout (the report channel).

The test code runs in the parent. The solution's top-level names appear there as proxies: a
call sends its arguments to the child as plain data and gets the result back as plain data
(None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset);
anything else stays in the child behind a handle. So `assert f(x) == y` compares two values of
built-in types built by the parent itself: a value that claims equality with anything cannot
exist on the parent's side. A child that exits, hangs, sends garbage or patches its own
builtins only makes its own calls fail. The parent reports one line per test on its stdout:
"<nonce> <i> <0|1> <why>".

Start-up cost matters: every distinct submission pays this interpreter's start, so it imports
only C modules and a few small pure ones (no `json`, `signal`, `socket`, `subprocess` or
`ctypes` packages: their enum and regex set-up cost several times the interpreter's own start).
JSON goes through the `_json` C scanner and encoder (the ones `json` itself uses), signals and
sockets through `_signal` and `_socket`, prctl through `_ctypes`. Started through BOOT (see
rl360/envs/sandbox/boot.py) the source arrives compiled, and the spec as marshal data.
"""

import _json
import _signal
import _socket
import builtins
import marshal
import os
import select
import struct
import sys

HDR = struct.Struct(">I")
MAX_MSG = 32 << 20  # one message either way
MAX_DEPTH = 100  # nesting of one value
TAGS = ("t", "d", "s", "f", "b", "ba", "c", "h", "cb")
START_S = 30.0  # the most a child interpreter may take to start (not counted as test time)
SIGKILL = _signal.SIGKILL


def set_dumpable(flag):
    """prctl(PR_SET_DUMPABLE, flag): 0 = no ptrace, no /proc/<pid>/mem from same-uid processes."""
    try:
        import _ctypes

        fn = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")
        _ctypes.call_function(fn, (4, flag, 0, 0, 0))
    except (ImportError, OSError, AttributeError):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(4, flag, 0, 0, 0)
        except (ImportError, OSError, AttributeError):
            pass


class _Ctx:  # what _json.make_scanner reads: json.loads' defaults
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"NaN": float("nan"), "Infinity": float("inf"),
                      "-Infinity": float("-inf")}.__getitem__


_SCAN = _json.make_scanner(_Ctx())


def _not_json(o):
    raise TypeError(f"{type(o).__name__} is not JSON")


# json.dumps(msg) with compact separators; no circular check (enc() bounds the depth)
_ENCODE = _json.make_encoder(None, _not_json, _json.encode_basestring_ascii, None, ":", ",",
                             False, False, True)


def json_loads(data):
    """json.loads for one message: the same C scanner; any malformed input is a ValueError."""
    try:
        text = data.decode("utf-8")
        obj, end = _SCAN(text, 0)
    except (Exception, StopIteration):  # the C scanner's error path may raise SystemError
        raise ValueError("malformed message") from None
    if end != len(text):
        raise ValueError("malformed message")
    return obj


def json_dumps(obj):
    return "".join(_ENCODE(obj, 0))


# ---------------------------------------------------------------------------- codec (both)


def enc(v, other, depth=0):
    """Plain data of exactly built-in types; anything else becomes other(v) (a tagged ref)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    d = depth + 1
    if t is list:
        return [enc(x, other, d) for x in v]
    if t is tuple:
        return {"t": [enc(x, other, d) for x in v]}
    if t is dict:
        return {"d": [[enc(k, other, d), enc(x, other, d)] for k, x in v.items()]}
    if t is set:
        return {"s": [enc(x, other, d) for x in v]}
    if t is frozenset:
        return {"f": [enc(x, other, d) for x in v]}
    if t is bytes:
        return {"b": v.hex()}
    if t is bytearray:
        return {"ba": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    return other(v)


def dec(j, on_ref, depth=0):
    """Build built-in values from enc()'s output; refs ({"h": n} / {"cb": n}) go to on_ref."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(j)
    if j is None or t is bool or t is int or t is float or t is str:
        return j
    d = depth + 1
    if t is list:
        return [dec(x, on_ref, d) for x in j]
    if t is not dict or len(j) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = j.items()
    if tag in ("h", "cb"):
        if type(body) is not int:
            raise ValueError("malformed reference")
        return on_ref(tag, body)
    if tag in ("b", "ba"):
        if type(body) is not str:
            raise ValueError("malformed bytes")
        raw = bytes.fromhex(body)
        return raw if tag == "b" else bytearray(raw)
    if type(body) is not list:
        raise ValueError("malformed value")
    if tag == "c":
        if len(body) != 2 or any(type(x) not in (int, float) for x in body):
            raise ValueError("malformed complex")
        return complex(float(body[0]), float(body[1]))
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict")
            out[dec(pair[0], on_ref, d)] = dec(pair[1], on_ref, d)
        return out
    items = [dec(x, on_ref, d) for x in body]
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(items)
    if tag == "f":
        return frozenset(items)
    raise ValueError("unknown tag")


def send(fd, msg):
    data = json_dumps(msg).encode()
    data = HDR.pack(len(data)) + data
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the solution process closed its channel")
        buf += chunk
    return bytes(buf)


def recv(fd):
    (n,) = HDR.unpack(_read_exact(fd, HDR.size))
    if n > MAX_MSG:
        raise ValueError("message too large")
    msg = json_loads(_read_exact(fd, n))
    if type(msg) is not dict:
        raise ValueError("malformed message")
    return msg


# ---------------------------------------------------------------------------- child


def child_main():
    rin, rout = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    objs = {}

    def keep(v):
        objs[len(objs) + 1] = v
        return {"h": len(objs)}

    def on_ref(tag, n):
        if tag == "h":
            return objs[n]
        return lambda *a, **k: callback(n, a, k)

    def encode(v):
        return enc(v, keep)

    def callback(n, args, kwargs):
        send(rout, {"op": "cb", "id": n, "args": encode(list(args)), "kwargs": encode(kwargs)})
        return serve(nested=True)

    def error(e):
        return {"err": type(e).__name__, "msg": str(e)[:300]}

    def answer(msg):
        op = msg.get("op")
        if op == "load":
            ns = {"__name__": "solution"}
            exec(compile(msg["src"], "solution.py", "exec"), ns)
            names = {}
            for k, v in ns.items():
                if k.startswith("__") or type(v).__name__ == "module":
                    continue
                names[k] = encode(v)
            return {"ok": {"d": [[k, v] for k, v in names.items()]}}
        obj = objs[msg["h"]]
        if op == "call":
            args = dec(msg["args"], on_ref)
            kwargs = dec(msg["kwargs"], on_ref)
            out = obj(*args, **kwargs)
            after = [[i, encode(a)] for i, a in enumerate(args) if type(a) in (list, dict, set)]
            return {"ok": encode(out), "after": after}
        if op == "getattr":
            return {"ok": encode(getattr(obj, msg["name"]))}
        if op == "list":
            return {"ok": encode(list(obj))}
        if op == "len":
            return {"ok": len(obj)}
        if op == "getitem":
            return {"ok": encode(obj[dec(msg["key"], on_ref)])}
        if op == "contains":
            return {"ok": bool(dec(msg["item"], on_ref) in obj)}
        if op == "str":
            return {"ok": str(obj)}
        if op == "repr":
            return {"ok": repr(obj)}
        if op == "bool":
            return {"ok": bool(obj)}
        raise ValueError("unknown op")

    send(rout, {"hello": 1})  # before any solution code: the parent's clock starts here

    def serve(nested=False):
        while True:
            msg = recv(rin)
            if msg.get("op") == "cbret":
                if not nested:
                    raise ValueError("unexpected callback result")
                if "err" in msg:
                    raise RuntimeError("callback failed: {}".format(msg["err"]))
                return dec(msg["ok"], on_ref)
            try:
                reply = answer(msg)
            except BaseException as e:
                reply = error(e)
            send(rout, reply)

    serve()


# ---------------------------------------------------------------------------- parent


class Timeout(BaseException):
    """A test's time is up (a BaseException, so `except Exception` in a test cannot eat it)."""


class RemoteError(Exception):
    """The solution raised something that is not a built-in exception, or one that ends an
    iteration (ENDS_ITERATION)."""


# raised by a solution's function inside the test's `all(map(f, xs))`, `sum(map(...))` or a
# `for` over `map`, StopIteration ends that iteration early and the assert passes on what was
# left: these reach the test as an ordinary error instead (as PEP 479 does for generators)
ENDS_ITERATION = (StopIteration, StopAsyncIteration)


class Remote:
    """An object that lives in the solution's process."""

    __slots__ = ("_child", "_h")

    def __init__(self, child, h):
        object.__setattr__(self, "_child", child)
        object.__setattr__(self, "_h", h)

    def _ask(self, op, **kw):
        return self._child.request({"op": op, "h": self._h, **kw})

    def __call__(self, *args, **kwargs):
        return self._child.call(self._h, args, kwargs)

    def __getattr__(self, name):
        return self._ask("getattr", name=name)

    def __iter__(self):
        return iter(self._ask("list"))

    def __len__(self):
        n = self._ask("len")
        if type(n) is not int:
            raise TypeError("len() of a solution object is not an int")
        return n

    def __getitem__(self, key):
        return self._ask("getitem", key=self._child.encode(key))

    def __contains__(self, item):
        return self._ask("contains", item=self._child.encode(item)) is True

    def __bool__(self):
        return self._ask("bool") is True

    def __str__(self):
        s = self._ask("str")
        return s if type(s) is str else "<solution object>"

    def __repr__(self):
        s = self._ask("repr")
        return s if type(s) is str else "<solution object>"

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __hash__(self):
        return id(self)


class Child:
    def __init__(self, source, cwd):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        env["HOME"] = os.environ.get("HOME", cwd)
        env["TMPDIR"] = os.environ.get("TMPDIR", "/tmp")
        import subprocess  # the fallback only: its import costs more than an interpreter start

        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", source, "child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
            cwd=cwd,
            env=env,
        )
        self.win = self.proc.stdin.fileno()
        self.rout = self.proc.stdout.fileno()
        self.callbacks = {}

    def kill(self):
        try:
            os.killpg(self.proc.pid, SIGKILL)
        except OSError:
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def _ref(self, v):
        if type(v) is Remote and v._child is self:
            return {"h": v._h}
        self.callbacks[len(self.callbacks) + 1] = v
        return {"cb": len(self.callbacks)}

    def encode(self, v):
        return enc(v, self._ref)

    def _on_ref(self, tag, n):
        if tag == "cb":
            return self.callbacks[n]
        return Remote(self, n)

    def request(self, msg):
        send(self.win, msg)
        while True:
            reply = recv(self.rout)
            if reply.get("op") == "cb":  # the solution calls a function the test passed in
                try:
                    fn = self.callbacks[reply["id"]]
                    out = fn(
                        *dec(reply["args"], self._on_ref), **dec(reply["kwargs"], self._on_ref)
                    )
                    send(self.win, {"op": "cbret", "ok": self.encode(out)})
                except Exception as e:
                    send(self.win, {"op": "cbret", "err": type(e).__name__})
                continue
            if "err" in reply:
                name, text = reply.get("err"), reply.get("msg")
                cls = getattr(builtins, name, None) if type(name) is str else None
                text = text if type(text) is str else ""
                if cls in ENDS_ITERATION:  # would end the test's map()/all()/sum() early
                    raise RemoteError(f"{name} raised by the solution: {text}")
                if isinstance(cls, type) and issubclass(cls, Exception):
                    try:
                        exc = cls(text)
                    except Exception:
                        exc = RemoteError(f"{name}: {text}")
                    raise exc
                raise RemoteError(f"{name}: {text}")
            self.last = reply
            return dec(reply.get("ok"), self._on_ref)

    def call(self, h, args, kwargs):
        out = self.request(
            {"op": "call", "h": h, "args": self.encode(list(args)), "kwargs": self.encode(kwargs)}
        )
        after = self.last.get("after")
        for item in after if type(after) is list else []:
            i, new = item if type(item) is list and len(item) == 2 else (None, None)
            if type(i) is not int or not 0 <= i < len(args):
                continue
            orig, new = args[i], dec(new, self._on_ref)
            if type(orig) is list and type(new) is list:
                orig[:] = new
            elif type(orig) in (dict, set) and type(new) is type(orig):
                orig.clear()
                orig.update(new)
        return out

    def load(self, src):
        names = self.request({"op": "load", "src": src})
        if type(names) is not dict:
            raise ValueError("malformed load reply")
        return {k: v for k, v in names.items() if type(k) is str}


class ForkedChild(Child):
    """A CHILD forked from the zygote instead of started as a new interpreter (an interpreter
    start costs tens of ms of CPU; a fork of a small idle process about one). The zygote was
    forked from the parent before the parent read its spec, so it never held the nonce, the
    tests or the solution; it only forks, and each fork becomes a child exactly like a fresh
    one: its own session, two new pipes, /dev/null, the same small environment."""

    def __init__(self, zygote):
        req_r, self.win = os.pipe()
        self.rout, rep_w = os.pipe()
        try:
            zygote.sendmsg([b"F"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                     struct.pack("ii", req_r, rep_w))])
            data = zygote.recv(8)
        finally:
            os.close(req_r)
            os.close(rep_w)
        if len(data) != 8:
            os.close(self.win)
            os.close(self.rout)
            raise OSError("the zygote is gone")
        (self.pid,) = struct.unpack(">q", data)
        self.callbacks = {}

    def kill(self):
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, SIGKILL)
            except OSError:
                pass
        os.close(self.win)
        os.close(self.rout)


class Zygote:
    """The parent's handle on its zygote: the control socket and the pid."""

    def __init__(self, sock, pid):
        self.sock, self.pid = sock, pid

    def stop(self):
        """Close the channel (the zygote reaps its children and exits); a zygote that does not
        exit within 2 s is killed. It is always waited for: nothing of a grading outlives it
        (a warm sandbox retires when its sweep finds a process)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        for _ in range(200):
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return
            select.select([], [], [], 0.01)
        os.kill(self.pid, SIGKILL)
        os.waitpid(self.pid, 0)


def start_zygote(cwd):
    """Fork the zygote (before the spec is read: it holds no secret); None when it could not
    start (fresh children are used then)."""
    try:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        pid = os.fork()
    except OSError:
        return None
    if pid:
        theirs.close()
        ours.settimeout(5.0)
        return Zygote(ours, pid)
    try:  # the zygote: nothing of the parent's channels, only its control socket
        ours.close()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, theirs.fileno())
        os.closerange(theirs.fileno() + 1, 1 << 16)
        os.setsid()
        set_dumpable(0)  # a forked child must not be able to trace it and rig the next child
        zygote_main(theirs, cwd)
    finally:
        os._exit(0)


def zygote_main(sock, cwd):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "HOME": os.environ.get("HOME", cwd), "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap the killed children so far (their
                pass  # pids stay reserved until then: the parent kills by pid)
        except ChildProcessError:
            pass
        fds = []
        _, anc, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(2 * struct.calcsize("i")))
        for level, kind, data in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4])
        if len(fds) != 2:  # the parent is done (or sent garbage): reap, then exit
            for fd in fds:
                os.close(fd)
            try:
                while os.waitpid(-1, 0)[0] > 0:
                    pass
            except ChildProcessError:
                pass
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                sock.close()
                os.dup2(fds[0], 0)
                os.dup2(fds[1], 1)
                os.close(fds[0])
                os.close(fds[1])
                set_dumpable(1)  # dumpable again, as a freshly started child is
                os.environ.clear()
                os.environ.update(env)
                os.chdir(cwd)
                child_main()
            finally:
                os._exit(0)
        os.close(fds[0])
        os.close(fds[1])
        sock.sendall(struct.pack(">q", pid))


def new_child(source, zygote):
    """A child for one test: forked from the zygote, else a fresh interpreter; a zygote that
    fails once (killed or stopped by a solution) is not asked again."""
    if zygote is not None and zygote.sock is not None:
        try:
            return ForkedChild(zygote.sock)
        except OSError:
            zygote.sock.close()
            zygote.sock = None
    return Child(source, os.getcwd())


def _why(e):
    return (f"{type(e).__name__}: {str(e)[:200]}").replace("\n", " ")


def _read_rest(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def parent_main(source=None):
    """`source`: this file's text, given by BOOT (which also sent the code compiled and sends
    the spec as marshal data); None when started as `-c <source> parent` with a JSON spec."""
    set_dumpable(0)  # before the spec is read (BOOT did so already before its first read)
    zygote = start_zygote(os.getcwd())
    raw = _read_rest(0)
    spec = marshal.loads(raw) if source is not None else json_loads(raw)
    sys.stdin.close()
    os.close(0)
    out = sys.stdout
    nonce, per = spec["nonce"], float(spec["per_test_timeout"])
    source = source if source is not None else spec["source"]
    timed = {"out": False}

    def alarm(*_):
        timed["out"] = True
        raise Timeout(f"test exceeded {per}s")

    _signal.signal(_signal.SIGALRM, alarm)
    load_failed = None
    for i, test in enumerate(spec["tests"]):
        ok, why = False, load_failed
        if load_failed is None:
            timed["out"] = False
            child = None
            stage = "load"
            try:
                # the interpreter's start is not the solution's time (a loaded host is slow)
                _signal.setitimer(_signal.ITIMER_REAL, max(START_S, per))
                child = new_child(source, zygote)
                if recv(child.rout).get("hello") != 1:
                    raise ValueError("the solution process did not start")
                _signal.setitimer(_signal.ITIMER_REAL, per)
                ns = {"__name__": "__test__"}
                entry = spec.get("entry_point")
                for name, value in child.load(spec["solution"]).items():
                    # a solution's `abs` or `sorted` must not replace the test's builtins
                    if name == entry or not hasattr(builtins, name):
                        ns[name] = value
                stage = "test"
                exec(compile(test, f"test_{i}", "exec"), ns)
                ok, why = not timed["out"], "" if not timed["out"] else "Timeout"
            except BaseException as e:
                why = _why(e)
                if stage == "load":
                    load_failed = "not loaded: " + why
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
                if child is not None:
                    child.kill()
        out.write(f"{nonce} {i} {int(ok)} {why}\n")
        out.flush()
    if zygote is not None:
        zygote.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["child"]:
        child_main()
    else:
        parent_main(globals().get("BOOT_SOURCE"))
