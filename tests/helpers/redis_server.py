"""Real ``redis-server`` processes for the Redis tier's tests and benchmark.

:class:`RedisServer` starts one server on a free loopback port in a directory
of its own (no persistence: ``--save "" --appendonly no``), optionally with a
password, ACL users or TLS, waits until it answers, and can kill, pause,
resume and restart it on the same port. :class:`RedisClusterNodes` starts
three such servers in cluster mode and joins them with ``redis-cli --cluster
create``. Every process is stopped by :meth:`stop` (fixtures call it in a
``finally``), at interpreter exit, and by the kernel if this process dies
first (``PR_SET_PDEATHSIG``): a failed or interrupted test never leaves a
server behind.

No pytest here: the benchmark imports this module too. A missing binary is a
:class:`RedisBinaryMissing` (the tests let it fail them, never skip).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import redis

__all__ = [
    "MISSING_MESSAGE",
    "AclUser",
    "RedisBinaryMissing",
    "RedisClusterNodes",
    "RedisServer",
    "TlsFiles",
    "make_tls_files",
    "redis_binaries",
]

MISSING_MESSAGE = (
    "redis-server / redis-cli not found on PATH: the Redis tier's tests run against a real "
    "server. `make test` installs it (Debian/Ubuntu: apt-get install redis-server); CI does."
)

_LIVE: weakref.WeakSet[RedisServer] = weakref.WeakSet()


class RedisBinaryMissing(RuntimeError):
    """``redis-server`` or ``redis-cli`` is not installed."""


def redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli``.

    ``CKV_REDIS_SERVER`` / ``CKV_REDIS_CLI`` name other binaries speaking the same
    protocol, e.g. ``valkey-server`` to run the same tests against Valkey.

    Raises
    ------
    RedisBinaryMissing
        Either is missing (the message says that ``make test`` installs them).
    """
    server = shutil.which(os.environ.get("CKV_REDIS_SERVER") or "redis-server")
    cli = shutil.which(os.environ.get("CKV_REDIS_CLI") or "redis-cli")
    if server is None or cli is None:
        raise RedisBinaryMissing(MISSING_MESSAGE)
    return server, cli


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux only, best effort)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A loopback port free now (and, for a cluster node, its bus port ``port + 10000``)."""
    for _ in range(1000):
        port = random.randint(20000, 55000)
        if _port_free(port) and (not cluster or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


@dataclass(frozen=True)
class AclUser:
    """An ACL user created at start-up (``--user``), allowed ``commands`` on ``keys``.

    ``commands`` and ``keys`` are ACL rules separated by spaces (``"+get +set"``).
    """

    name: str
    password: str
    commands: str = "+@all"
    keys: str = "~*"


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 (PEM files)."""

    ca_cert: str
    cert: str
    key: str


