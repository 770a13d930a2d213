"""Real redis-server processes for the store tests, and a proxy that kills one at an exact byte
of its replies. The fixtures using them are in conftest.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import kvq

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test process dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class RedisServer:
    """One redis-server on 127.0.0.1 at a free port, in its own directory, no persistence."""

    def __init__(self, directory: str):
        self.dir = directory
        self.proc: subprocess.Popen | None = None
        self.port = 0
        for _ in range(5):  # a port free when picked may be taken before the server binds it
            self.port = free_port()
            if self._spawn():
                return
        raise RuntimeError(f"redis-server did not start (see {self.dir}/redis.log)")

    def _spawn(self) -> bool:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
                "--loglevel", "warning"]  # fmt: skip
        log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if _ping(self.port):
                return True
            time.sleep(0.02)
        self.kill()
        return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL, and wait for it: connections to the server break."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def redis_missing() -> str | None:
    """Why Redis tests cannot run here, or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (scripts/setup.sh installs it)"
    if not kvq.store_has_redis():
        return "this kvq module was built without hiredis (no Redis backend)"
    return None


class CuttingProxy:
    """A TCP proxy in front of a server that, once `cut_after` bytes of replies have passed,
    calls `on_cut` (e.g. kills the server) and closes every connection: a server gone at an
    exact byte of a reply."""

    def __init__(self, port: int, cut_after: int, on_cut):
        self.upstream, self.cut_after, self.on_cut = port, cut_after, on_cut
        self.sent = 0
        self.cut = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.cut.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server is gone: so is this connection
                client.close()
                continue
            with self.lock:
                self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while not self.cut.is_set():
                data = src.recv(65536)
                if not data:
                    break
                if reply:
                    with self.lock:
                        allowed = self.cut_after - self.sent
                        self.sent += min(len(data), max(allowed, 0))
                    if allowed < len(data):
                        dst.sendall(data[: max(allowed, 0)])
                        self._cut()
                        return
                dst.sendall(data)
        except OSError:
            pass

    def _cut(self) -> None:
        if self.cut.is_set():
            return
        self.cut.set()
        self.on_cut()
        with self.lock:
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self.listener.close()
