"""`kmesh serve` as a user runs it: a real process on a free port, and an OpenAI client for it."""

import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai


@dataclass
class ServeProcess:
    process: subprocess.Popen[str]
    # Like http://127.0.0.1:41234
    url: str
    log: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=600)

    def stop(self) -> str:
        """Terminate the server (SIGTERM, as a user would); return what it wrote to stderr."""
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"kmesh serve ignored SIGTERM:\n{self.log.read_text()}") from None
        return self.log.read_text()


def start_serve(engine: str, log_dir: Path, timeout: float = 120) -> ServeProcess:
    """Start `kmesh serve --engine ENGINE --port 0` and wait for its ready line."""
    log = log_dir / f"serve-{engine}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "kmesh.cli", "serve", "--engine", engine, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
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
        ready = re.search(r" engine on (http://\S+) ", line)
        if ready:
            return ServeProcess(process, ready.group(1), log)
    process.kill()
    process.wait()
    raise AssertionError(f"kmesh serve --engine {engine} did not start:\n{log.read_text()}")