def make_tls_files(directory: str) -> TlsFiles:
    """Create a CA and a server certificate (SAN 127.0.0.1, localhost) with the openssl CLI.

    Raises
    ------
    RuntimeError
        ``openssl`` is missing or failed.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl CLI not found: needed to make a throwaway TLS certificate")
    os.makedirs(directory, exist_ok=True)
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    with open(path("san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", path("ca.key"), "-out",
         path("ca.crt"), "-days", "2", "-subj", "/CN=canonical-kv test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", path("server.key"), "-out",
         path("server.csr"), "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", path("server.csr"), "-CA", path("ca.crt"), "-CAkey",
         path("ca.key"), "-CAcreateserial", "-out", path("server.crt"), "-days", "2",
         "-extfile", path("san.ext")],
    ]  # fmt: skip
    for step in steps:
        done = subprocess.run([openssl, *step], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {step[0]} failed: {done.stderr.strip()}")
    return TlsFiles(path("ca.crt"), path("server.crt"), path("server.key"))


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, started by :meth:`start`.

    Parameters
    ----------
    directory : str
        Working directory (``--dir``) and log file location; created if needed.
    port : int | None
        Fixed port; default: a free one, chosen again if taken at start-up.
    password : str | None
        ``--requirepass`` (the ``default`` user's password).
    users : sequence of AclUser
        Extra ACL users.
    tls : TlsFiles | None
        Serve TLS only (``--port 0 --tls-port``), clients not authenticated by cert.
    cluster : bool
        Cluster mode (``--cluster-enabled yes``; its config file in ``directory``).
    maxmemory : int | None
        ``--maxmemory`` bytes with ``--maxmemory-policy allkeys-lru``.
    extra : sequence of str
        More command-line arguments.
    """

    def __init__(
        self,
        directory: str,
        *,
        port: int | None = None,
        password: str | None = None,
        users: Sequence[AclUser] = (),
        tls: TlsFiles | None = None,
        cluster: bool = False,
        maxmemory: int | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.fixed_port = port is not None
        self.port = port if port is not None else free_port(cluster=cluster)
        self.password = password
        self.users = tuple(users)
        self.tls = tls
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.extra = tuple(extra)
        self.log_path = os.path.join(self.directory, "redis.log")
        self.proc: subprocess.Popen | None = None
        _LIVE.add(self)

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        """``redis://`` (or ``rediss://``) URL without credentials."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def url_for(self, username: str | None = None, password: str | None = None) -> str:
        """URL with credentials (user and/or password), as a deployment would write it."""
        auth = ""
        if username is not None or password is not None:
            auth = f"{username or ''}:{password or ''}@"
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}"

    def client(self, **kwargs) -> redis.Redis:
        """An admin client (``default`` user), for setup and inspection."""
        options = dict(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10)
        if self.tls:
            options.update(ssl=True, ssl_ca_certs=self.tls.ca_cert)
        options.update(kwargs)
        return redis.Redis(**options)

    # ------------------------------------------------------------------ life cycle

    def _argv(self) -> list[str]:
        argv = [self.server_bin, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", self.directory, "--logfile", self.log_path, "--daemonize", "no"]
        if self.tls:
            argv += ["--port", "0", "--tls-port", str(self.port)]
            argv += ["--tls-cert-file", self.tls.cert, "--tls-key-file", self.tls.key]
            argv += ["--tls-ca-cert-file", self.tls.ca_cert, "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        for user in self.users:
            rules = [f">{user.password}", *user.keys.split(), *user.commands.split()]
            argv += ["--user", user.name, "on", *rules]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-node-timeout", "3000"]
            argv += ["--cluster-config-file", os.path.join(self.directory, "nodes.conf")]
            if self.tls:
                argv += ["--tls-cluster", "yes"]
        if self.maxmemory is not None:
            argv += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        return argv + list(self.extra)

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start (again, on the same port after :meth:`kill`) and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} already running")
        for _attempt in range(5):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.log_path)
            self.proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
            if self._wait_ready(timeout):
                return self
            log = self.log_tail()
            self.kill()
            if "Address already in use" in log and not self.fixed_port:
                self.port = free_port(cluster=self.cluster)  # another developer took it
                continue
            if "Address already in use" in log:  # fixed port still held (e.g. TIME_WAIT bus)
                time.sleep(0.5)
                continue
            raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}")
        raise RuntimeError(f"redis-server could not bind a port:\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with self.client(socket_timeout=1, socket_connect_timeout=1) as client:
                    if client.ping():
                        return True
            except redis.exceptions.BusyLoadingError:
                pass
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                pass
            time.sleep(0.02)
        return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash: nothing saved) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a paused server must be able to die
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> RedisServer:
        return self.start() if not self.running else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(port={self.port}, running={self.running})"


class RedisClusterNodes:
    """Three (``count``) cluster-mode servers joined into one cluster without replicas.

    Parameters
    ----------
    directory : str
        Each node gets ``directory/node-<i>``.
    count : int
        Primary nodes (3 is the smallest cluster ``redis-cli --cluster create`` accepts).
    password : str | None
        The ``default`` user's password on every node (``--masterauth`` too).
    """

    def __init__(self, directory: str, count: int = 3, *, password: str | None = None) -> None:
        extra = ("--masterauth", password) if password else ()
        self.nodes = [
            RedisServer(
                os.path.join(directory, f"node-{i}"), cluster=True, password=password, extra=extra
            )
            for i in range(count)
        ]
        self.password = password

    @property
    def url(self) -> str:
        """A startup node's URL (the client discovers the others)."""
        return self.nodes[0].url

    def start(self, timeout: float = 60.0) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        cli = self.nodes[0].cli_bin
        argv = [cli, "--cluster", "create"]
        argv += [f"127.0.0.1:{node.port}" for node in self.nodes]
        argv += ["--cluster-replicas", "0", "--cluster-yes"]
        if self.password:
            argv += ["-a", self.password, "--no-auth-warning"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
        deadline = time.monotonic() + timeout
        while not self.state_ok():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return self

    def state_ok(self) -> bool:
        """Every node reports ``cluster_state:ok`` and knows all the nodes."""
        for node in self.nodes:
            try:
                with node.client(socket_timeout=2) as client:
                    info = client.execute_command("CLUSTER", "INFO")
                    known = client.execute_command("CLUSTER", "NODES")
            except (redis.exceptions.RedisError, OSError):
                return False
            info = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in info:
                return False
            text = known.decode() if isinstance(known, bytes) else str(known)
            if len([line for line in text.splitlines() if line.strip()]) < len(self.nodes):
                return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()
