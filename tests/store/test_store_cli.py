"""`kmesh store serve` as a user runs it: clear errors, clean shutdown."""

import signal
from pathlib import Path

import pytest

from kmesh.store.process import free_ports
from tests.conftest import run_kmesh
from tests.store.helpers import chain, payload_for

SHM = Path("/dev/shm")


@pytest.mark.parametrize("capacity", ["lots", "0", "-1G", "1.5G", "12Q", ""])
def test_a_bad_capacity_exits_2_with_one_clear_line(short_dir, capacity):
    socket = str(short_dir / "s")
    result = run_kmesh("store", "serve", "--socket", socket, f"--capacity={capacity}", timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("kmesh: error: --capacity")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (short_dir / "s").exists()


@pytest.mark.parametrize("lease", ["0", "-1", "nan"])
def test_a_bad_lease_exits_2_with_one_clear_line(short_dir, lease):
    socket = str(short_dir / "s")
    result = run_kmesh(
        "store", "serve", "--socket", socket, "--capacity", "1M", f"--lease={lease}", timeout=60
    )
    assert result.returncode == 2 and result.stderr.startswith("kmesh: error: --lease")
    assert len(result.stderr.splitlines()) == 1 and not (short_dir / "s").exists()


def test_a_socket_path_that_is_a_file_or_a_live_store_is_refused(short_dir, store):
    taken = short_dir / "taken"
    taken.write_text("not a socket")
    for path, message in ((taken, "is not a socket"), (store.socket, "already listening")):
        result = run_kmesh("store", "serve", "--socket", str(path), "--capacity", "1M", timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert store.process.poll() is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_store_and_removes_its_socket_and_segments(store, sig):
    [key] = chain(1, seed=1)
    with store.client() as client:
        client.acquire([key])
        client.publish(key, payload_for(key))
        [hit] = client.acquire([key]).hits
        assert (SHM / hit.name).exists() or not SHM.is_dir()
    assert store.stop(sig) == 0
    assert not Path(store.socket).exists()
    assert not (SHM / hit.name).exists()
    assert "Traceback" not in store.log_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--remote", "nohost"], "--remote takes the master's HOST:PORT"),
        (["--remote", "127.0.0.1:1", "--remote-lend", "1M"], "--remote-lend must be 0"),
        (["--remote", "127.0.0.1:1", "--remote-lease", "0"], "--remote-lease must be positive"),
    ],
)
def test_bad_remote_flags_exit_2_with_one_clear_line(short_dir, flags, message):
    socket = str(short_dir / "s")
    result = run_kmesh("store", "serve", "--socket", socket, "--capacity", "1M", *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (short_dir / "s").exists()


def test_a_store_whose_remote_master_is_not_there_says_so_and_exits(short_dir):
    [port] = free_ports(1)
    remote = ["--remote", f"127.0.0.1:{port}", "--remote-metadata", f"http://127.0.0.1:{port}/m"]
    socket = str(short_dir / "s")
    result = run_kmesh("store", "serve", "--socket", socket, "--capacity", "16M", *remote)
    assert result.returncode == 2 and "cannot join the Mooncake Store" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (short_dir / "s").exists()
