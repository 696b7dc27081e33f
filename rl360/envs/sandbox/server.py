"""The exec server that runs INSIDE a sandbox (bwrap or process backend).

It is started once per sandbox as `python -I -S -c <this source> <config, marshal as hex>` and
serves requests from the host over stdin/stdout, so an exec costs one fork+exec inside the
sandbox instead of a new sandbox. Standard library only; it never imports rl360 (the package is
not visible inside the sandbox). Single-threaded (an epoll loop). It imports C modules and
`os`/`stat` only: `json`, `subprocess`, `selectors`, `shutil`, `tempfile`, `signal` and
`ctypes` cost ~25 ms of CPU per sandbox start on a 2-core box (the interpreter's own start is
~9), and a sandbox per tool-using episode pays that start every episode.

In the bwrap sandbox it is the pid namespace's init (pid 1): the kernel drops signals sent to it
from inside the namespace, so sandboxed code cannot kill it (and turn a failing episode into an
infrastructure error); as init it reaps every orphan. It also makes itself non-dumpable, so
sandboxed code cannot ptrace it.

Frame (both directions): 4-byte big-endian header length, the header (host -> server: marshal,
from the trusted host to this trusted server; server -> host: JSON, so the host never unmarshals
bytes from inside a sandbox), then the raw bytes of each blob whose lengths the header lists
under "blobs".
Warm Python: an exec of `<this interpreter> -I -S -c <code> [args]` (the server's own interpreter
and flags) runs in a fork of a TEMPLATE instead of a new interpreter (~half a grading's CPU:
the interpreter start and its imports). The template is forked from the server before the
server reads a byte of any request, so it never holds one (nonces, solutions, files); it only
forks. A job reaches it through a double fork (the server, subreaper or init, reaps it as its own
child) and gets its code, args, env and cwd through a pipe of its own, after the fork; it then
runs like a fresh `python -I -S -c` (new session, the rlimits, `__main__`, exit code). The
template is no target the sweep kills; a template that died or stopped is dropped and later
execs start interpreters again.

Requests: {"id", "op": "ping" | "exec" | "write" | "read" | "sweep", ...}. An exec's optional
blob is its stdin (a memfd: no path names it). Reads return at most READ_CAP bytes. The server
ignores every signal it can (SIGKILL and SIGSTOP cannot be); its commands get the defaults back.
"""

import _ctypes
import _json
import _signal
import _socket
import builtins
import errno
import marshal
import os
import resource
import select
import stat
import struct
import sys
import time
import types

HDR = struct.Struct(">I")
DRAIN_S = 0.05  # after the main process exits, how long to wait for pipes held by its children
CHUNK = 65536
READ_CAP = 8 << 20  # the most one read op returns, whatever the caller asks (/dev/zero exists)
# every signal the server can ignore: as pid 1 of its namespace, signals from inside are
# dropped by the kernel anyway; on the process backend this keeps a stray kill from ending it
IGNORED_SIGNALS = [
    s for s in range(1, _signal.NSIG)
    if s not in (_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGCHLD)
]
MAX_FD = 1 << 16


def _not_json(o):
    raise TypeError(f"{type(o).__name__} is not JSON")


# json.dumps with compact separators, through the C encoder `json` itself uses
_ENCODE = _json.make_encoder(None, _not_json, _json.encode_basestring_ascii, None, ":", ",",
                             False, False, True)


def json_dumps(obj):
    return "".join(_ENCODE(obj, 0))


class Poller:
    """The few calls of `selectors` the loop needs, on epoll: (fd, data) pairs."""

    def __init__(self):
        self.ep = select.epoll()
        self.data = {}

    def register(self, fd, data):
        self.ep.register(fd, select.EPOLLIN)
        self.data[fd] = data

    def unregister(self, fd):
        self.ep.unregister(fd)
        del self.data[fd]

    def select(self, timeout):
        try:
            events = self.ep.poll(-1 if timeout is None else timeout)
        except InterruptedError:
            return []
        return [(fd, self.data[fd]) for fd, _ in events if fd in self.data]


