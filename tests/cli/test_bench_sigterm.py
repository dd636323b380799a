"""A bench stopped with SIGTERM stops the servers it started (src/kmesh/cli/__init__.py)."""

import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.model


def test_a_bench_stopped_with_sigterm_leaves_no_server_behind(tmp_path):
    command = [sys.executable, "-m", "kmesh.cli", "bench", "agents", "--engine", "reference"]
    options = ["--agents", "2", "--rounds", "1", "--json", str(tmp_path / "out.json")]
    bench = subprocess.Popen([*command, *options], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        servers: list[psutil.Process] = []
        while not servers and time.monotonic() < deadline:
            time.sleep(0.5)
            children = psutil.Process(bench.pid).children(recursive=True)
            servers = [c for c in children if "serve" in " ".join(c.cmdline())]
        assert servers, "the bench started no server"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=90) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert alive == []
    finally:
        bench.kill()
