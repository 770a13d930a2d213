"""Real redis-server processes for the store tests, and a proxy that kills one at an exact byte
of its replies. The fixtures using them are in conftest.py."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time

import kvq


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(cluster: bool = False) -> int:
    """A free loopback port in [20000, 50000); for a cluster node, one whose bus port (+10000)
    is free too."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 50000)
        if _port_free(p) and (not cluster or _port_free(p + 10000)):
            return p
    raise RuntimeError("no free port on 127.0.0.1")


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

    def __init__(self, directory: str, cluster: bool = False):
        self.dir = directory
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None
        self.port = 0
        for _ in range(5):  # a port free when picked may be taken before the server binds it
            self.port = free_port(cluster)
            if self._spawn():
                return
        raise RuntimeError(f"redis-server did not start (see {self.dir}/redis.log)")

    def _spawn(self) -> bool:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
                "--loglevel", "warning"]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     os.path.join(self.dir, "nodes.conf"), "--cluster-node-timeout", "3000"]  # fmt: skip
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
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}"

    def kill(self) -> None:
        """SIGKILL, and wait for it: connections to the server break."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering; connections stay open."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


class RedisCluster:
    """A Redis Cluster of `masters` masters (no replicas), made by redis-cli --cluster create;
    ready (every node sees cluster_state:ok and every node) when constructed."""

    def __init__(self, directory: str, masters: int = 3):
        self.nodes: list[RedisServer] = []
        try:
            for i in range(masters):
                d = os.path.join(directory, f"node{i}")
                os.mkdir(d)
                self.nodes.append(RedisServer(d, cluster=True))
            subprocess.run(["redis-cli", "--cluster", "create", *[n.address for n in self.nodes],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)  # fmt: skip
            deadline = time.monotonic() + 30
            for n in self.nodes:
                while True:
                    info = subprocess.run(["redis-cli", "-p", str(n.port), "CLUSTER", "INFO"],
                                          capture_output=True, text=True, timeout=10).stdout  # fmt: skip
                    if "cluster_state:ok" in info and f"cluster_known_nodes:{masters}" in info:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError("the cluster did not become ready in 30 s")
                    time.sleep(0.05)
        except BaseException:
            self.kill()
            raise

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(n.address for n in self.nodes)

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()


def redis_missing() -> str | None:
    """Why Redis tests cannot run here, or None."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        return "redis-server or redis-cli is not installed (scripts/setup.sh installs it)"
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