def which(name, path):
    """The first executable `name` on `path` (a PATH string), else None."""
    for d in (path or os.defpath).split(os.pathsep):
        p = os.path.join(d or ".", name)
        if os.access(p, os.X_OK) and os.path.isfile(p):
            return p
    return None


def remove_in(dirfd):
    """Remove everything inside the open directory `dirfd` without following a symlink (every
    step goes through dir fds, as shutil.rmtree's safe variant does); returns the count."""
    removed = 0
    for entry in list(os.scandir(dirfd)):
        name = entry.name
        try:
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dirfd)
            except OSError:
                continue
            try:
                same = os.fstat(sub)
                if (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                    remove_in(sub)
            finally:
                os.close(sub)
            try:
                os.rmdir(name, dir_fd=dirfd)
            except OSError:
                continue
        else:
            try:
                os.unlink(name, dir_fd=dirfd)
            except OSError:
                continue
        removed += 1
    return removed


def take_stdio(fin, fout, ferr):
    """A job's first steps: a process group of its own (killed as one), then its three
    standard fds. Not a session: that would put it in a scheduler autogroup of its own, at
    full weight whatever its niceness; it stays in the sandbox's, which the host niced."""
    os.setpgid(0, 0)
    os.dup2(fin, 0)
    os.dup2(fout, 1)
    os.dup2(ferr, 2)


def spawn(argv, env, cwd, in_fd, setup):
    """fork + exec `argv` in its own session with stdin `in_fd` and two new pipes; (pid,
    stdout read end, stderr read end). An exec that fails raises OSError here, as Popen does."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    x_r, x_w = os.pipe()  # close-on-exec: EOF once exec succeeded, else the errno
    try:
        pid = os.fork()
    except OSError:
        for fd in (out_r, out_w, err_r, err_w, x_r, x_w):
            os.close(fd)
        raise
    if pid == 0:
        code = 0
        try:
            take_stdio(in_fd, out_w, err_w)
            os.closerange(3, x_w)
            os.closerange(x_w + 1, MAX_FD)
            os.chdir(cwd)
            setup()
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            code = e.errno or errno.ENOENT
        except BaseException:
            code = errno.EINVAL
        try:
            os.write(x_w, struct.pack(">i", code))
        finally:
            os._exit(127)
    for fd in (out_w, err_w, x_w):
        os.close(fd)
    failed = b""
    while True:
        try:
            chunk = os.read(x_r, 4)
        except InterruptedError:
            continue
        if not chunk:
            break
        failed += chunk
    os.close(x_r)
    if failed:
        os.close(out_r)
        os.close(err_r)
        os.waitpid(pid, 0)
        (code,) = struct.unpack(">i", failed[:4].ljust(4, b"\0"))
        raise OSError(code, os.strerror(code))
    return pid, out_r, err_r


class Capped:
    """Keeps the first and last `cap // 2` bytes of a stream and counts the rest."""

    def __init__(self, cap):
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data):
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data and self.tail_cap:
            self.tail += data
            if len(self.tail) > self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def value(self):
        kept = len(self.head) + len(self.tail)
        if self.total <= kept:
            return bytes(self.head + self.tail), False
        note = b"\n...[%d bytes dropped]...\n" % (self.total - kept)
        return bytes(self.head) + note + bytes(self.tail), True


WARM_FLAGS = ["-I", "-S"]  # the flags this server runs with: a warm exec must ask for them
WARM_PAYLOAD_MAX = 32768  # a warm job's code, args, env and cwd: must fit its pipe at once
WARM_REPLY_S = 5.0  # the most the server waits for the template to fork a job
PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def prctl(option, value):
    try:
        fn = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")
        return _ctypes.call_function(fn, (option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def apply_limits(rlimits, oom_adj):
    """The rlimits and OOM score every job gets (exec'd or warm)."""
    for res, val in rlimits:
        _, hard = resource.getrlimit(res)
        want_hard = val + 1 if res == resource.RLIMIT_CPU else val
        if hard != resource.RLIM_INFINITY:
            want_hard = min(want_hard, hard)
        resource.setrlimit(res, (min(val, want_hard), want_hard))
    if oom_adj is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(oom_adj))
        except OSError:
            pass


def fork_template(rlimits, oom_adj):
    """Fork the template (a pristine copy of this interpreter); (socket, pid) or None."""
    if not prctl(PR_SET_CHILD_SUBREAPER, 1):  # warm jobs must become our children
        return None
    try:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        pid = os.fork()
    except OSError:
        return None
    if pid:
        theirs.close()
        ours.settimeout(WARM_REPLY_S)
        return ours, pid
    try:  # the template: none of the server's channels (the host must see EOF when it dies)
        ours.close()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, theirs.fileno())
        os.closerange(theirs.fileno() + 1, 1 << 16)
        prctl(PR_SET_DUMPABLE, 0)  # its jobs must not trace it and rig the next one
        template_main(theirs, rlimits, oom_adj)
    finally:
        os._exit(0)


