"""The agent launcher that runs INSIDE a sandbox: a TCP-to-Unix-socket relay, then the agent.

    python -I -S -c <this source> PORT SOCKET -- AGENT ARGV...

It listens on 127.0.0.1:PORT in the sandbox's own network namespace (bwrap --unshare-net: a
loopback of its own, nothing else), starts AGENT ARGV as its child, and copies the bytes of each
connection to the Unix socket SOCKET (the host's session bridge, bind-mounted into the sandbox)
and back. It exits when the agent does, with the agent's exit status (128 + N for signal N).
An agent speaks plain HTTP to `http://127.0.0.1:PORT/v1` and never learns that its model is
behind a Unix socket; the bridge on the host decides what a request may reach.

Standard library only; it never imports rl360 (the package is not visible inside the sandbox).
A launcher that cannot listen or start the agent exits LAUNCH_FAILED with a line on stderr that
starts with "rl360-relay:".
"""

import os
import select
import signal
import socket
import sys

LAUNCH_FAILED = 113
CHUNK = 65536


def listen(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(128)
    s.setblocking(False)
    return s


def start_agent(argv):
    """fork + exec the agent with the launcher's environment; its pid (exits 127 on failure)."""
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(2, f"rl360-relay: cannot run {argv[0]!r}: {e}\n".encode())
        os._exit(127)
    return pid


class Relay:
    def __init__(self, listener, path):
        self.listener = listener
        self.path = path
        self.poll = select.poll()
        self.poll.register(listener.fileno(), select.POLLIN)
        self.peer = {}  # fd -> (this socket, the other end's socket)
        self.open_dirs = {}  # fd -> directions still open on this pair (shared list)

    def accept(self):
        try:
            client, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(self.path)
        except OSError:
            client.close()
            upstream.close()
            return
        # every chunk goes on at once: with Nagle's algorithm a reply's body would wait for the
        # client's (delayed, ~40 ms) acknowledgement of its headers
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state = [2]
        for a, b in ((client, upstream), (upstream, client)):
            a.setblocking(True)
            self.peer[a.fileno()] = (a, b)
            self.open_dirs[a.fileno()] = state
            self.poll.register(a.fileno(), select.POLLIN)

    def pump(self, fd):
        src, dst = self.peer[fd]
        try:
            data = src.recv(CHUNK)
        except OSError:
            data = b""
        if data:
            try:
                dst.sendall(data)
                return
            except OSError:
                pass
        self.poll.unregister(fd)  # this direction is done: pass the end on
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        state = self.open_dirs[fd]
        state[0] -= 1
        if state[0] == 0:
            for s in (src, dst):
                self.peer.pop(s.fileno(), None)
                self.open_dirs.pop(s.fileno(), None)
                s.close()


def main(argv):
    if len(argv) < 4 or argv[2] != "--":
        os.write(2, b"rl360-relay: usage: PORT SOCKET -- ARGV...\n")
        return LAUNCH_FAILED
    port, path, cmd = int(argv[0]), argv[1], argv[3:]
    try:
        listener = listen(port)
    except OSError as e:
        os.write(2, f"rl360-relay: cannot listen on 127.0.0.1:{port}: {e}\n".encode())
        return LAUNCH_FAILED
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    relay = Relay(listener, path)
    relay.poll.register(wake_r, select.POLLIN)
    agent = start_agent(cmd)
    while True:
        try:
            events = relay.poll.poll(1000)
        except InterruptedError:
            events = []
        for fd, _ in events:
            if fd == wake_r:
                os.read(wake_r, 512)
            elif fd == listener.fileno():
                relay.accept()
            elif fd in relay.peer:
                relay.pump(fd)
        pid, status = os.waitpid(agent, os.WNOHANG)
        if pid == agent:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
