"""Run a store (`kmesh store serve`), or a Mooncake Store master for its remote tier, as a child
process and wait until it listens."""

import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kmesh.errors import KMeshError

START_TIMEOUT_S = 20.0


@dataclass
class StoreProcess:
    socket: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the store and wait for it (killing it if it does not stop in time)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout)


@dataclass
class MasterProcess:
    """A mooncake_master on loopback: RPC at `address`, HTTP metadata at `metadata`."""

    directory: Path
    ports: tuple[int, ...] = field(default_factory=lambda: free_ports(3))
    process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.ports[1]}/metadata"

    def start(self, eviction_ratio: float = 0.05) -> None:
        """Start it (again, on the same ports: a restart loses every object) and wait until it
        answers."""
        binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
        if binary is None:
            raise KMeshError("mooncake_master is not installed: run `make setup`")
        rpc, http, metrics = self.ports
        command = [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1"]
        command += ["--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1"]
        command += [f"--http_metadata_server_port={http}", f"--metrics_port={metrics}"]
        command += ["--metrics_host=127.0.0.1", f"--eviction_ratio={eviction_ratio}"]
        with (self.directory / "mooncake_master.log").open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_listening(port) for port in (rpc, http)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = (self.directory / "mooncake_master.log").read_text(errors="replace")
                raise KMeshError(f"mooncake_master did not start:\n{log[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def free_ports(count: int) -> tuple[int, ...]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return tuple(sock.getsockname()[1] for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def start_store(
    directory: Path,
    capacity: str = "16M",
    lease: float | None = None,
    api_keys: Path | None = None,
    retention: str | None = None,
    remote: MasterProcess | None = None,
    remote_lend: str = "16M",
    remote_lease: float | None = None,
) -> StoreProcess:
    """A store on `directory`/store.sock (a Unix socket path must fit in 107 bytes), logging to
    `directory`/store.log; `api_keys`: its --api-keys file; `remote`: the master of the remote
    tier it stands in front of, lending it `remote_lend`."""
    path = directory / "store.sock"
    log = directory / "store.log"
    command = [sys.executable, "-m", "kmesh.cli", "store", "serve"]
    command += ["--socket", str(path), "--capacity", capacity]
    if lease is not None:
        command += ["--lease", str(lease)]
    if api_keys is not None:
        command += ["--api-keys", str(api_keys)]
    if retention is not None:
        command += ["--retention", retention]
    if remote is not None:
        command += ["--remote", remote.address, "--remote-metadata", remote.metadata]
        command += ["--remote-lend", remote_lend]
    if remote_lease is not None:
        command += ["--remote-lease", str(remote_lease)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    store = StoreProcess(str(path), process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "kmesh store: listening on" not in store.log_text():
        if process.poll() is not None or time.monotonic() > deadline:
            store.stop(signal.SIGKILL)
            raise KMeshError(f"the store did not start:\n{store.log_text()}")
        time.sleep(0.02)
    return store
