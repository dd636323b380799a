"""A real store process per test (`python -m kmesh.cli store serve`), killed at teardown."""

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kmesh.store import StoreClient

START_TIMEOUT_S = 20.0


@dataclass
class StoreProcess:
    socket: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, tenant: str | None = None, timeout: float = 5.0) -> StoreClient:
        return StoreClient(self.socket, tenant=tenant, timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout)


def start_store(directory: Path, capacity: str = "16M", lease: float | None = None) -> StoreProcess:
    path = directory / "store.sock"
    log = directory / "store.log"
    command = [sys.executable, "-m", "kmesh.cli", "store", "serve"]
    command += ["--socket", str(path), "--capacity", capacity]
    if lease is not None:
        command += ["--lease", str(lease)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    store = StoreProcess(str(path), process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "listening on" not in store.log_text():
        if process.poll() is not None or time.monotonic() > deadline:
            store.stop(signal.SIGKILL)
            raise RuntimeError(f"the store did not start:\n{store.log_text()}")
        time.sleep(0.02)
    return store


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path (a Unix socket path must fit in 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="kms-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def store_factory(short_dir: Path) -> Iterator[Callable[..., StoreProcess]]:
    started: list[StoreProcess] = []
    count = 0

    def make(capacity: str = "16M", lease: float | None = None) -> StoreProcess:
        nonlocal count
        count += 1
        directory = short_dir / str(count)
        directory.mkdir()
        store = start_store(directory, capacity, lease)
        started.append(store)
        return store

    yield make
    for store in started:
        store.stop()
        assert "internal error" not in store.log_text(), store.log_text()


@pytest.fixture
def store(store_factory: Callable[..., StoreProcess]) -> StoreProcess:
    return store_factory()
