"""The exec server that runs INSIDE a sandbox (bwrap or process backend).

It is started once per sandbox as `python -I -S -c <this source> <config json>` and serves
requests from the host over stdin/stdout, so an exec costs one fork+exec inside the sandbox
instead of a new sandbox. Standard library only; it never imports rl360 (the package is not
visible inside the sandbox). Single-threaded (a selector loop), so `preexec_fn` is safe.

In the bwrap sandbox it is the pid namespace's init (pid 1): the kernel drops signals sent to it
from inside the namespace, so sandboxed code cannot kill it (and turn a failing episode into an
infrastructure error); as init it reaps every orphan. It also makes itself non-dumpable, so
sandboxed code cannot ptrace it.

Frame (both directions): 4-byte big-endian header length, the JSON header, then the raw bytes
of each blob whose lengths the header lists under "blobs".
Requests: {"id", "op": "ping" | "exec" | "write" | "read" | "sweep", ...}. An exec's optional
blob is its stdin (a memfd: no path names it). Reads return at most READ_CAP bytes. The server
ignores every signal it can (SIGKILL and SIGSTOP cannot be); its commands get the defaults back.
"""

import ctypes
import errno
import json
import os
import resource
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time

HDR = struct.Struct(">I")
DRAIN_S = 0.05  # after the main process exits, how long to wait for pipes held by its children
CHUNK = 65536
READ_CAP = 8 << 20  # the most one read op returns, whatever the caller asks (/dev/zero exists)
# every signal the server can ignore: as pid 1 of its namespace, signals from inside are
# dropped by the kernel anyway; on the process backend this keeps a stray kill from ending it
IGNORED_SIGNALS = [
    s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)
]


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


class Server:
    def __init__(self, cfg):
        self.cfg = cfg
        self.workdir = cfg["workdir"]
        self.rlimits = [(getattr(resource, k), int(v)) for k, v in cfg.get("rlimits", {}).items()]
        self.oom_adj = cfg.get("oom_score_adj", 1000)
        self.sel = selectors.DefaultSelector()
        self.jobs = {}
        self.inbuf = bytearray()
        self.stdin = sys.stdin.buffer.fileno()
        self.stdout = sys.stdout.buffer.fileno()
        os.set_blocking(self.stdin, False)
        self.sel.register(self.stdin, selectors.EVENT_READ, ("in", None))
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in IGNORED_SIGNALS:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
        self.sel.register(rfd, selectors.EVENT_READ, ("sig", None))
        self.sigfd = rfd
        self.by_pid = {}
        try:  # PR_SET_DUMPABLE = 4: no ptrace from the sandbox's own (capability-less) processes
            ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    # ------------------------------------------------------------------ wire
    def send(self, header, blobs=()):
        header["blobs"] = [len(b) for b in blobs]
        head = json.dumps(header).encode()
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
            header = json.loads(bytes(self.inbuf[HDR.size : HDR.size + n]))
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
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        for res, val in self.rlimits:
            _, hard = resource.getrlimit(res)
            want_hard = val + 1 if res == resource.RLIMIT_CPU else val
            if hard != resource.RLIM_INFINITY:
                want_hard = min(want_hard, hard)
            resource.setrlimit(res, (min(val, want_hard), want_hard))
        if self.oom_adj is not None:
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write(str(self.oom_adj))
            except OSError:
                pass

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
        for _ in range(20 if me == 1 else 0):
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
            time.sleep(0.005)
            self.reap()
        removed = 0
        for d in dirs:
            removed += self.empty_dir(d)
        return {"killed": killed, "swept": me == 1, "removed": removed}

    def empty_dir(self, d):
        removed = 0
        try:
            names = os.listdir(d)
        except OSError:
            return 0
        for name in names:
            p = os.path.join(d, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
                removed += 1
            except OSError:
                pass
        return removed

    def start_exec(self, rid, req, stdin=None):
        argv = req["argv"]
        env = dict(os.environ)
        env.update(req.get("env") or {})
        cwd = self.path(req.get("cwd") or self.workdir)
        cap = int(req.get("cap", 65536))
        in_fd = self.stdin_fd(stdin) if stdin is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                argv,
                stdin=in_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                preexec_fn=self.child_setup,
                close_fds=True,
            )
        except OSError as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            msg = f"cannot run {argv[0]!r} (cwd {cwd}): {e}\n".encode()
            self.send({"id": rid, "ok": True, "rc": code, "timed_out": False}, [b"", msg])
            return
        finally:
            if stdin is not None:
                os.close(in_fd)
        job = Job(rid, proc, float(req.get("timeout", 30.0)), cap)
        for name, pipe in (("out", proc.stdout), ("err", proc.stderr)):
            fd = pipe.fileno()
            os.set_blocking(fd, False)
            job.fds[fd] = (name, pipe)
            self.sel.register(fd, selectors.EVENT_READ, ("job", job))
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
            job = self.by_pid.pop(pid, None)
            if job is not None:
                job.rc = os.waitstatus_to_exitcode(status)
                job.proc.returncode = job.rc  # Popen must not wait for it again
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
        for _ in range(3):
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
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
        self.send({"id": 0, "ok": True, "ready": True, "pid": os.getpid()})
        while True:
            for key, _ in self.sel.select(self.next_timeout()):
                kind, job = key.data
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
                elif key.fd in job.fds:
                    self.read_fd(job, key.fd)
            self.tick()


if __name__ == "__main__":
    Server(json.loads(sys.argv[1])).run()
