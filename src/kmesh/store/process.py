"""Run a store as a child process (`kmesh store serve`) and wait until it listens."""

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
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


def start_store(
    directory: Path,
    capacity: str = "16M",
    lease: float | None = None,
    api_keys: Path | None = None,
    retention: str | None = None,
) -> StoreProcess:
    """A store on `directory`/store.sock (a Unix socket path must fit in 107 bytes), logging to
    `directory`/store.log; `api_keys`: its --api-keys file."""
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
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    store = StoreProcess(str(path), process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "listening on" not in store.log_text():
        if process.poll() is not None or time.monotonic() > deadline:
            store.stop(signal.SIGKILL)
            raise KMeshError(f"the store did not start:\n{store.log_text()}")
        time.sleep(0.02)
    return store