def template_main(sock, rlimits, oom_adj):
    """Fork a job for each request (one byte and four fds: control, stdin, stdout, stderr)."""
    while True:
        try:
            msg, anc, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(4 * 4))
        except OSError:
            return
        if not msg:
            return  # the server is gone
        fds = []
        for level, kind, data in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(data) // 4}i", data[: len(data) // 4 * 4])
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            sock.sendall(struct.pack(">q", -1))
            continue
        try:
            mid = os.fork()
        except OSError:
            mid = -1
        if mid == 0:  # the middle process: fork the job, tell the server its pid, exit
            try:
                job = os.fork()
            except OSError:
                job = -1
            if job == 0:
                sock.close()
                warm_job(*fds, rlimits, oom_adj)
            try:
                sock.sendall(struct.pack(">q", job))
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        if mid < 0:
            sock.sendall(struct.pack(">q", -1))
        else:
            os.waitpid(mid, 0)


def warm_job(ctl, fin, fout, ferr, rlimits, oom_adj):
    """Run one job as `python -I -S -c code args` would; never returns."""
    rc = 1
    try:
        take_stdio(fin, fout, ferr)
        chunks = []
        while True:
            chunk = os.read(ctl, CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
        job = marshal.loads(b"".join(chunks))
        os.closerange(3, MAX_FD)
        apply_limits(rlimits, oom_adj)
        prctl(PR_SET_DUMPABLE, 1)  # as an exec'd process is
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.argv = ["-c", *job["args"]]
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        try:
            exec(compile(job["code"], "<string>", "exec"), main.__dict__)
            rc = 0
        except SystemExit as e:
            rc = exit_code(e.code)
        except BaseException as e:  # the traceback starts at the job's code, as an interpreter's
            e.__traceback__ = e.__traceback__.tb_next
            sys.excepthook(type(e), e, e.__traceback__)
            rc = 1
        try:
            import atexit

            atexit._run_exitfuncs()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(rc)


def exit_code(code):
    """The exit status SystemExit(code) gives an interpreter."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except BaseException:
        pass
    return 1


class Proc:
    """A job's process: its pid and the read ends of its pipes (its exit code is Job.rc)."""

    def __init__(self, pid, out_r, err_r):
        self.pid = pid
        self.stdout = os.fdopen(out_r, "rb", buffering=0)
        self.stderr = os.fdopen(err_r, "rb", buffering=0)


class Job:
    def __init__(self, rid, proc, timeout, cap):
        self.rid = rid
        self.proc = proc
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.out = Capped(cap)
        self.err = Capped(cap)
        self.fds = {}
        self.timed_out = False
        self.rc = None
        self.exited_at = None
        self.warm = False


class Server:
    def __init__(self, cfg):
        self.cfg = cfg
        self.workdir = cfg["workdir"]
        self.rlimits = [(getattr(resource, k), int(v)) for k, v in cfg.get("rlimits", {}).items()]
        self.oom_adj = cfg.get("oom_score_adj", 1000)
        self.python = os.path.realpath(sys.executable)  # what a warm exec must name
        # first, before any request is read: the template must never hold one
        self.template = fork_template(self.rlimits, self.oom_adj) if cfg.get("warm", True) else None
        self.sel = Poller()
        self.jobs = {}
        self.inbuf = bytearray()
        self.stdin = sys.stdin.buffer.fileno()
        self.stdout = sys.stdout.buffer.fileno()
        os.set_blocking(self.stdin, False)
        self.sel.register(self.stdin, ("in", None))
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        _signal.set_wakeup_fd(wfd)
        _signal.signal(_signal.SIGCHLD, lambda *_: None)
        for sig in IGNORED_SIGNALS:
            try:
                _signal.signal(sig, _signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        self.sel.register(rfd, ("sig", None))
        self.sigfd = rfd
        self.by_pid = {}
        prctl(PR_SET_DUMPABLE, 0)  # no ptrace from the sandbox's own (capability-less) processes

    # ------------------------------------------------------------------ wire
    def send(self, header, blobs=()):
        header["blobs"] = [len(b) for b in blobs]
        head = json_dumps(header).encode()
        data = b"".join([HDR.pack(len(head)), head, *blobs])
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.stdout, view)
            except BlockingIOError:
                time.sleep(0.001)
                continue
            view = view[n:]

    def parse(self):
        while len(self.inbuf) >= HDR.size:
            (n,) = HDR.unpack_from(self.inbuf)
            if len(self.inbuf) < HDR.size + n:
                return
            header = marshal.loads(bytes(self.inbuf[HDR.size : HDR.size + n]))
            need = HDR.size + n + sum(header.get("blobs", []))
            if len(self.inbuf) < need:
                return
            pos = HDR.size + n
            blobs = []
            for size in header.get("blobs", []):
                blobs.append(bytes(self.inbuf[pos : pos + size]))
                pos += size
            del self.inbuf[:need]
            self.handle(header, blobs)

    # ------------------------------------------------------------------ ops
    def path(self, p):
        return p if os.path.isabs(p) else os.path.join(self.workdir, p)

    def handle(self, req, blobs):
        rid, op = req.get("id"), req.get("op")
        try:
            if op == "ping":
                self.send({"id": rid, "ok": True, "pid": os.getpid()})
            elif op == "exec":
                self.start_exec(rid, req, blobs[0] if blobs else None)
            elif op == "sweep":
                self.send({"id": rid, "ok": True, **self.sweep(req.get("dirs") or [])})
            elif op == "write":
                path = self.path(req["path"])
                parent = os.path.dirname(path)
                if parent:
                    os.makedirs(parent, exist_ok=True)
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC
                with self.regular(path, flags, "wb") as f:
                    f.write(blobs[0] if blobs else b"")
                if req.get("mode") is not None:
                    os.chmod(path, int(req["mode"]))
                self.send({"id": rid, "ok": True})
            elif op == "read":
                limit = req.get("max")
                limit = READ_CAP if limit is None else min(int(limit), READ_CAP)
                flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                with self.regular(self.path(req["path"]), flags, "rb") as f:
                    data = f.read(limit + 1)
                if len(data) > limit:
                    self.send({"id": rid, "ok": True, "truncated": True}, [data[:limit]])
                    return
                self.send({"id": rid, "ok": True}, [data])
            else:
                self.send({"id": rid, "ok": False, "error": f"unknown op {op!r}"})
        except OSError as e:
            self.send(
                {"id": rid, "ok": False, "error": e.strerror or str(e), "errno": e.errno or 0}
            )
        except Exception as e:  # a bad request must not kill the server
            self.send({"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"})

    def child_setup(self):
        for sig in IGNORED_SIGNALS:  # exec'd commands get the default dispositions back
            try:
                _signal.signal(sig, _signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        _signal.set_wakeup_fd(-1)
        apply_limits(self.rlimits, self.oom_adj)

    def regular(self, path, flags, mode):
        """Open `path` without blocking (a FIFO would stall the whole server) and only when it
        is a regular file (not /dev/zero, a FIFO or a socket)."""
        fd = os.open(path, flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            os.set_blocking(fd, True)
            return os.fdopen(fd, mode)
        except BaseException:
            os.close(fd)
            raise

    def stdin_fd(self, data):
        """A file holding `data` that no path names (memfd), for a child's stdin."""
        try:
            fd = os.memfd_create("rl360-stdin", os.MFD_CLOEXEC)
        except (AttributeError, OSError):
            import tempfile  # no memfd here (an old kernel): rare, so imported only then

            fd = os.dup(tempfile.TemporaryFile(dir="/tmp").fileno())
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def sweep(self, dirs):
        """Kill every other process this server can see (as the pid namespace's init: all of
        the sandbox's) and empty `dirs`. Returns what it found."""
        me, killed = os.getpid(), 0
        self.check_template()
        spare = {me, self.template[1]} if self.template is not None else {me}
        for _ in range(20 if me == 1 else 0):
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in spare]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, _signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
            time.sleep(0.005)
            self.reap()
        removed = 0
        for d in dirs:
            removed += self.empty_dir(d)
        return {"killed": killed, "swept": me == 1, "removed": removed}

    def check_template(self):
        """Drop a template that is not asleep waiting for the server (stopped or traced)."""
        if self.template is None:
            return
        try:
            with open(f"/proc/{self.template[1]}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = b"?"
        if state not in (b"S", b"R"):
            self.drop_template()

    def empty_dir(self, d):
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return 0
        try:
            return remove_in(fd)
        except OSError:
            return 0
        finally:
            os.close(fd)

    def warm_args(self, argv, env, cwd):
        """(code, args) when `argv` is this interpreter with its own flags and `-c`, else None."""
        if self.template is None or len(argv) < 4 or argv[1 : 1 + len(WARM_FLAGS)] != WARM_FLAGS:
            return None
        i = 1 + len(WARM_FLAGS)
        if argv[i] != "-c" or len(argv) < i + 2 or not os.path.isdir(cwd):
            return None
        exe = argv[0] if "/" in argv[0] else which(argv[0], env.get("PATH"))
        if not exe or os.path.realpath(exe) != self.python:
            return None
        return argv[i + 1], argv[i + 2 :]

    def warm_spawn(self, code, args, env, cwd, stdin):
        """Fork a job from the template; a Proc, or None (start an interpreter instead). A reply
        that never comes (a template stopped for WARM_REPLY_S) drops the template; a job it may
        still have forked then writes into closed pipes and is reaped as an orphan."""
        payload = marshal.dumps({"code": code, "args": args, "env": env, "cwd": cwd})
        if len(payload) > WARM_PAYLOAD_MAX:
            return None
        ours, theirs = [], []  # theirs: control (read end), stdin, stdout, stderr
        try:
            ctl_r, ctl_w = os.pipe()
            ours.append(ctl_w)
            theirs.append(ctl_r)
            theirs.append(self.stdin_fd(stdin) if stdin is not None
                          else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            for _ in range(2):
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
            os.write(ctl_w, payload)  # fits the pipe's buffer: never blocks
            os.close(ours.pop(0))
            self.template[0].sendmsg(
                [b"F"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("4i", *theirs))])
            reply = b""
            while len(reply) < 8:
                chunk = self.template[0].recv(8 - len(reply))
                if not chunk:
                    raise OSError("the template is gone")
                reply += chunk
            (pid,) = struct.unpack(">q", reply)
            if pid <= 0:
                raise OSError("the template could not fork")
        except OSError:  # a dead, stopped or failing template: no more warm execs here
            for fd in ours:
                os.close(fd)
            self.drop_template()
            return None
        finally:
            for fd in theirs:
                os.close(fd)
        return Proc(pid, *ours)

    def drop_template(self):
        if self.template is None:
            return
        sock, pid = self.template
        self.template = None
        sock.close()
        try:
            os.kill(pid, _signal.SIGKILL)
        except OSError:
            pass

    def start_exec(self, rid, req, stdin=None):
        argv = req["argv"]
        env = dict(os.environ)
        env.update(req.get("env") or {})
        cwd = self.path(req.get("cwd") or self.workdir)
        cap = int(req.get("cap", 65536))
        warm = self.warm_args(argv, env, cwd)
        proc = self.warm_spawn(*warm, env, cwd, stdin) if warm is not None else None
        if proc is not None:
            self.add_job(rid, proc, req, cap, warm=True)
            return
        in_fd = -1
        try:
            in_fd = (self.stdin_fd(stdin) if stdin is not None
                     else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            proc = Proc(*spawn(argv, env, cwd, in_fd, self.child_setup))
        except OSError as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            msg = f"cannot run {argv[0]!r} (cwd {cwd}): {e}\n".encode()
            self.send({"id": rid, "ok": True, "rc": code, "timed_out": False}, [b"", msg])
            return
        finally:
            if in_fd >= 0:
                os.close(in_fd)
        self.add_job(rid, proc, req, cap)

    def add_job(self, rid, proc, req, cap, warm=False):
        job = Job(rid, proc, float(req.get("timeout", 30.0)), cap)
        job.warm = warm
        for name, pipe in (("out", proc.stdout), ("err", proc.stderr)):
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            job.fds[fd] = (name, pipe)
            self.sel.register(fd, ("job", job))
        self.jobs[rid] = job
        self.by_pid[proc.pid] = job

    def reap(self):
        """Reap every exited child: our jobs (their exit codes) and, as init, any orphan."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.template is not None and pid == self.template[1]:
                self.template[0].close()
                self.template = None
                continue
            job = self.by_pid.pop(pid, None)
            if job is not None:
                job.rc = os.waitstatus_to_exitcode(status)
                job.exited_at = time.monotonic()

    def read_fd(self, job, fd, final=False):
        name, pipe = job.fds[fd]
        sink = job.out if name == "out" else job.err
        while True:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                if final:
                    break
                return
            if not data:
                break
            sink.add(data)
            if not final:
                return
        self.sel.unregister(fd)
        pipe.close()
        del job.fds[fd]

    def kill_group(self, job):
        try:  # a warm job may not have called setpgid yet
            os.kill(job.proc.pid, _signal.SIGKILL)
        except OSError:
            pass
        for _ in range(3):
            try:
                os.killpg(job.proc.pid, _signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                return

    def finish(self, job):
        for fd in list(job.fds):
            self.read_fd(job, fd, final=True)
        out, out_trunc = job.out.value()
        err, err_trunc = job.err.value()
        header = {
            "id": job.rid,
            "ok": True,
            "rc": job.rc,
            "timed_out": job.timed_out,
            "out_trunc": out_trunc,
            "err_trunc": err_trunc,
            "wall": time.monotonic() - job.start,
            "warm": job.warm,
        }
        del self.jobs[job.rid]
        self.send(header, [out, err])

    def tick(self):
        now = time.monotonic()
        self.reap()
        for job in list(self.jobs.values()):
            if job.rc is None:
                if now >= job.deadline and not job.timed_out:
                    job.timed_out = True
                    self.kill_group(job)
            if job.rc is not None and (not job.fds or now >= job.exited_at + DRAIN_S):
                self.finish(job)

    def next_timeout(self):
        if not self.jobs:
            return None
        now = time.monotonic()
        soonest = min(
            (j.exited_at + DRAIN_S) if j.rc is not None else j.deadline for j in self.jobs.values()
        )
        return max(0.0, min(soonest - now, 0.5))

    def shutdown(self):
        for job in self.jobs.values():
            self.kill_group(job)
        sys.exit(0)

    def run(self):
        template = self.template[1] if self.template is not None else None
        self.send({"id": 0, "ok": True, "ready": True, "pid": os.getpid(), "template": template})
        while True:
            for fd, (kind, job) in self.sel.select(self.next_timeout()):
                if kind == "in":
                    data = b""
                    try:
                        data = os.read(self.stdin, 1 << 20)
                    except BlockingIOError:
                        continue
                    if not data:
                        self.shutdown()
                    self.inbuf += data
                    self.parse()
                elif kind == "sig":
                    try:
                        while os.read(self.sigfd, 512):
                            pass
                    except BlockingIOError:
                        pass
                elif fd in job.fds:
                    self.read_fd(job, fd)
            self.tick()


if __name__ == "__main__":
    Server(marshal.loads(bytes.fromhex(sys.argv[1]))).run()
