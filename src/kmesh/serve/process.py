"""OpenAI-compatible servers as child processes, as a user starts them: `kmesh serve` and vLLM's
own server. Used by the benches that drive real clients and by the tests.

A started server is up (kmesh serve printed its ready line; vLLM answers /health). `stop()`
sends SIGTERM, as a user would, and fails loudly if it is ignored. Both run with the same glibc
allocator settings and vLLM's worker on the same cores (`_server_env`), so that side-by-side runs
differ only in what they serve.
"""

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kmesh.errors import KMeshError
from kmesh.vllm.config import ALLOCATOR_ENV, vllm_server_args

READY = re.compile(r" engine on (http://\S+) ")
STOP_TIMEOUT_S = 60


class ServerStartError(KMeshError):
    """A server process ended or stayed silent before it was ready; the message holds its log."""


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    # Like http://127.0.0.1:41234
    url: str
    # Its stderr (kmesh serve) or stdout and stderr (vLLM).
    log: Path

    def stop(self) -> str:
        """Terminate the server; return its log."""
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise ServerStartError(f"the server ignored SIGTERM:\n{self.log.read_text()}") from None
        return self.log.read_text()


def start_kmesh_serve(
    engine: str, log: Path, options: tuple[str, ...] = (), timeout: float = 120
) -> ServerProcess:
    """`kmesh serve --engine ENGINE --port 0 OPTIONS`, once it printed its ready line."""
    command = [sys.executable, "-m", "kmesh.cli", "serve", "--engine", engine, "--port", "0"]
    process = subprocess.Popen(
        [*command, *options],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=_server_env(),
    )
    lines: queue.Queue[str] = queue.Queue()

    def read_stdout() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put("")  # the process closed its stdout (it ended)

    threading.Thread(target=read_stdout, daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:
            break
        ready = READY.search(line)
        if ready:
            return ServerProcess(process, ready.group(1), log)
    process.kill()
    process.wait()
    raise ServerStartError(f"kmesh serve --engine {engine} did not start:\n{log.read_text()}")


def start_vllm_server(
    engine_kwargs: dict[str, Any], log: Path, timeout: float = 400
) -> ServerProcess:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with these engine
    settings (kmesh.vllm.config.vllm_engine_kwargs), on a free loopback port, once /health
    answers."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", *vllm_server_args(engine_kwargs)],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=_server_env(),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return ServerProcess(process, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    process.wait()
    raise ServerStartError(f"vLLM's server did not start:\n{log.read_text()[-5000:]}")


def _server_env() -> dict[str, str]:
    """The servers' environment: ALLOCATOR_ENV, and vLLM's CPU worker bound to every core this
    process may use. Left to itself, vLLM keeps one core for its scheduler, unless a KV connector
    is configured and the machine has no core to spare (then it binds them all): on 2 cores,
    plain vLLM computed on one core and vLLM with KMeshConnector on two. A variable already set
    (the test suite's one-core binding) wins."""
    cpus = sorted(os.sched_getaffinity(0))
    return {
        **ALLOCATOR_ENV,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        **os.environ,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
