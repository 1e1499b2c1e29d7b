"""Fixtures that run the real ``keratin`` binary: a node on free loopback ports with a
temporary data directory, stopped by PID (SIGTERM, then SIGKILL after a bound).

The binary is ``KERATIN_BIN``, else ``$CARGO_TARGET_DIR/debug/keratin``, else
``target/debug/keratin`` under the repository root, else built with ``cargo build -p
keratin``. Tests that need it use the ``broker`` fixture (``auth = none``) or
``start_broker`` (any settings)."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
#: How long a node may take to print its addresses (a debug build, a loaded CI machine).
START_TIMEOUT_S = 30
#: How long SIGTERM is given before SIGKILL.
STOP_TIMEOUT_S = 10
#: Disk thresholds so tiny that the host's free space never limits a test node
#: (crates/keratin/tests/support/mod.rs, HOST_DISK_LIMITS).
HOST_DISK_LIMITS = {
    "KERATIN_LIMITS__DISK__SOFT_FRACTION": "0.002",
    "KERATIN_LIMITS__DISK__HARD_FRACTION": "0.001",
    "KERATIN_LIMITS__DISK__RESERVE_FRACTION": "0.0005",
    "KERATIN_LIMITS__DISK__SOFT_FLOOR_BYTES": "268435456",
    "KERATIN_LIMITS__DISK__HARD_FLOOR_BYTES": "134217728",
    "KERATIN_LIMITS__DISK__RESERVE_FLOOR_BYTES": "67108864",
}

_binary: Optional[str] = None


def keratin_binary() -> str:
    global _binary
    if _binary is not None:
        return _binary
    explicit = os.environ.get("KERATIN_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            pytest.fail("KERATIN_BIN=%s is not an executable file" % explicit)
        _binary = explicit
        return _binary
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    candidate = os.path.join(target, "debug", "keratin")
    if not os.access(candidate, os.X_OK):
        cargo = shutil.which("cargo")
        if cargo is None:
            pytest.fail("no keratin binary at %s and no cargo to build it; set KERATIN_BIN" % candidate)
        built = subprocess.run([cargo, "build", "-p", "keratin"], cwd=REPO, timeout=1800)
        if built.returncode != 0 or not os.access(candidate, os.X_OK):
            pytest.fail("cargo build -p keratin did not produce %s" % candidate)
    _binary = candidate
    return _binary


class Broker:
    """A running ``keratin serve``."""

    def __init__(
        self,
        env: Dict[str, str],
        args: List[str],
        listen: Optional[List[str]] = None,
        data: Optional[str] = None,
    ) -> None:
        self.dir = tempfile.mkdtemp(prefix="keratin-py-")
        self.data = data or os.path.join(self.dir, "data")
        self.bin = keratin_binary()
        full_env = dict(os.environ)
        full_env.update(HOST_DISK_LIMITS)
        full_env.setdefault("KERATIN_LOG", "warn")
        full_env["KERATIN_SERVER__AUTH"] = "none"
        full_env.update(env)
        self.log_path = os.path.join(self.dir, "server.log")
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.bin, "serve", "--data-dir", self.data, *(listen or ["--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]), *args],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=self.dir,
        )
        log.close()
        lines: "queue.Queue[Optional[str]]" = queue.Queue()

        def drain() -> None:
            # Read stdout to its end so the node never blocks on a full pipe.
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                lines.put(raw.decode("utf-8", "replace"))
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        try:
            line = lines.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            line = None
        if line is None or "protocol=" not in line:
            self.stop()
            raise RuntimeError("keratin did not start (%r); log:\n%s" % (line, self.log()))
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        self.address: str = fields["protocol"]
        self.http: str = fields["http"]

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def admin_password(self) -> str:
        with open(os.path.join(self.data, "admin-password"), encoding="utf-8") as f:
            return f.read().strip()

    def cli(self, *args: str, extra_env: Optional[Dict[str, str]] = None) -> Any:
        """Runs ``keratin ARGS --server <protocol> --json`` as the data dir's admin."""
        env = dict(os.environ)
        env.update({"KERATIN_HTTP": self.http, "KERATIN_DATA_DIR": self.data})
        for key in ("KERATIN_SERVER", "KERATIN_USER", "KERATIN_PASSWORD", "KERATIN_TOKEN"):
            env.pop(key, None)
        env.update(extra_env or {})
        out = subprocess.run(
            [self.bin, *args, "--server", self.address, "--json"],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
        if out.returncode != 0:
            raise RuntimeError("keratin %s failed: %s %s" % (args, out.stdout, out.stderr))
        return json.loads(out.stdout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def privileged(test: str) -> None:
    """Skips ``test`` loudly when not root (it mounts file systems), unless
    ``KERATIN_REQUIRE_PRIVILEGED_TESTS=1``, where skipping is a failure."""
    if os.geteuid() == 0:
        return
    if os.environ.get("KERATIN_REQUIRE_PRIVILEGED_TESTS") == "1":
        pytest.fail("%s needs root (mount) and KERATIN_REQUIRE_PRIVILEGED_TESTS=1 forbids skipping" % test)
    import sys

    print("!!! SKIPPING %s: it needs root (mount)" % test, file=sys.stderr)
    pytest.skip("%s needs root (mount)" % test)


@pytest.fixture(scope="session")
def broker() -> Iterator[Broker]:
    """One node without logins, shared by the tests that only need a node."""
    node = Broker({}, [])
    yield node
    node.stop()


@pytest.fixture
def start_broker() -> Iterator[Callable[..., Broker]]:
    """Starts nodes with the given env and arguments; stops them after the test."""
    started: List[Broker] = []

    def start(env: Optional[Dict[str, str]] = None, args: Optional[List[str]] = None) -> Broker:
        node = Broker(env or {}, args or [])
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


#: Cluster nodes listen below Linux's ephemeral range (32768 on), so that no outgoing
#: connection holds a node's port (crates/keratin/tests/support/cluster.rs, NODE_PORTS).
NODE_PORTS = range(20_000, 32_000)


def free_port() -> int:
    import random
    import socket

    for _ in range(200):
        port = random.choice(NODE_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in %r" % (NODE_PORTS,))


class Cluster:
    """Three ``keratin serve`` nodes on loopback, node ids 1 to 3, peers of each other."""

    def __init__(self, leader_balance: bool = False) -> None:
        self.ports = {i: (free_port(), free_port(), free_port()) for i in (1, 2, 3)}
        peers: List[str] = []
        for i, (_, _, cluster) in self.ports.items():
            peers += ["--peer", "%d=127.0.0.1:%d" % (i, cluster)]
        self.nodes: Dict[int, Broker] = {}
        # Leaders stay where elections put them, unless the test asks for them to go back to
        # each partition's preferred leader (spread over the nodes by `nodes=[1, 2, 3]`).
        env = {"KERATIN_CLUSTER__LEADER_BALANCE": "true" if leader_balance else "false"}
        try:
            for i, (protocol, http, _) in self.ports.items():
                listen = ["--listen", "127.0.0.1:%d" % protocol, "--http", "127.0.0.1:%d" % http]
                self.nodes[i] = Broker(env, ["--node-id", str(i), *peers], listen=listen)
        except BaseException:
            self.stop()
            raise

    def addresses(self) -> List[str]:
        return [n.address for n in self.nodes.values()]

    def kill9(self, address: str) -> None:
        for node in self.nodes.values():
            if node.address == address:
                node.proc.kill()
                node.proc.wait()
                return
        raise KeyError(address)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    nodes = Cluster()
    yield nodes
    nodes.stop()


@pytest.fixture
def balanced_cluster() -> Iterator[Cluster]:
    """Three nodes that hand each partition back to its preferred leader."""
    nodes = Cluster(leader_balance=True)
    yield nodes
    nodes.stop()
